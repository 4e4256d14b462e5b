"""The lean eager path of the grouped (MoE expert) linear: a plan per layer and signature.

``ops.grouped_linear._GroupedLinear`` serves every case (padding, per-expert casts, emulation,
delayed scaling's per-expert histories, CUDA-graph captures) and decides its route again for
every cast and GEMM: the segmented cast through ``Quantizer.quantize_segments_packed`` (its
peers compared, its backend read from the environment), each grouped GEMM through
``gemm_grouped`` (the path's setting, Triton's presence, the operands' packs and scale layouts
checked). A ``GroupedPlan`` makes those decisions once for a layer and a split-independent
signature (experts, K, N, dtypes, device, flags, settings) and serves the common eager step:

- current scaling (``CurrentScalingQuantizer``, no amax group), 1x128 / 128x128 blocks
  (``Block1DQuantizer`` / ``Block2DQuantizer`` with the fused kernels' options), or delayed
  scaling without ``save_original_input`` (its segmented cast called as the general path calls
  it: the experts' histories are its state);
- the experts' FP8 weights as one launch's packs (``Segments``: ``GroupedLinear`` on CUDA);
- every split a multiple of 128 (positive for current scaling), more than one expert: what the
  one-launch Triton grouped GEMMs take, and what ``ExpertPadding`` / ``grouped_linear``'s own
  padding leave on CUDA.

A step then runs the same kernels with the same arguments as the general path (the segmented
casts, ``triton_grouped.grouped_rows`` / ``grouped_kgroup`` on the casts' buffers), so the same
bits, and saves the same buffers (the saved-bytes accounting is unchanged); tests/test_lean_grouped.py
compares the two with ``torch.equal`` under Triton's interpreter, tests/test_lean_gpu.py on the
GPU. Splits vary from step to step; each step's are checked (a few integer tests) and a step
whose splits the plan does not serve takes the general path.

A plan serves the quantizer objects it was made for (a recipe change makes new ones), whose
options are not changed in place, and FP8 weights of the structure it was made for (in its key).
A backward that runs under other settings than its forward (another backend pinned, a CUDA graph
being captured, another amax group) takes the general helpers for that call.

Where the kernels do not run (a CPU without ``TRITON_INTERPRET=1``) there is no plan. A plan's
first forward that fails warns once, naming the layer, and the general path serves that
signature from then on (current and block casts keep no state, so the step runs again there);
a first backward that fails warns and the plan's backward takes the general helpers
(``_cast_split``, ``grouped_gemm_cat``, ``grouped_wgrad``) on the same saved buffers.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import gemm as gemm_mod
from .. import gemm_grouped as gg
from ..gemm import Backend
from ..quant import kernels
from ..quant.block_scaling import Block1DQuantizer, Block2DQuantizer
from ..quant.formats import ScaleLayout
from ..quant.quantizer import _grouped
from ..quant.quantizers import Segments
from ..quant.tensor import SCALE_STRIDE, Operands, Pack
from ..quant.tensor_scaling import CurrentScalingQuantizer, DelayedScalingQuantizer
from . import paths, routes
from .lean import _lean_here, save_for_gradients
from .linear import added_to_main_grads
from .padding import Padded

if TYPE_CHECKING:
    from .linear import LinearQuantizers

__all__ = ["GroupedPlan", "current_segments", "grouped_plan_for", "lean_grouped", "lean_weights"]

L = ScaleLayout
_MISSING = object()
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the Triton grouped GEMMs write


class _Decline(Exception):
    """A route found this call outside what it serves (a kernel guard turned its path off)."""


class GroupedPlan:
    """The decided routes of one grouped layer for one signature: the recipe's kind (``current``,
    ``block`` or ``delayed``), the experts' quantizers (the plan serves these objects only) and the
    flags."""

    __slots__ = ("quantizers", "kind", "blocked", "peers", "soi", "wgrad", "k", "n", "name", "proven",
                 "backward_general", "cast_choices")

    def __init__(self, quantizers: Sequence[LinearQuantizers], kind: str, soi: bool, wgrad: bool, k: int, n: int,
                 name: str) -> None:
        self.quantizers = tuple(quantizers)
        self.kind, self.blocked = kind, kind == "block"
        # each role's quantizers of every expert, for delayed scaling's segmented cast (its peers)
        self.peers = {role: [getattr(q, role) for q in quantizers] for role in ("input", "grad_output")}
        self.soi, self.wgrad, self.k, self.n, self.name = soi, wgrad, k, n, name
        self.proven = False  # a forward ran through it
        self.backward_general = False  # a backward failed on the fast routes: the general helpers serve
        # current scaling's casts, decided at their first call: per (role, rowwise, columnwise) whether
        # the dispatch takes the one-launch cast; per ("gathered", role, ...) whether the gathered cast
        # declines (every eager call alike)
        self.cast_choices: dict[tuple[Any, ...], bool] = {}

    def serves(self, quantizers: Sequence[LinearQuantizers], splits: Sequence[int]) -> bool:
        """Whether this call's experts and splits are the plan's: the same quantizer objects, every
        split a multiple of 128 (and positive for current scaling's one-launch cast)."""
        mine = self.quantizers
        if len(quantizers) != len(mine) or any(a is not b for a, b in zip(quantizers, mine)):
            return False
        if self.kind == "current":
            return not any(m <= 0 or m % 128 for m in splits)
        return not any(m % 128 for m in splits)


def grouped_plan_for(x2d: torch.Tensor, weights: Sequence[torch.Tensor], w_fp8: Segments,
                     quantizers: Sequence[LinearQuantizers], soi: bool, wgrad: bool, fuse_wgrad: bool,
                     has_bias: bool, name: str) -> GroupedPlan | None:
    """The layer's plan for this signature (kept on the first expert's quantizers with the linear
    plans, ``ops.lean``), made at its first call; None where the general path serves it."""
    if x2d.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # graphs take the general path's capture routes (cuBLAS per expert)
    q0 = quantizers[0]
    plans: dict[tuple[Any, ...], GroupedPlan | None] = q0.__dict__.setdefault("_plans", {})
    w0 = weights[0]
    key = ("grouped", len(quantizers), x2d.shape[1], x2d.dtype, x2d.device, w0.shape, w0.dtype, soi, wgrad,
           fuse_wgrad, has_bias, getattr(q0.input, "group", None), getattr(q0.grad_output, "group", None),
           _packs_signature(w_fp8), routes.settings())
    plan = plans.get(key, _MISSING)
    if plan is _MISSING or (plan is not None and not _same(plan.quantizers, quantizers)):
        plan = plans[key] = _make(x2d, weights, w_fp8, quantizers, soi, wgrad, name)
    return plan  # type: ignore[return-value]


def _packs_signature(w_fp8: Segments) -> tuple[Any, ...]:
    """What ``_make`` checks of the FP8 weights' packs (a caller may hand ``grouped_linear`` others)."""
    sig: tuple[Any, ...] = ()
    for p in (w_fp8.rows, w_fp8.cols):
        sig += (None,) if p is None else (p.layout, p.splits, p.width, p.scale_inv.dim(), p.scale_inv.stride(0))
    return sig


def _same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(p is q for p, q in zip(a, b))


def _make(x2d: torch.Tensor, weights: Sequence[torch.Tensor], w_fp8: Segments,
          quantizers: Sequence[LinearQuantizers], soi: bool, wgrad: bool, name: str) -> GroupedPlan | None:
    """A plan where the general path would take the segmented casts and the one-launch Triton
    grouped GEMMs for splits of multiples of 128; else None."""
    n_exp, dev = len(quantizers), x2d.device
    if n_exp < 2 or not _lean_here(x2d) or not kernels._kernel_device(x2d) or x2d.dim() != 2:
        return None
    if x2d.dtype not in _OUT_DTYPES or not kernels.segments_fused(x2d, True):
        return None
    if gg._grouped_backend(dev) not in ("auto", "triton") or not gg._triton_grouped_here(dev):
        return None
    q0 = quantizers[0]
    q_in, q_w, q_dy = q0.input, q0.weight, q0.grad_output
    for role in ("input", "weight", "grad_output"):
        if not getattr(q0, role)._peers_match([getattr(q, role) for q in quantizers]):
            return None
    rows, cols = w_fp8.rows, w_fp8.cols
    n, k = weights[0].shape
    if rows is None or cols is None or rows.splits != (n,) * n_exp or rows.width != k or cols.width != k:
        return None  # padded weight rows, or not every expert's weight in the packs
    if not (Pack.of(Operands(rows)) and Pack.of(Operands(cols))):
        return None
    if type(q_in) is CurrentScalingQuantizer and type(q_dy) is CurrentScalingQuantizer \
            and not (_grouped(q_in.group) or _grouped(q_dy.group)) and rows.layout is L.TENSOR:
        kind = "current"
    elif type(q_in) is Block1DQuantizer and type(q_dy) is Block1DQuantizer and type(q_w) is Block2DQuantizer:
        if any(not kernels._block_kernel_ok(x2d, True, q.block, q.power_2_scale, q.amax_epsilon) for q in (q_in, q_dy)):
            return None
        if n % 128 or k % 128 or rows.layout is not L.BLOCK_128x128 or cols.scale_inv.dim() != 3:
            return None
        kind = "block"
    elif type(q_in) is DelayedScalingQuantizer and type(q_dy) is DelayedScalingQuantizer \
            and rows.layout is L.TENSOR and not soi:  # (the flag's backward reuses each expert's kept scale)
        kind = "delayed"
    else:
        return None
    return GroupedPlan(quantizers, kind, soi, wgrad, k, n, name)


# ---- the steps' routes ------------------------------------------------------------------------
def _gathered(plan: GroupedPlan, role: str, q: Any, src: kernels.PaddedRows, splits: Sequence[int], rowwise: bool,
              columnwise: bool) -> tuple[Any, Any, Any, Any, Any] | None:
    """``_cast``'s copies of padded experts read from their unpadded rows, where the casts of the
    plan's kind do that here (blocks; current scaling where its casts run as amax, scale and cast
    launches: ``kernels.cast_current_gathered``), else None."""
    if plan.blocked:
        raw = kernels.cast_gathered(src, splits, q.fp8_dtype, "1x128", None, rowwise, columnwise)
        return (*raw, None) if raw is not None else None
    if plan.kind == "current":
        key = ("gathered", role, rowwise, columnwise)  # (it declines every eager call alike: asked once)
        if plan.cast_choices.get(key):
            return None
        out = kernels.cast_current_gathered(src, splits, q.fp8_dtype, rowwise, columnwise,
                                            power_2_scale=q.power_2_scale, amax_epsilon=q.amax_epsilon)
        if out is not None:
            row, col, scale, inv = out
            return row, inv, col, inv, scale
        from ..kernels import cuda_cast

        plan.cast_choices[key] = cuda_cast.current_setting() != "1"  # eager: the padded tensor's one launch
    return None


def _cast(plan: GroupedPlan, role: str, t: torch.Tensor | kernels.PaddedRows, splits: Sequence[int],
          off: torch.Tensor, rowwise: bool, columnwise: bool) -> tuple[Any, Any, Any, Any, Any]:
    """Every expert's copies of ``t`` in one launch, as ``quantize_segments_packed`` casts them:
    raw ``(row, row scales, col, col scales, per-tensor scales [E] | None)``. Delayed scaling
    calls it (the experts' histories and scales are its state: one stacked advance, one amax
    launch folding into the histories, the cast with the scales in force). ``t`` a
    ``PaddedRows``: cast as padded to ``splits`` without the padded tensor where a kernel can
    (``kernels.cast_gathered``), else padded first."""
    q = getattr(plan.quantizers[0], role)
    if isinstance(t, kernels.PaddedRows):
        got = _gathered(plan, role, q, t, splits, rowwise, columnwise)
        if got is not None:
            return got
        t = t.padded()
    if plan.kind == "delayed":
        seg = q.quantize_segments_packed(t, splits, peers=plan.peers[role], rowwise=rowwise, columnwise=columnwise)
        if seg is None:
            raise _Decline("no segmented delayed-scaling cast here")
        r, c = seg.rows, seg.cols
        return (r.data if r is not None else None, r.scale_inv if r is not None else None,
                c.data if c is not None else None, c.scale_inv if c is not None else None, None)
    if plan.blocked:
        from ..kernels import triton_cast

        row, row_s, col, col_s = triton_cast.cast_segments(t, off, list(splits), q.fp8_dtype, "1x128", rowwise,
                                                           columnwise)
        return row, row_s, col, col_s, None
    out = current_segments(plan.cast_choices, (role, rowwise, columnwise), q, t, splits, off, rowwise, columnwise)
    if out is None:
        raise _Decline("no current-scaling segmented cast builds here")
    row, col, scale, inv = out
    return row, inv, col, inv, scale


def current_segments(choices: dict[Any, bool], key: Any, q: Any, t: torch.Tensor, splits: Sequence[int],
                     off: torch.Tensor, rowwise: bool, columnwise: bool
                     ) -> tuple[Any, Any, torch.Tensor, torch.Tensor] | None:
    """``kernels._current_launches`` of ``t``'s segments: where its dispatch takes the one-launch
    cast (decided at the first call under ``key`` in ``choices``, which also builds the CUDA tile
    cast for later graph captures where the settings want it), that cast called directly, behind
    the same guard; else the dispatch itself. Eager calls only (a capture decides otherwise)."""
    from ..kernels import triton_cast
    from ..kernels import triton_persistent as tp

    one = choices.get(key)
    if one is None:
        one = choices[key] = (not triton_cast.cuda_current_ok(t, q.fp8_dtype, rowwise, columnwise)
                              and tp.persistent_ok(t))
    if one and kernels._one_launch.ok:
        out = kernels._one_launch(lambda: tp.cast_current_persistent(
            t, q.fp8_dtype, rowwise, columnwise, power_2_scale=q.power_2_scale, amax_epsilon=q.amax_epsilon,
            splits=list(splits), offsets=off))
        if out is not None:
            return out
    return kernels._current_launches(t, q.fp8_dtype, rowwise, columnwise, power_2_scale=q.power_2_scale,
                                     amax_epsilon=q.amax_epsilon, splits=list(splits), offsets=off)


def lean_weights(stacked: torch.Tensor, quantizers: Sequence[LinearQuantizers]) -> Segments | None:
    """Every expert's FP8 weight (both copies) from ``stacked [E * N, K]`` as current scaling's
    segmented cast makes them (``CurrentScalingQuantizer.quantize_segments_packed``: the same
    launch, buffers and bits), its checks made once per signature and kept with the layer's plans,
    and the cast called as ``current_segments`` calls it; None where that cast would not serve
    (another recipe, padded or unaligned rows, a capture, no lean path here): the caller then
    calls ``quantize_segments_packed``. As a ``GroupedPlan``, it serves the quantizer objects it
    checked, whose options are not changed in place (a recipe change makes new ones)."""
    q0 = quantizers[0]
    qw = q0.weight
    if type(qw) is not CurrentScalingQuantizer or not _lean_here(stacked) or kernels.capturing(stacked.device):
        return None
    g = len(quantizers)
    plans: dict[tuple[Any, ...], Any] = q0.__dict__.setdefault("_plans", {})
    key = ("weights", g, stacked.shape, stacked.dtype, stacked.device, qw.group, routes.settings())
    entry = plans.get(key, _MISSING)
    peers = [q.weight for q in quantizers]
    if entry is _MISSING or (entry is not None and not _same(entry[0], peers)):
        n = stacked.shape[0] // g if stacked.dim() == 2 else 0
        ok = (g > 1 and n > 0 and n % 128 == 0 and n * g == stacked.shape[0] and stacked.shape[1] > 0
              and not _grouped(qw.group) and qw._segments_apply(stacked, peers, True, True))
        entry = plans[key] = (tuple(peers), {}, [n] * g) if ok else None
    if entry is None:
        return None
    splits = entry[2]
    off = kernels.segment_offsets(splits, stacked.device)
    out = current_segments(entry[1], "weight", qw, stacked, splits, off, True, True)
    if out is None:
        return None
    row, col, scale, inv = out
    return qw._segments_out(stacked, splits, row, col, inv, scale.unbind(0))


def _record(name: str, layouts: tuple[ScaleLayout, ScaleLayout], mnk: tuple[int, int, int]) -> None:
    if gemm_mod._state.records:
        gemm_mod.record(f"{name}[triton]", Backend.NATIVE, layouts, mnk)


def _rows_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, off: torch.Tensor, g: int,
               n: int, k: int, out_dtype: torch.dtype, blocked: bool, fast_accum: bool,
               real: tuple[int, ...] | None) -> torch.Tensor:
    """``gemm_grouped._grouped_triton_rows`` on a pack's buffers: ``a [M, k]``, ``b`` every
    expert's ``[n, k]`` back to back; ``real``: the experts' counts before padding (only their
    rows are written: ``triton_grouped.grouped_rows``'s ``keep``)."""
    from ..kernels import triton_grouped

    m = a.numel() // k
    a_all = a if a.shape == (m, k) else a.as_strided((m, k), (k, 1))
    keep = (kernels.segment_offsets(real, a.device), sum(real)) if real is not None else None
    return triton_grouped.grouped_rows(a_all, b.as_strided((g, n, k), (n * k, k, 1)), sa, sb, off, out_dtype,
                                       blocked=blocked, fast_accum=fast_accum, keep=keep)


class LeanGrouped(torch.autograd.Function):
    """``_GroupedLinear``'s FP8 path on a plan: the same kernels, saved buffers and bits."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, plan: GroupedPlan, splits: tuple[int, ...], w_fp8: Segments, fuse_wgrad: bool,
        rows: torch.Tensor | None, real: tuple[int, ...] | None, *params: torch.Tensor | None,
    ) -> torch.Tensor:
        g = len(splits)
        weights, biases = params[:g], params[g:]
        q_in = plan.quantizers[0].input
        padded = Padded(rows, sum(splits)) if rows is not None else None
        ctx.pad_total = padded.total if padded is not None else None  # (the index: among the saved tensors)
        x_in = x
        # each expert's rows padded, as _GroupedLinear pads them (by the cast itself where it can)
        src = padded.source(x, real) if padded is not None and real is not None else x
        off = kernels.segment_offsets(splits, x.device)
        if x.is_cuda:
            gg._cublas_ready(x.device)  # as gemm_grouped's auto path does: a later capture needs the handle
        xr, xrs, xc, xcs, xs = _cast(plan, "input", src, splits, off, True, plan.wgrad and not plan.soi)
        w_rows, cols = w_fp8.rows, w_fp8.cols
        assert w_rows is not None and cols is not None
        m, n, k = sum(splits), plan.n, plan.k
        y = _rows_gemm(xr, xrs, w_rows.data, w_rows.scale_inv, off, g, n, k, x.dtype, plan.blocked, True, real)
        _record("fprop", (q_in.layout, w_rows.layout), (m, n, k))
        if biases and biases[0] is not None:
            from .grouped_linear import add_expert_biases

            add_expert_biases(y, real or splits, biases)
        ctx.plan, ctx.splits, ctx.real, ctx.weights, ctx.fuse_wgrad = plan, splits, real, weights, fuse_wgrad
        ctx.bias_dtype = biases[0].dtype if biases and biases[0] is not None else None
        ctx.w_layout = cols.layout
        ctx.settings, ctx.dy_group = routes.settings(), getattr(plan.quantizers[0].grad_output, "group", None)
        save_for_gradients(ctx, plan.wgrad, plan.soi, x_in, xs, xc, xcs, cols.data, cols.scale_inv,
                           (rows,) if rows is not None else ())
        paths.note("lean grouped")  # (a forward that failed above is the general path's)
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from .grouped_linear import accumulate_experts, expert_bias_grads, main_grad_stack

        plan: GroupedPlan = ctx.plan
        g = len(ctx.splits)
        dy = grad_out.contiguous()
        need_dx = ctx.needs_input_grad[0]
        need_dw = plan.wgrad and any(ctx.needs_input_grad[7 : 7 + g])
        wgrad_dtype = torch.float32 if ctx.fuse_wgrad else ctx.weights[0].dtype
        saved = ctx.saved_tensors
        dbs = expert_bias_grads(dy, ctx.real or ctx.splits, ctx.bias_dtype)
        padded = None
        src: torch.Tensor | kernels.PaddedRows = dy
        if ctx.pad_total is not None:  # the saved index, as the saved-tensor hooks hand it back
            padded = Padded(saved[0], ctx.pad_total)
            saved = saved[1:]
            src = padded.source(dy, ctx.real)
        if plan.backward_general or not _as_in_forward(ctx, plan, dy):
            dx, dws = _general_gradients(ctx, plan, dy, src, saved, padded, wgrad_dtype, need_dx, need_dw)
        else:
            # the fusion's adds in the wgrad's epilogue, where the main_grads are one FP32 buffer
            into = main_grad_stack(ctx.weights, wgrad_dtype) if ctx.fuse_wgrad and need_dw else None
            try:
                dx, dws = _gradients(ctx, plan, dy, src, saved, padded, wgrad_dtype, need_dx, need_dw, into)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - casts and GEMMs are pure: the general helpers run them again
                if getattr(ctx, "added_into", False):  # (not the wgrad already added into main_grad: it would twice)
                    raise
                if not isinstance(exc, _Decline):  # (a declined cast: its kernel guard has warned)
                    _warn_failed(plan, exc, "backward", 2)
                plan.backward_general = True
                dx, dws = _general_gradients(ctx, plan, dy, src, saved, padded, wgrad_dtype, need_dx, need_dw)
        if ctx.fuse_wgrad and need_dw:  # (None: the wgrad added them in its epilogue)
            dws = added_to_main_grads(ctx.weights) if dws is None else accumulate_experts(ctx.weights, dws)
        return dx, None, None, None, None, None, None, *dws, *dbs


def _as_in_forward(ctx: Any, plan: GroupedPlan, dy: torch.Tensor) -> bool:
    """Whether this backward runs under its forward's settings (backend pins, environment), amax
    group and outside a CUDA graph capture: the general path decides those again in backward."""
    return (routes.settings() == ctx.settings and not kernels.capturing(dy.device)
            and getattr(plan.quantizers[0].grad_output, "group", None) is ctx.dy_group)


def _aligned(scale: torch.Tensor, layout: ScaleLayout, g: int) -> torch.Tensor:
    """A saved per-tensor scale buffer with the experts' scales 16 bytes apart again, where a
    saved-tensor hook that copies (CPU offload) handed it back packed (``grouped_linear._unstash``)."""
    if layout is L.TENSOR and g > 1 and scale.stride(0) != SCALE_STRIDE:
        return kernels.aligned_copy(scale)
    return scale


def _gradients(ctx: Any, plan: GroupedPlan, dy: torch.Tensor, src: torch.Tensor | kernels.PaddedRows,
               saved: tuple[torch.Tensor, ...], padded: Padded | None, wgrad_dtype: torch.dtype, need_dx: bool,
               need_dw: bool, into: tuple[torch.Tensor, bool] | None = None
               ) -> tuple[torch.Tensor | None, list[torch.Tensor | None] | None]:
    """dgrad and wgrad as ``grouped_linear._backward_fp8`` computes them, in its order: dy's
    casts, dgrad, x's columnwise copy (``save_original_input``), wgrad. ``src``: what dy's casts
    read (``dy`` itself, or its experts to be padded). ``into``: the experts' ``main_grad`` as one
    FP32 buffer (``grouped_linear.main_grad_stack``), which the wgrad then adds into (the same
    bits as adding its FP32 output afterwards) and None stands for the wgrads."""
    splits, g = ctx.splits, len(ctx.splits)
    q0 = plan.quantizers[0]
    q_in, q_dy = q0.input, q0.grad_output
    *x_saved, wc, wcs = saved
    wcs = _aligned(wcs, ctx.w_layout, g)
    dx = None
    dws: list[torch.Tensor | None] = [None] * g
    if not (need_dx or need_dw):
        return dx, dws
    if dy.dtype not in _OUT_DTYPES or wgrad_dtype not in _OUT_DTYPES:
        raise _Decline(f"dtypes {dy.dtype} / {wgrad_dtype}")
    off = kernels.segment_offsets(splits, dy.device)
    if dy.is_cuda:
        gg._cublas_ready(dy.device)
    dyr, dyrs, dyc, dycs, _ = _cast(plan, "grad_output", src, splits, off, need_dx, need_dw)
    m, n, k = sum(splits), plan.n, plan.k
    if need_dx:  # dy [M, N] against each expert's columnwise weight [K, N]
        dx = _rows_gemm(dyr, dyrs, wc, wcs, off, g, k, n, dy.dtype, plan.blocked, False, ctx.real)
    if need_dw:
        from ..kernels import triton_grouped

        if plan.soi:  # x's columnwise copies, cast now with the forward's scales (no amax recorded)
            from ..kernels import triton_cast

            mode = "1x128" if plan.blocked else "tensor"
            scale = None if plan.blocked else _aligned(x_saved[1], q_in.layout, g)
            raw = None  # from x's unpadded rows where the cast can, else from x padded first
            if padded is not None:
                raw = kernels.cast_gathered(padded.source(x_saved[0], ctx.real), splits, q_in.fp8_dtype, mode, scale,
                                            False, True)
            if raw is None:
                x = x_saved[0] if padded is None else padded.pad(x_saved[0])
                raw = triton_cast.cast_segments(x, off, list(splits), q_in.fp8_dtype, mode, False, True, scale)
            xc, xcs = raw[2], (raw[3] if plan.blocked else kernels.aligned_reciprocal(scale))
        else:
            xc, xcs = x_saved[0], _aligned(x_saved[1], q_in.layout, g)
        dw = triton_grouped.grouped_kgroup(dyc, xc, dycs, xcs, off, n, k, wgrad_dtype, blocked=plan.blocked,
                                           into=into)
        ctx.added_into = into is not None
        dws = None if into is not None else list(dw.unbind(0))
    if need_dx:  # reported once both GEMMs ran (a failure hands both to the general calls, which report them)
        _record("dgrad", (q_dy.layout, ctx.w_layout), (m, k, n))
    if need_dw:
        _record("wgrad", (q_dy.layout, q_in.layout), (n, k, m))
    return dx, dws


def _general_gradients(ctx: Any, plan: GroupedPlan, dy: torch.Tensor, src: torch.Tensor | kernels.PaddedRows,
                       saved: tuple[torch.Tensor, ...], padded: Padded | None, wgrad_dtype: torch.dtype,
                       need_dx: bool, need_dw: bool) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """The same gradients through the general helpers, on Operands of the saved buffers."""
    from .grouped_linear import _cast_split, _roles

    splits, g = ctx.splits, len(ctx.splits)
    qs = plan.quantizers
    *x_saved, wc, wcs = saved
    w_cols = Operands(Pack(wc, _aligned(wcs, ctx.w_layout, g), (plan.n,) * g, plan.k, ctx.w_layout, True))
    dy_rows, dy_cols, _ = _cast_split(_roles(qs, "grad_output"), src, splits, rowwise=need_dx, columnwise=need_dw)
    dx = gg.grouped_gemm_cat(dy_rows, w_cols, dy.dtype, name="dgrad", keep=ctx.real) if need_dx else None
    dws: list[torch.Tensor | None] = [None] * g
    if need_dw:
        if plan.soi:
            scales = list(x_saved[1].unbind(0)) if len(x_saved) > 1 else None
            x = x_saved[0] if padded is None else padded.source(x_saved[0], ctx.real)
            _, x_cols, _ = _cast_split(_roles(qs, "input"), x, splits, rowwise=False, columnwise=True, scales=scales)
        else:
            layout = qs[0].input.layout
            x_cols = Operands(Pack(x_saved[0], _aligned(x_saved[1], layout, g), tuple(splits), plan.k, layout, True))
        dws = list(gg.grouped_wgrad(dy_cols, x_cols, wgrad_dtype, name="wgrad"))  # type: ignore[arg-type]
    return dx, dws


def _warn_failed(plan: GroupedPlan, exc: BaseException, where: str, stacklevel: int) -> None:
    warnings.warn(f"megatron_fp8: {plan.name}: the lean grouped FP8 path failed in {where} ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0] if str(exc) else ''}); "
                  + ("calls of this shape take the general path" if where == "forward" else
                     "its backward casts and GEMMs take the general calls from now on")
                  + " (MEGATRON_FP8_LEAN=0 turns the lean path off everywhere)", RuntimeWarning, stacklevel=stacklevel)


def lean_grouped(x2d: torch.Tensor, plan: GroupedPlan, splits: tuple[int, ...], w_fp8: Segments, fuse_wgrad: bool,
                 weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
                 rows: torch.Tensor | None = None, real: tuple[int, ...] | None = None) -> torch.Tensor | None:
    """``LeanGrouped`` on ``plan``; where it declines (a kernel guard turned its cast off, before
    any launch) or its first forward fails (warning, naming the layer), the plan is retired for
    this signature and None returned (the caller runs the general path)."""
    try:
        y = LeanGrouped.apply(x2d, plan, splits, w_fp8, fuse_wgrad, rows, real, *weights, *biases)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a route this device refuses: the general path serves it
        if plan.proven and not isinstance(exc, _Decline):
            raise
        plans = plan.quantizers[0].__dict__.get("_plans", {})
        for key in [k for k, p in plans.items() if p is plan]:
            plans[key] = None
        if not isinstance(exc, _Decline):
            _warn_failed(plan, exc, "forward", 4)
        return None
    plan.proven = True
    return y
