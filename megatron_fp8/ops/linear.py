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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..gemm import gemm
from ..quant.formats import ScaleLayout
from ..quant.quantizers import Quantizer
from ..quant.tensor import Operand, QuantizedTensor


@dataclass
class LinearQuantizers:
    """The three quantizers of one linear layer under the active recipe."""

    input: Quantizer
    weight: Quantizer
    grad_output: Quantizer


def mark_param_derived(qt: QuantizedTensor) -> QuantizedTensor:
    """Tag a weight's FP8 tensors so saved-tensor accounting files them under parameters."""
    for t in qt.tensors():
        t._mf_param_derived = True  # type: ignore[attr-defined]
    return qt


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _accumulate_wgrad(weight: torch.Tensor, dw: torch.Tensor) -> torch.Tensor | None:
    """Megatron's gradient-accumulation fusion: add into ``main_grad``, return a dummy grad."""
    weight.main_grad.add_(dw)  # type: ignore[attr-defined]
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True  # type: ignore[attr-defined]
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.shape, dtype=dw.dtype if dw.dtype == weight.dtype else weight.dtype,
                device=weight.device)


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
        fuse_wgrad: bool,
    ) -> torch.Tensor:
        x2d = _flat(x)
        ctx.fp8 = quantizers is not None
        ctx.x_shape, ctx.has_bias, ctx.fuse_wgrad = x.shape, bias is not None, fuse_wgrad
        ctx.save_original_input = save_original_input
        ctx.weight = weight  # a Parameter: for main_grad and dtype, never an activation
        if quantizers is None:
            y = x2d @ weight.to(x.dtype).t()
            ctx.save_for_backward(x, weight)
        else:
            assert w_fp8 is not None
            x_q = quantizers.input.quantize(x2d, rowwise=True, columnwise=not save_original_input)
            y = gemm(x_q.operand("rowwise"), w_fp8.operand("rowwise"), x.dtype, name="fprop",
                     fast_accum=True)
            w_col = w_fp8.operand("columnwise")
            ctx.quantizers, ctx.layouts = quantizers, (x_q.rowwise.layout, w_col.layout)  # type: ignore[union-attr]
            if save_original_input:
                saved_x = [x] + ([x_q.scale] if x_q.scale is not None else [])
            else:
                x_col = x_q.operand("columnwise")
                saved_x = [x_col.data, x_col.scale_inv]
            ctx.n_saved_x = len(saved_x)
            ctx.save_for_backward(*saved_x, w_col.data, w_col.scale_inv)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dy = _flat(grad_out).contiguous()
        weight = ctx.weight
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        wgrad_dtype = torch.float32 if ctx.fuse_wgrad else weight.dtype
        if not ctx.fp8:
            x, w = ctx.saved_tensors
            x2d = _flat(x)
            dx = (dy @ w.to(dy.dtype)) if need_dx else None
            dw = (dy.t() @ x2d).to(wgrad_dtype) if need_dw else None
        else:
            saved = ctx.saved_tensors
            x_saved, (w_data, w_sinv) = saved[: ctx.n_saved_x], saved[ctx.n_saved_x:]
            x_layout, w_layout = ctx.layouts
            q: LinearQuantizers = ctx.quantizers
            dy_q = q.grad_output.quantize(dy, rowwise=need_dx, columnwise=need_dw)
            dx = dw = None
            if need_dx:
                dx = gemm(dy_q.operand("rowwise"), Operand(w_data, w_sinv, w_layout),
                          grad_out.dtype, name="dgrad")
            if need_dw:
                x_col = _input_columnwise(ctx, q.input, x_saved, x_layout)
                dw = gemm(dy_q.operand("columnwise"), x_col, wgrad_dtype, name="wgrad")
        db = dy.sum(0).to(weight.dtype) if (ctx.has_bias and need_db) else None
        if dw is not None and ctx.fuse_wgrad:
            dw = _accumulate_wgrad(weight, dw)
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        return dx, dw, db, None, None, None, None


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
) -> torch.Tensor:
    """``x @ weight.T + bias`` with FP8 GEMMs when ``quantizers`` is given (high precision
    otherwise). ``w_fp8``: the weight cast rowwise and columnwise by ``quantizers.weight``."""
    if quantizers is not None and w_fp8 is None:
        with torch.no_grad():
            w_fp8 = mark_param_derived(quantizers.weight.quantize(weight, rowwise=True, columnwise=True))
    if fuse_wgrad_accumulation and not hasattr(weight, "main_grad"):
        raise RuntimeError(
            "fuse_wgrad_accumulation=True needs weight.main_grad (an FP32 buffer, as Megatron's "
            "DDP allocates); allocate it or turn the fusion off"
        )
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: input has {x.shape[-1]} features (shape {tuple(x.shape)}), "
            f"weight expects {weight.shape[1]} (shape {tuple(weight.shape)})"
        )
    return _Linear.apply(x, weight, bias, w_fp8, quantizers, save_original_input,
                         fuse_wgrad_accumulation)
