"""The linear autograd function on the GEMM core, and the ``save_original_input`` contract.

Saved for backward (x ``[M, K]`` flattened from any leading shape, w ``[N, K]``):

==========================  ======================================  =========================
path                        input                                   weight
==========================  ======================================  =========================
FP8, default                columnwise FP8 copy of x + scales        columnwise FP8 copy of w
FP8, save_original_input    the original ``x`` object (+ the per-    columnwise FP8 copy of w
                            tensor scale of its forward cast)
FP8 off                     the original ``x`` (flag changes nothing)  the weight
==========================  ======================================  =========================

With the flag, backward casts x columnwise with the forward's scale (per-tensor recipes) and
records no amax, so out, dx and dw are bitwise those of the default path.

Tensor parallelism enters only through ``comm`` (``LinearComm``): with sequence parallelism x is
the local token shard, what is saved is that *local* shard (original or columnwise FP8 copy),
and the hooks gather it along the token dim in forward and again in backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ..gemm import accumulate, gemm
from ..quant.formats import ScaleLayout
from ..quant.quantizers import Quantizer
from ..quant.tensor import Operand, QuantizedTensor
from . import paths
from .graphed import GraphedLinear, graph_for
from .lean import lean_cast, lean_linear, plan_for


@dataclass
class LinearQuantizers:
    """The three quantizers of one linear layer under the active recipe."""

    input: Quantizer
    weight: Quantizer
    grad_output: Quantizer

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave out the lean path's plans (``ops.lean``): their routes hold
        these quantizers by reference (a copy's plan would update the original's delayed-scaling
        state) and local functions (which do not pickle); and the per-layer CUDA graphs
        (``ops.graphed``), which capture the original's buffers. A copy makes its own at its
        first call."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_plans", "_graphs")}


def mark_param_derived(qt: QuantizedTensor) -> QuantizedTensor:
    """Tag a weight's FP8 tensors so saved-tensor accounting files them under parameters (and
    the buffers of the one-launch cast they are views of, which a grouped layer saves)."""
    packs = [op.pack for op in (qt.rowwise, qt.columnwise) if op is not None and op.pack is not None]
    mark_tensors_param_derived([*qt.tensors(), *(t for p in packs for t in (p.data, p.scale_inv))])
    return qt


def mark_tensors_param_derived(tensors: Iterable[torch.Tensor]) -> None:
    """Tag tensors derived from parameters (FP8 weights) for saved-tensor accounting."""
    for t in tensors:
        t._mf_param_derived = True  # type: ignore[attr-defined]


def _token_padding(x: torch.Tensor, quantizers: LinearQuantizers | None, comm: LinearComm | None) -> int:
    """Zero rows that make the token count a multiple of the block the recipe scales the wgrad
    copies by (128 for 1x128, 32 for MXFP8), as Transformer Engine's Linear takes any count;
    0 where nothing is needed. Not under sequence parallelism (the gathered shards would
    interleave padding): there the shape check below names the rule."""
    if quantizers is None or (comm is not None and getattr(comm, "sequence_parallel", True)):
        return 0
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (-tokens) % quantizers.input.layout.token_multiple


def check_wgrad_shapes(x: torch.Tensor, weight: torch.Tensor, quantizers: LinearQuantizers) -> None:
    """wgrad contracts over tokens: raise now, in forward, the error of the token-blocked
    columnwise casts backward would do (x's and dy's)."""
    tokens = x.numel() // x.shape[-1]
    quantizers.input.check_shape((tokens, x.shape[-1]), rowwise=False, columnwise=True)
    quantizers.grad_output.check_shape((tokens, weight.shape[0]), rowwise=False, columnwise=True)


def weight_row_padding(quantizer: Quantizer, rows: int) -> int:
    """Zero rows that bring a weight's out features to whole 128x128 blocks (0 for every other
    layout, and where they are whole already)."""
    block = getattr(quantizer, "block", 0) if quantizer.layout is ScaleLayout.BLOCK_128x128 else 0
    return (-rows) % block if block else 0


def cast_weight(quantizer: Quantizer, weight: torch.Tensor) -> QuantizedTensor:
    """The weight's rowwise and columnwise FP8 copies (no autograd), marked parameter-derived.
    Under 128x128 block scaling a weight whose out features are not whole blocks (DeepSeek's kv
    down-projection: 576 = 4.5 blocks) is cast with zero rows up to the next block: the partial
    block's scale comes from its real rows, and the linear slices the padded output columns off
    (its gradient gets zero columns there, which leave every scale as it is)."""
    pad = weight_row_padding(quantizer, weight.shape[0])
    with torch.no_grad():
        w = F.pad(weight, (0, 0, 0, pad)) if pad else weight
        return mark_param_derived(lean_cast(quantizer, w) or quantizer.quantize(w, rowwise=True, columnwise=True))


def unpad_wgrad(dw: torch.Tensor, n_pad: int, fused: bool) -> torch.Tensor:
    """The weight gradient without the rows of ``cast_weight``'s zero padding: its own storage (a
    slice would keep the padded rows alive in ``.grad``), or a view where it is only added into
    ``main_grad`` (``fused``)."""
    if not n_pad:
        return dw
    real = dw[: dw.shape[0] - n_pad]
    return real if fused else real.clone()


def check_float_input(x: torch.Tensor, weight: torch.Tensor, owner: str) -> None:
    """A non-floating-point input is refused as ``nn.Linear`` refuses it (FP8 off would otherwise
    cast the weight to the input's integer dtype and return zeros)."""
    if not x.is_floating_point():
        raise RuntimeError(f"{owner}: mat1 and mat2 must have the same dtype, but got {x.dtype} and {weight.dtype} "
                           f"(the input must be floating point: fp32, bf16 or fp16)")


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _accumulate_wgrad(weight: torch.Tensor, dw: torch.Tensor | None) -> torch.Tensor | None:
    """Megatron's gradient-accumulation fusion: add ``dw`` into ``main_grad`` (None: the wgrad
    GEMM added it there itself, ``gemm.accumulate``), return a dummy grad."""
    if dw is not None:
        weight.main_grad.add_(dw)  # type: ignore[attr-defined]
    return added_to_main_grad(weight)


def added_to_main_grad(weight: torch.Tensor) -> torch.Tensor | None:
    """What a fused wgrad hands autograd once its gradient is in ``main_grad``: None, or where
    Megatron tracks it (``grad_added_to_main_grad``) the flag set and a dummy grad."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True  # type: ignore[attr-defined]
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.shape, dtype=weight.dtype, device=weight.device)


def added_to_main_grads(weights: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """``added_to_main_grad`` of every expert's weight, the dummies slices of one buffer where the
    weights are alike (one allocation instead of one an expert; autograd adopts each contiguous
    slice as that weight's ``.grad`` without a copy, as it adopts a fresh tensor). The buffer lives
    until every expert's ``.grad`` is cleared (Megatron's DDP hook clears each)."""
    if len(weights) < 2 or not all(hasattr(w, "grad_added_to_main_grad") and w.shape == weights[0].shape
                                   and w.dtype == weights[0].dtype and w.device == weights[0].device for w in weights):
        return [added_to_main_grad(w) for w in weights]
    w0 = weights[0]
    for w in weights:
        w.grad_added_to_main_grad = True  # type: ignore[attr-defined]
    zero = any(getattr(w, "zero_out_wgrad", False) for w in weights)
    make = torch.zeros if zero else torch.empty
    return list(make((len(weights), *w0.shape), dtype=w0.dtype, device=w0.device).unbind(0))


class Pending(Protocol):
    """A value that may still be in flight (an async collective); ``wait()`` returns it."""

    def wait(self) -> Any: ...


@dataclass(frozen=True)
class Done:
    """A value that is already there (no communication)."""

    value: Any

    def wait(self) -> Any:
        return self.value


class LinearComm(Protocol):
    """Token-dim communication of a parallel linear, called by the autograd function.

    ``megatron_fp8.parallel`` implements it (column-parallel: gather tokens for sequence
    parallelism, reduce dgrad over the TP group). Every method starts its collective and returns
    a ``Pending``, so backward can overlap it with a GEMM. ``None`` = single device, no hooks.

    ========================  ==========================  =============================
    hook                      in (local)                  out (after ``wait()``)
    ========================  ==========================  =============================
    ``gather_input``          x_local ``[M_local, K]``    x ``[M, K]`` (high precision)
    ``gather_fp8`` rowwise    x_fp8_row ``[M_local, K]``  x_fp8_row ``[M, K]`` + scales
    ``gather_fp8`` columnwise x_fp8_col ``[K, M_local]``  x_fp8_col ``[K, M]`` + scales
    ``reduce_dgrad``          dx_partial ``[M, K]``       dx ``[M_local, K]`` (SP) or ``[M, K]``
    ========================  ==========================  =============================
    """

    def gather_input(self, x_local: torch.Tensor) -> Pending: ...

    def gather_fp8(self, op: Operand, *, columnwise: bool) -> Pending: ...

    def reduce_dgrad(self, dx_partial: torch.Tensor) -> Pending: ...


class _NoComm:
    """Single device: every hook hands its input back untouched."""

    def gather_input(self, x_local: torch.Tensor) -> Pending:
        return Done(x_local)

    def gather_fp8(self, op: Operand, *, columnwise: bool) -> Pending:
        return Done(op)

    def reduce_dgrad(self, dx_partial: torch.Tensor) -> Pending:
        return Done(dx_partial)


_NO_COMM = _NoComm()


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        w_fp8: QuantizedTensor | None,
        quantizers: LinearQuantizers | None,
        save_original_input: bool,
        wgrad: bool,
        fuse_wgrad: bool,
        comm: LinearComm | None,
    ) -> torch.Tensor:
        x2d = _flat(x)
        ctx.fp8 = quantizers is not None
        if ctx.fp8:
            paths.note("general linear")
        ctx.x_shape, ctx.has_bias, ctx.fuse_wgrad = x.shape, bias is not None, fuse_wgrad
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.save_original_input, ctx.wgrad = save_original_input, wgrad
        ctx.weight = weight  # a Parameter: for main_grad and dtype, never an activation
        ctx.comm = comm or _NO_COMM
        if quantizers is None:
            y = ctx.comm.gather_input(x2d).wait() @ weight.to(x.dtype).t()
            ctx.save_for_backward(x, weight)  # the local x: re-gathered in backward
        else:
            assert w_fp8 is not None
            ctx.n_pad = w_fp8.shape[0] - weight.shape[0]  # zero rows of a partial 128x128 block (cast_weight)
            y = _forward_fp8(ctx, x, x2d, w_fp8, quantizers)
            if ctx.n_pad:  # a copy: a view would keep the padded columns alive wherever y is saved
                y = y[:, : weight.shape[0]].contiguous()
        if bias is not None:
            y = y + bias.to(y.dtype)
        if comm is None:
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return y.reshape(-1, *x.shape[1:-1], y.shape[-1])  # dim 0 may have been gathered

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dy = _flat(grad_out).contiguous()
        weight = ctx.weight
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        wgrad_dtype = torch.float32 if ctx.fuse_wgrad else weight.dtype
        backward_gemms = _backward_fp8 if ctx.fp8 else _backward_hp
        dx, dw = backward_gemms(ctx, dy, grad_out.dtype, wgrad_dtype, need_dx, need_dw)
        db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if (ctx.has_bias and need_db) else None
        if ctx.fuse_wgrad and (dw is not None or getattr(ctx, "wgrad_added", False)):
            dw = _accumulate_wgrad(weight, dw)
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        return dx, dw, db, None, None, None, None, None, None


def _forward_fp8(ctx: Any, x: torch.Tensor, x2d: torch.Tensor, w_fp8: QuantizedTensor,
                 quantizers: LinearQuantizers) -> torch.Tensor:
    """fprop on the (gathered) rowwise FP8 x; save what backward's wgrad needs of x (the
    local shard: the original, or its columnwise FP8 copy) and w's columnwise copy."""
    soi = ctx.save_original_input
    # x's columnwise copy serves only wgrad: not cast at all without one (inference, frozen w)
    x_q = quantizers.input.quantize(x2d, rowwise=True, columnwise=ctx.wgrad and not soi)
    x_fp8_row = ctx.comm.gather_fp8(x_q.operand("rowwise"), columnwise=False).wait()
    y = gemm(x_fp8_row, w_fp8.operand("rowwise"), x.dtype, name="fprop", fast_accum=True)
    w_col = w_fp8.operand("columnwise")
    ctx.quantizers, ctx.layouts = quantizers, (x_fp8_row.layout, w_col.layout)
    if not ctx.wgrad:
        saved_x = []
    elif soi:
        saved_x = [x] + ([x_q.scale] if x_q.scale is not None else [])
    else:
        x_col = x_q.operand("columnwise")
        saved_x = [x_col.data, x_col.scale_inv]
    ctx.n_saved_x = len(saved_x)
    ctx.save_for_backward(*saved_x, w_col.data, w_col.scale_inv)
    return y


def _backward_hp(ctx: Any, dy: torch.Tensor, dx_dtype: torch.dtype, wgrad_dtype: torch.dtype,
                 need_dx: bool, need_dw: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """High-precision dgrad/wgrad; the x gather and the dgrad reduction overlap the GEMMs."""
    x, w = ctx.saved_tensors
    x_pending = ctx.comm.gather_input(_flat(x)) if need_dw else None
    dx_pending = ctx.comm.reduce_dgrad(dy @ w.to(dy.dtype)) if need_dx else None
    dw = dy.t() @ x_pending.wait() if x_pending is not None else None
    if dw is not None and not ctx.fuse_wgrad:  # (fused: main_grad.add_ widens it, exactly, as it adds)
        dw = dw.to(wgrad_dtype)
    return (dx_pending.wait() if dx_pending is not None else None), dw


def _backward_fp8(ctx: Any, dy: torch.Tensor, dx_dtype: torch.dtype, wgrad_dtype: torch.dtype,
                  need_dx: bool, need_dw: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """FP8 dgrad/wgrad. Order: start gathering x's columnwise copy, dgrad GEMM, start the
    dgrad reduction, wgrad GEMM (on the gathered x), wait: each collective hides behind a GEMM."""
    saved = ctx.saved_tensors
    x_saved, (w_data, w_sinv) = saved[: ctx.n_saved_x], saved[ctx.n_saved_x:]
    x_layout, w_layout = ctx.layouts
    q: LinearQuantizers = ctx.quantizers
    if ctx.n_pad:  # the weight's zero rows: zero gradient columns (cast_weight)
        dy = F.pad(dy, (0, ctx.n_pad))
    dy_q = q.grad_output.quantize(dy, rowwise=need_dx, columnwise=need_dw)
    x_pending = dx_pending = None
    if need_dw:
        x_col_local = _input_columnwise(ctx, q.input, x_saved, x_layout)
        x_pending = ctx.comm.gather_fp8(x_col_local, columnwise=True)
    if need_dx:
        dx = gemm(dy_q.operand("rowwise"), Operand(w_data, w_sinv, w_layout), dx_dtype, name="dgrad")
        dx_pending = ctx.comm.reduce_dgrad(dx)
    dw = None
    if x_pending is not None:
        dy_col, x_col = dy_q.operand("columnwise"), x_pending.wait()
        if ctx.fuse_wgrad and not ctx.n_pad and accumulate(dy_col, x_col, ctx.weight.main_grad):
            ctx.wgrad_added = True  # in main_grad already: the GEMM's epilogue added it
        else:
            dw = unpad_wgrad(gemm(dy_col, x_col, wgrad_dtype, name="wgrad"), ctx.n_pad, ctx.fuse_wgrad)
    return (dx_pending.wait() if dx_pending is not None else None), dw


def _input_columnwise(ctx: Any, quantizer: Quantizer, x_saved: tuple[torch.Tensor, ...],
                      layout: ScaleLayout) -> Operand:
    """The columnwise copy of x: saved, or cast now from the original with the forward's scale."""
    if not ctx.save_original_input:
        return Operand(x_saved[0], x_saved[1], layout)
    x = x_saved[0]
    scale = x_saved[1] if len(x_saved) > 1 else None
    qt = quantizer.quantize(_flat(x), rowwise=False, columnwise=True, scale=scale, record_amax=False)
    return qt.operand("columnwise")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    w_fp8: QuantizedTensor | None = None,
    quantizers: LinearQuantizers | None = None,
    save_original_input: bool = False,
    fuse_wgrad_accumulation: bool = False,
    comm: LinearComm | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with FP8 GEMMs when ``quantizers`` is given (high precision
    otherwise). ``w_fp8``: the weight cast rowwise and columnwise by ``quantizers.weight``.
    ``comm``: token-dim communication hooks of a parallel layer (``LinearComm``); with it,
    ``x`` may be a local sequence shard and dim 0 of the output the gathered length."""
    if quantizers is not None and w_fp8 is None:
        w_fp8 = cast_weight(quantizers.weight, weight)
    if fuse_wgrad_accumulation and not hasattr(weight, "main_grad") and torch.is_grad_enabled() \
            and weight.requires_grad:  # (a forward without a wgrad, inference say, needs none)
        owner = quantizers.input.name.rsplit(" ", 1)[0] + ": " if quantizers is not None else ""
        raise RuntimeError(
            f"{owner}fuse_wgrad_accumulation=True needs weight.main_grad (an FP32 buffer, as Megatron's "
            "DDP allocates); allocate it or turn the fusion off (for the parallel layers: the config's "
            "gradient_accumulation_fusion, or MEGATRON_FP8_WGRAD_FUSION=off)"
        )
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: input has {x.shape[-1]} features (shape {tuple(x.shape)}), "
            f"weight expects {weight.shape[1]} (shape {tuple(weight.shape)})"
        )
    check_float_input(x, weight, "linear")
    if quantizers is None and comm is None and bias is None and not fuse_wgrad_accumulation and weight.dtype == x.dtype:
        # FP8 off on one device: nn.Linear's own op (its autograd saves the same x and weight),
        # without our autograd function's Python on every call (the eager host cost)
        return F.linear(x, weight, bias)
    wgrad = torch.is_grad_enabled() and weight.requires_grad
    if quantizers is not None:  # a per-layer CUDA graph (opt-in), else the lean path's plan, where it has one
        assert w_fp8 is not None

        def run(x_s: torch.Tensor, w_s: QuantizedTensor, weight_s: torch.Tensor = weight,
                bias_s: torch.Tensor | None = bias) -> torch.Tensor:  # what the graph captures
            return linear(x_s, weight_s, bias_s, w_fp8=w_s, quantizers=quantizers,
                          save_original_input=save_original_input, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                          comm=comm)
        graph = graph_for(run, x, weight, bias, w_fp8, quantizers, save_original_input, fuse_wgrad_accumulation,
                          comm)
        if graph is not None:
            return GraphedLinear.apply(x, weight, bias, w_fp8, graph)
        plan = plan_for(x, weight, bias, w_fp8, quantizers, save_original_input, wgrad, fuse_wgrad_accumulation,
                        comm)
        y = lean_linear(x, weight, bias, w_fp8, plan, fuse_wgrad_accumulation) if plan is not None else None
        if y is not None:
            return y
    pad = _token_padding(x, quantizers, comm) if wgrad else 0
    if pad:  # block scales along the tokens (the wgrad copies): zero rows up to the block, sliced off
        y = linear(F.pad(x.reshape(-1, x.shape[-1]), (0, 0, 0, pad)), weight, bias, w_fp8=w_fp8, quantizers=quantizers,
                   save_original_input=save_original_input, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                   comm=comm)
        return y[: y.shape[0] - pad].reshape(*x.shape[:-1], y.shape[-1])
    if quantizers is not None and wgrad:
        check_wgrad_shapes(x, weight, quantizers)
    return _Linear.apply(x, weight, bias, w_fp8, quantizers, save_original_input, wgrad,
                         fuse_wgrad_accumulation, comm)
