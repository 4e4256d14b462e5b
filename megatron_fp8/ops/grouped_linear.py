"""The grouped (MoE expert) linear autograd function on the GEMM core.

``x [M, K]`` holds the tokens of ``n`` experts back to back, ``m_splits`` their counts
(``sum(m_splits) == M``, zeros allowed); expert ``i`` computes ``y_i = x_i @ w_i.T + b_i``.
Every expert's numbers are bitwise those of a separate ``ops.linear`` with the same weight and
quantizers: the grouped function only batches the casts and GEMMs.

Casts, per recipe (``ScaleLayout`` of the input / grad-output quantizer):

=====================  =================================  ====================================
layout                 rowwise copy (fprop x, dgrad dy)   columnwise copy (wgrad x, dy)
=====================  =================================  ====================================
TENSOR (delayed,       per expert: one scale per expert   per expert, same cast call
current)               (its own quantizer and amax)
1x128 (block),         one pass over all experts (the     per expert (blocks run along tokens),
1x32 (MXFP8)           blocks never span rows), split     each expert zero-padded to a block
=====================  =================================  ====================================

Per-tensor scales are per expert, not one for the whole ``x``: that keeps the layer bitwise a
list of separate Linears (and keeps a hot expert's amax from flattening a cold one's values).

On CUDA ``Quantizer.quantize_segments_packed`` casts every expert in one launch where it can (current
scaling: per-expert amaxes and scales in two more launches; delayed scaling: one amax launch,
each expert's history and scale kept in its own quantizer; 1x128 when every count is a multiple
of 128), with the same bits as the per-expert casts above; the per-expert scales then share one
buffer, 16 bytes apart (cuBLAS rejects unaligned scale pointers): 16 saved bytes per expert scale
instead of 4. Padded 1x128/1x32 casts stay per expert.

Zero padding of the columnwise copies: a 1x128 (1x32) columnwise block runs along the tokens
of one expert, so an expert whose count is not a multiple of the block gets zero rows appended
before its columnwise cast (x in forward or backward, dy in backward). Zeros leave every real
block's amax, and so every real value and scale, unchanged, and add exact zeros to the wgrad
sum: the result is that of a Linear run on the zero-padded tokens. Forward outputs and dgrad
never see the padding.

GEMMs: fprop and dgrad go through ``gemm_grouped.grouped_gemm_cat``, wgrad through
``gemm_grouped.grouped_wgrad``: in eager CUDA steps one Triton launch for all experts where the operands
lie back to back (as the one-launch casts leave them), else one ``torch._scaled_grouped_mm``
where it applies (SM90, per-tensor E4M3 operands), else one GEMM per expert; while a CUDA graph
is captured one cuBLAS GEMM per expert (``MEGATRON_FP8_GROUPED_GEMM`` pins a path).

Saved for backward: per expert the columnwise FP8 copy of ``x_i`` (default), or with
``save_original_input`` the original ``x`` object once (plus each expert's per-tensor scale);
per expert the columnwise FP8 weight. Copies from a one-launch cast are saved as its two
buffers (``quant.tensor.Pack``: the same storage as the experts' views), others as each
expert's data and scales. FP8 off: ``x`` and the weights.

Padding for the GEMMs (``pad_to``, on CUDA the recipe's alignment for splits the GEMMs cannot
take) happens inside the function (``ops.padding.Padded``): x is padded before its casts and dy
before its casts; the fprop and dgrad GEMMs write only the real rows (``grouped_gemm_cat``'s
``keep``), so the outputs need no unpadding. Saved: the
row index, and the padded x's FP8 copies, or with ``save_original_input`` the caller's own ``x``
(padded again in backward): no high-precision copy the caller does not hold, so the flag keeps
its meaning (a padding op outside, ``Tensor.index_copy``, saved its whole source as well).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..gemm_grouped import grouped_gemm_cat, grouped_wgrad, packed, split_rows, stacked
from ..quant.formats import ScaleLayout
from ..quant.kernels import PaddedRows, aligned_copy, device_ints
from ..quant.quantizers import Quantizer, Segments
from ..quant.tensor import SCALE_STRIDE, Operand, Operands, Pack, QuantizedTensor
from . import paths
from .lean_grouped import grouped_plan_for, lean_grouped
from .linear import (
    LinearQuantizers,
    _accumulate_wgrad,
    added_to_main_grads,
    cast_weight,
    check_float_input,
    unpad_wgrad,
)
from .padding import Padded, expert_rows

__all__ = ["GroupedArgs", "grouped_linear"]


@dataclass(frozen=True)
class GroupedArgs:
    """The non-tensor arguments of one grouped call.

    ``w_fp8`` / ``quantizers``: one per expert (``None``: FP8 off). ``name``: the owning
    layer, for error messages.
    """

    m_splits: tuple[int, ...]
    w_fp8: tuple[QuantizedTensor, ...] | Segments | None
    quantizers: tuple[LinearQuantizers, ...] | None
    save_original_input: bool = False
    fuse_wgrad: bool = False
    name: str = "GroupedLinear"
    wgrad: bool = True  # False: no weight grad will run (inference, frozen experts)
    real_splits: tuple[int, ...] | None = None  # padded inside (``m_splits`` the padded counts): the caller's


def rows_independent(layout: ScaleLayout) -> bool:
    """True when no scale spans two rows, so a cast of all experts at once equals the
    per-expert casts (1x128, 1x32, per-row)."""
    return layout.block[0] == 1


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-t.shape[0]) % multiple
    return F.pad(t, (0, 0, 0, pad)) if pad else t


# ---- casts ------------------------------------------------------------------------------------
def _cast_split(
    quantizers: Sequence[Quantizer],
    t: torch.Tensor | PaddedRows,
    m_splits: Sequence[int],
    *,
    rowwise: bool,
    columnwise: bool,
    scales: Sequence[torch.Tensor | None] | None = None,
) -> tuple[list[Operand | None], list[Operand | None], list[torch.Tensor | None]]:
    """Cast ``t [M, C]`` per expert: ``(rowwise ops, columnwise ops, per-tensor scales)``.

    Rowwise copies of row-independent layouts are cast in one pass over ``t``; columnwise
    copies are cast per expert (zero-padded, see the module docstring). ``scales``: reuse
    these per-tensor scales and record no amax (``save_original_input`` in backward).
    ``t`` a ``PaddedRows``: the experts' unpadded rows, cast as padded to ``m_splits`` without
    writing the padded tensor where a kernel can (``quantize_segments_gathered``), else padded here.
    """
    n = len(m_splits)
    if isinstance(t, PaddedRows):
        gathered = quantizers[0].quantize_segments_gathered(t, m_splits, peers=quantizers, rowwise=rowwise,
                                                            columnwise=columnwise, scales=scales)
        if gathered is not None:
            none: list[Operand | None] = [None] * n
            return (Operands(gathered.rows) if gathered.rows is not None else none,  # type: ignore[return-value]
                    Operands(gathered.cols) if gathered.cols is not None else none,
                    list(gathered.scales) if gathered.scales is not None else [None] * n)
        t = t.padded()
    seg = quantizers[0].quantize_segments_packed(t, m_splits, peers=quantizers, rowwise=rowwise,
                                                 columnwise=columnwise, scales=scales)
    if seg is not None:  # one pass over all experts (CUDA): per-expert views made only if a GEMM asks
        none: list[Operand | None] = [None] * n
        return (Operands(seg.rows) if seg.rows is not None else none,  # type: ignore[return-value]
                Operands(seg.cols) if seg.cols is not None else none,
                list(seg.scales) if seg.scales is not None else [None] * n)
    parts = t.split(list(m_splits))
    rows: list[Operand | None] = [None] * n
    cols: list[Operand | None] = [None] * n
    used: list[torch.Tensor | None] = [None] * n
    layout = quantizers[0].layout
    if rowwise and rows_independent(layout):
        whole = quantizers[0].quantize(t, rowwise=True, columnwise=False)  # stateless quantizers
        rows = list(split_rows(whole.operand("rowwise"), m_splits))
        rowwise = False
    multiple = layout.token_multiple
    for i, part in enumerate(parts):
        if not (rowwise or columnwise):
            break
        reuse = scales[i] if scales is not None else None
        src = _pad_rows(part, multiple) if (columnwise and not rowwise) else part
        qt = quantizers[i].quantize(src, rowwise=rowwise, columnwise=columnwise, scale=reuse,
                                    record_amax=reuse is None)
        rows[i] = qt.rowwise if rowwise else rows[i]
        cols[i] = qt.columnwise
        used[i] = qt.scale
    return rows, cols, used


def _roles(quantizers: Sequence[LinearQuantizers], role: str) -> list[Quantizer]:
    return [getattr(q, role) for q in quantizers]


# ---- saved-tensor bookkeeping -------------------------------------------------------------
def _save(ctx: Any, groups: Sequence[Sequence[torch.Tensor]]) -> None:
    """Save tensor groups flat; ``_load`` hands them back grouped."""
    flat: list[torch.Tensor] = []
    ctx.spans = []
    for g in groups:
        ctx.spans.append((len(flat), len(g)))
        flat += list(g)
    ctx.save_for_backward(*flat)


def _load(ctx: Any) -> list[tuple[torch.Tensor, ...]]:
    saved = ctx.saved_tensors
    return [saved[s : s + k] for s, k in ctx.spans]


_PackMeta = tuple[tuple[int, ...], int, ScaleLayout, bool]


def _stash(ops: Sequence[Operand]) -> tuple[list[torch.Tensor], _PackMeta | ScaleLayout]:
    """What to save of the experts' Operands, and how ``_unstash`` rebuilds them: the two buffers
    of the segmented cast they are the views of (``Pack``: the same storage, two saved tensors
    instead of two per expert, and backward rebuilds them as one pack for the grouped GEMMs),
    else each expert's data and scales."""
    p = Pack.of(ops)
    if p is not None:
        return [p.data, p.scale_inv], (p.splits, p.width, p.layout, p.columnwise)
    return [t for op in ops for t in (op.data, op.scale_inv)], ops[0].layout


def _unstash(saved: Sequence[torch.Tensor], meta: _PackMeta | ScaleLayout) -> Sequence[Operand]:
    if isinstance(meta, ScaleLayout):
        return [Operand(d, s, meta) for d, s in zip(saved[::2], saved[1::2])]
    data, scale = saved
    if meta[2] is ScaleLayout.TENSOR and len(meta[0]) > 1 and scale.stride(0) != SCALE_STRIDE:
        # a saved-tensor hook that copies (CPU offload) hands back the experts' scales packed
        # together; each GEMM scale pointer must be 16-byte aligned again
        scale = aligned_copy(scale)
    return Operands(Pack(data, scale, *meta))


# ---- the function ---------------------------------------------------------------------------
class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, args: GroupedArgs, rows: torch.Tensor | None,  # type: ignore[override]
                *params: torch.Tensor | None) -> torch.Tensor:
        n = len(args.m_splits)
        weights, biases = params[:n], params[n:]
        ctx.args, ctx.n, ctx.weights = args, n, weights  # Parameters: main_grad and dtype only
        if len({b is None for b in biases}) > 1:
            raise ValueError(f"{args.name}: give a bias for every expert or for none "
                             f"(got {sum(b is not None for b in biases)} of {n})")
        ctx.has_bias = biases[0] is not None
        ctx.bias_dtype = biases[0].dtype if ctx.has_bias else None
        if args.quantizers is None:
            y = _forward_hp(ctx, x, weights)
        else:  # (the index is saved; backward rebuilds the padding from it and the total)
            paths.note("general grouped")
            padded = Padded(rows, sum(args.m_splits)) if rows is not None else None
            ctx.pad_total = padded.total if padded is not None else None
            y = _forward_fp8(ctx, x, args, padded)
        if ctx.has_bias:  # y is this function's fresh output
            add_expert_biases(y, args.real_splits or args.m_splits, biases)
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        args, n = ctx.args, ctx.n
        dy = grad_out.contiguous()
        need_dx = ctx.needs_input_grad[0]
        need_dw = any(ctx.needs_input_grad[3 : 3 + n])
        wgrad_dtype = torch.float32 if args.fuse_wgrad else ctx.weights[0].dtype
        run = _backward_fp8 if args.quantizers is not None else _backward_hp
        dbs = expert_bias_grads(dy, args.real_splits or args.m_splits, ctx.bias_dtype)
        dx, dws = run(ctx, dy, wgrad_dtype, need_dx, need_dw)
        if args.fuse_wgrad:
            dws = accumulate_experts(ctx.weights, dws)
        return dx, None, None, *dws, *dbs


def add_expert_biases(y: torch.Tensor, splits: Sequence[int], biases: Sequence[torch.Tensor | None]) -> None:
    """Each expert's bias added in place to its rows of ``y`` (a grouped function's fresh output)."""
    for yi, b in zip(y.split(list(splits)), biases):
        yi.add_(b.to(yi.dtype))  # type: ignore[union-attr]


def expert_bias_grads(dy: torch.Tensor, splits: Sequence[int], bias_dtype: torch.dtype | None
                      ) -> list[torch.Tensor | None]:
    """Each expert's bias gradient (its rows of ``dy`` summed in FP32); Nones without biases."""
    if bias_dtype is None:
        return [None] * len(splits)
    return [d.sum(0, dtype=torch.float32).to(bias_dtype) for d in dy.split(list(splits))]


def main_grad_stack(weights: Sequence[torch.Tensor], dtype: torch.dtype | None = None
                    ) -> tuple[torch.Tensor, bool] | None:
    """The experts' ``main_grad`` as one ``[E, N, K]`` view and whether it runs from the last
    expert's (Megatron's gradient buffers lay parameters out in reverse), where they lie back to
    back in one buffer in either order (and are of ``dtype``, where given); else None."""
    mains = [w.main_grad for w in weights]  # type: ignore[attr-defined]
    if len(mains) < 2 or (dtype is not None and mains[0].dtype != dtype):
        return None
    if packed(mains):
        return stacked(mains[0], len(mains)), False
    if packed(mains[::-1]):
        return stacked(mains[-1], len(mains)), True
    return None


def accumulate_experts(weights: Sequence[torch.Tensor], dws: Sequence[torch.Tensor | None]
                       ) -> list[torch.Tensor | None]:
    """Megatron's gradient-accumulation fusion for every expert: each ``dw`` added into its weight's
    ``main_grad`` (``ops.linear._accumulate_wgrad``). Where the ``dw`` are the grouped wgrad's
    ``[E, N, K]`` buffer in expert order and the ``main_grad`` lie back to back in one buffer (in
    expert order, or reversed: ``main_grad_stack``), that is one add instead of one an expert: the
    same elementwise sums. A ``dw`` narrower than its ``main_grad`` (a BF16 GEMM's) is widened by
    the add itself, exactly (no FP32 copy of it first)."""
    n = len(weights)
    if n > 1 and all(d is not None for d in dws) and packed(dws):  # type: ignore[arg-type]
        src = stacked(dws[0], n)  # type: ignore[arg-type]
        mains = main_grad_stack(weights)
        if mains is not None:
            main, reversed_ = mains
            main.add_(src.flip(0) if reversed_ else src)
            return added_to_main_grads(weights)
    return [_accumulate_wgrad(w, d) if d is not None else None for w, d in zip(weights, dws)]


def _grouped_mm_ok(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether FP8-off GEMMs go through ``torch._grouped_mm`` (one launch per GEMM instead of one
    per expert): BF16 input and weights, the weights in one buffer (``gemm_grouped.packed``), rows
    of 16-byte multiples, and a torch and device that have the op (SM90+ on CUDA). On the CPU it
    runs a matmul per expert, bit for bit the loop's."""
    w0 = weights[0]
    n, k = w0.shape
    return (hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16 and w0.dtype == torch.bfloat16
            and n % 8 == 0 and k % 8 == 0 and x.is_contiguous() and x.data_ptr() % 16 == 0
            and (x.device.type == "cpu" or (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9))
            and packed(weights))


def _ends(splits: Sequence[int], device: torch.device) -> torch.Tensor:
    """The experts' cumulative row ends as ``torch._grouped_mm`` takes them (int32, shared)."""
    return device_ints(tuple(itertools.accumulate(splits)), device, torch.int32)


def _forward_hp(ctx: Any, x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    ctx.save_for_backward(x, *weights)
    ctx.grouped_mm = _grouped_mm_ok(x, weights)  # decided once: backward reuses it
    if ctx.grouped_mm:
        w = stacked(weights[0], len(weights))
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=_ends(ctx.args.m_splits, x.device))
    ys = [xi @ w.to(x.dtype).t() for xi, w in zip(x.split(list(ctx.args.m_splits)), weights)]
    return torch.cat(ys) if len(ys) > 1 else ys[0]


def _backward_hp(ctx: Any, dy: torch.Tensor, wgrad_dtype: torch.dtype, need_dx: bool,
                 need_dw: bool) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    x, *weights = ctx.saved_tensors
    splits = list(ctx.args.m_splits)
    if ctx.grouped_mm and dy.dtype == torch.bfloat16 and dy.data_ptr() % 16 == 0:
        ends = _ends(splits, dy.device)
        dx = torch._grouped_mm(dy, stacked(weights[0], len(weights)), offs=ends) if need_dx else None
        if not need_dw:
            return dx, [None] * len(weights)
        dw = torch._grouped_mm(dy.t(), x, offs=ends)  # [E, N, K]
        for i in (i for i, m in enumerate(splits) if m == 0):  # an expert without tokens: zeros, never
            dw[i].zero_()  # what a kernel leaves in a group with nothing to sum (the CPU's are zeros)
        if not ctx.args.fuse_wgrad:  # (fused: main_grad.add_ widens it, exactly, as it adds)
            dw = dw.to(wgrad_dtype)  # one cast: the experts' grads stay one buffer
        return dx, list(dw.unbind(0))
    dys, xs = dy.split(splits), x.split(splits)
    dx = torch.cat([d @ w.to(dy.dtype) for d, w in zip(dys, weights)]) if need_dx else None
    dws = [(d.t() @ xi if ctx.args.fuse_wgrad else (d.t() @ xi).to(wgrad_dtype)) if need_dw else None
           for d, xi in zip(dys, xs)]
    return dx, dws


def _forward_fp8(ctx: Any, x: torch.Tensor, args: GroupedArgs, padded: Padded | None) -> torch.Tensor:
    """Cast x (rowwise; columnwise too unless ``save_original_input``), fprop per expert, save.
    ``padded``: the experts' rows are padded for the casts (read as zeros where the cast can) and
    the fprop GEMMs write only the real rows; the original ``x`` is what ``save_original_input``
    saves (the caller's tensor, not a copy)."""
    assert args.quantizers is not None and args.w_fp8 is not None
    soi, x_in = args.save_original_input, x
    src = padded.source(x, args.real_splits) if padded is not None and args.real_splits else x
    inputs = _roles(args.quantizers, "input")
    # x's columnwise copies serve only wgrad: not cast at all without one
    x_rows, x_cols, x_scales = _cast_split(inputs, src, args.m_splits, rowwise=True,
                                           columnwise=args.wgrad and not soi)
    w_rows, w_cols = _weight_operands(args.w_fp8)
    # (padded: the GEMMs write only the real rows, ``gemm_grouped.grouped_gemm_cat``'s ``keep``)
    y = grouped_gemm_cat(x_rows, w_rows, x.dtype, name="fprop", fast_accum=True, keep=args.real_splits)
    n_out = ctx.weights[0].shape[0]
    ctx.n_pad = y.shape[1] - n_out  # zero rows of a partial 128x128 weight block (ops.linear.cast_weight)
    if ctx.n_pad:
        y = y[:, :n_out].contiguous()
    w_saved, ctx.w_meta = _stash(w_cols)
    ctx.x_meta = None
    orig: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    x_saved: list[torch.Tensor] = []
    if args.wgrad and soi:
        orig, scales = [x_in], [s for s in x_scales if s is not None]
    elif args.wgrad:
        x_saved, ctx.x_meta = _stash(x_cols)  # type: ignore[arg-type]
    _save(ctx, [orig, scales, x_saved, w_saved, [padded.rows] if padded is not None else []])
    return y


def _weight_operands(w_fp8: Sequence[QuantizedTensor] | Segments
                     ) -> tuple[Sequence[Operand], Sequence[Operand]]:
    """The experts' rowwise and columnwise FP8 weights: a one-launch cast's packs as they are, or
    each expert's QuantizedTensor's copies."""
    if isinstance(w_fp8, Segments):
        assert w_fp8.rows is not None and w_fp8.cols is not None
        return Operands(w_fp8.rows), Operands(w_fp8.cols)
    return [w.operand("rowwise") for w in w_fp8], [w.operand("columnwise") for w in w_fp8]


def _saved_x_columnwise(ctx: Any, orig: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                        x_saved: Sequence[torch.Tensor], padded: Padded | None) -> Sequence[Operand]:
    """Each expert's columnwise x: saved, or cast now from the saved original with the forward's
    per-expert scales (recording no amax)."""
    args: GroupedArgs = ctx.args
    if not args.save_original_input:
        return _unstash(x_saved, ctx.x_meta)
    (x,) = orig
    src = padded.source(x, args.real_splits) if padded is not None and args.real_splits else x
    inputs = _roles(args.quantizers, "input")
    _, cols, _ = _cast_split(inputs, src, args.m_splits, rowwise=False, columnwise=True,
                             scales=list(scales) if scales else None)
    return cols  # type: ignore[return-value]


def _backward_fp8(ctx: Any, dy: torch.Tensor, wgrad_dtype: torch.dtype, need_dx: bool,
                  need_dw: bool) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    args: GroupedArgs = ctx.args
    n = ctx.n
    orig, scales, x_saved, w_saved, rows = _load(ctx)
    padded = Padded(rows[0], ctx.pad_total) if rows else None  # the index as the saved-tensor hooks hand it back
    grads = _roles(args.quantizers, "grad_output")
    src: torch.Tensor | PaddedRows = dy
    if ctx.n_pad:  # the weights' zero rows: zero gradient columns
        dy = F.pad(padded.pad(dy) if padded is not None else dy, (0, ctx.n_pad))
        src = dy
    elif padded is not None:
        src = padded.source(dy, args.real_splits)
    dy_rows, dy_cols, _ = _cast_split(grads, src, args.m_splits, rowwise=need_dx, columnwise=need_dw)
    dx = None
    if need_dx:
        dx = grouped_gemm_cat(dy_rows, _unstash(w_saved, ctx.w_meta), dy.dtype, name="dgrad", keep=args.real_splits)
    dws: list[torch.Tensor | None] = [None] * n
    if need_dw:
        x_cols = _saved_x_columnwise(ctx, orig, scales, x_saved, padded)
        dws = grouped_wgrad(dy_cols, x_cols, wgrad_dtype, name="wgrad")
        dws = [unpad_wgrad(d, ctx.n_pad, args.fuse_wgrad) for d in dws]
    return dx, dws


def layout_rows(layout: ScaleLayout, device: torch.device | None = None) -> int:
    """Rows per expert that GEMMs on activations cast with ``layout`` need to run natively: 128 for
    1x128 blocks, 32 for MXFP8; per-tensor scales 16 (cuBLAS), or 128 on a CUDA ``device``,
    whichever grouped GEMM runs. Why 128 there: the one-launch Triton grouped GEMMs (eager ``auto``)
    take whole 128-row tiles, and the segmented casts of every backend take their fast aligned
    kernels only for 128-row segments. Until 2026-12-06 a graphed step (cuBLAS per expert) padded
    router splits to 16, and its unaligned segmented cast of x took 1164 us where the aligned one
    takes ~90 (H100, 8 experts, ~16k rows, K=4096; docs/benchmarks.md run AI). The extra zero rows
    are at most 127 per expert."""
    if layout is ScaleLayout.BLOCK_1x128:
        return 128
    if layout is ScaleLayout.MX_1x32:
        return 32
    return 128 if device is not None and device.type == "cuda" else 16


def native_rows(quantizers: Sequence[LinearQuantizers] | None, device: torch.device) -> int:
    """``layout_rows`` of the experts' input casts on CUDA; 1 with FP8 off or off CUDA."""
    if not quantizers or device.type != "cuda":
        return 1
    return layout_rows(quantizers[0].input.layout, device)


def _as_count(m: object) -> object:
    """An integer-like token count (Python or NumPy int) as an int; anything else as it is."""
    if isinstance(m, int):  # bool included: the checks below name it
        return m
    try:
        return operator.index(m)  # type: ignore[arg-type]  # NumPy / torch integer scalars
    except TypeError:
        return m


def check_m_splits(m_splits: Sequence[int] | torch.Tensor, num_gemms: int, rows: int, owner: str) -> tuple[int, ...]:
    """``m_splits`` as a tuple of ints, or a ValueError naming the layer and the fix."""
    if isinstance(m_splits, torch.Tensor):
        m_splits = m_splits.tolist()
    if m_splits is None or isinstance(m_splits, (str, bytes)) or not hasattr(m_splits, "__len__"):
        raise TypeError(f"{owner}: m_splits={m_splits!r}; pass the tokens of each local expert as a list of "
                        f"{num_gemms} ints (or a 1-D integer tensor), e.g. [{', '.join(['128'] * min(num_gemms, 3))}"
                        f"{', ...' if num_gemms > 3 else ''}]")
    splits = tuple(_as_count(m) for m in m_splits)
    if len(splits) != num_gemms:
        raise ValueError(f"{owner}: m_splits has {len(splits)} entries, but the layer has {num_gemms} "
                         f"experts (num_gemms); pass one token count per local expert")
    bad = [(i, m) for i, m in enumerate(splits) if isinstance(m, bool) or not isinstance(m, int) or m < 0]
    if bad:
        i, m = bad[0]
        raise ValueError(f"{owner}: m_splits[{i}]={m!r}; token counts must be non-negative ints")
    if sum(splits) != rows:
        raise ValueError(f"{owner}: m_splits {list(splits)} sum to {sum(splits)}, but the input has {rows} "
                         f"tokens (rows); the counts must add up to the tokens routed to these experts")
    return splits


def grouped_linear(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor] | None,
    m_splits: Sequence[int] | torch.Tensor,
    *,
    w_fp8: Sequence[QuantizedTensor] | Segments | None = None,
    quantizers: Sequence[LinearQuantizers] | None = None,
    save_original_input: bool = False,
    fuse_wgrad_accumulation: bool = False,
    name: str = "grouped_linear",
    pad_to: int | None = None,
) -> torch.Tensor:
    """``cat_i(x_i @ weights[i].T + biases[i])`` over the experts' token groups of ``x [..., K]``
    (``m_splits`` counts rows of ``x`` flattened to 2-D). FP8 GEMMs when ``quantizers`` (one per
    expert) is given; ``w_fp8``: the weights cast rowwise and columnwise, one QuantizedTensor per
    expert or one launch's ``Segments`` (cast here if None).

    ``pad_to``: each expert's rows are padded with zeros to a multiple of it (and the padding
    dropped from the output), so that every expert GEMM runs natively for any split; default on
    CUDA the recipe's native alignment (``native_rows``), elsewhere 1 (the emulated GEMMs take
    any split). Zero rows change no output row and add zeros to every gradient sum. With FP8 off
    nothing is padded (high-precision GEMMs take any split)."""
    n = len(weights)
    check_float_input(x, weights[0], name)
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (a reshape to itself: a view and its backward node)
    splits = check_m_splits(m_splits, n, x2d.shape[0], name)
    # (high-precision GEMMs take any split: with FP8 off zero rows would change nothing)
    align = 1 if quantizers is None else pad_to if pad_to is not None else native_rows(quantizers, x2d.device)
    rows: torch.Tensor | None = None
    real: tuple[int, ...] | None = None
    if align > 1 and any(m % align for m in splits):  # padded inside the function (``Padded``)
        rows, padded = expert_rows(splits, align, x2d.device)
        real, splits = splits, tuple(padded)
    k = weights[0].shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"{name}: input has {x.shape[-1]} features (shape {tuple(x.shape)}), the experts' "
                         f"weights expect {k}")
    if quantizers is not None and len(quantizers) != n:
        raise ValueError(f"{name}: {len(quantizers)} quantizer sets for {n} experts")
    wgrad = torch.is_grad_enabled() and any(w.requires_grad for w in weights)
    if fuse_wgrad_accumulation and wgrad and not all(hasattr(w, "main_grad") for w in weights):
        # (a forward without a wgrad needs none)
        raise RuntimeError(f"{name}: fuse_wgrad_accumulation=True needs main_grad on every expert weight (an "
                           f"FP32 buffer, as Megatron's DDP allocates); allocate it or turn the fusion off")
    if quantizers is not None and w_fp8 is None:
        w_fp8 = [cast_weight(q.weight, w) for q, w in zip(quantizers, weights)]
    if isinstance(w_fp8, Segments) and w_fp8.rows is not None and len(w_fp8.rows.splits) != n:
        raise ValueError(f"{name}: FP8 weights of {len(w_fp8.rows.splits)} experts for {n} experts")
    args = GroupedArgs(splits, w_fp8 if isinstance(w_fp8, Segments) or w_fp8 is None else tuple(w_fp8),
                       tuple(quantizers) if quantizers is not None else None,
                       save_original_input, fuse_wgrad_accumulation, name, wgrad, real)
    bias_list = list(biases) if biases is not None else [None] * n
    if quantizers is not None and isinstance(w_fp8, Segments) and len({b is None for b in bias_list}) == 1:
        plan = grouped_plan_for(x2d, weights, w_fp8, quantizers, save_original_input, wgrad, fuse_wgrad_accumulation,
                                bias_list[0] is not None, name)  # the lean path's plan, where it has one
        if plan is not None and plan.serves(quantizers, splits):
            y = lean_grouped(x2d, plan, splits, w_fp8, fuse_wgrad_accumulation, weights, bias_list, rows, real)
            if y is not None:
                return _unflat(y, x)
    return _unflat(_GroupedLinear.apply(x2d, args, rows, *weights, *bias_list), x)


def _unflat(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The 2-D output ``y`` shaped as ``x`` with its last dim ``y``'s; ``y`` itself for a 2-D ``x``."""
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
