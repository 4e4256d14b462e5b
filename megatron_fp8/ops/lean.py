"""The lean eager path of the FP8 linear: a plan per layer and input signature.

``ops.linear._Linear`` serves every case (token and weight padding, any device, CUDA-graph
captures) and pays for it on every call. A ``LinearPlan`` serves the common one (no padding,
eager) with routes (``ops.routes``) decided at its first call: x's cast, dy's cast and the three
GEMMs; a tensor-parallel layer's communication (``LinearComm``: the FP8 gathers of sequence
parallelism, the dgrad reduction) runs inside it in ``_Linear``'s order. Its autograd function
saves exactly what ``_Linear`` saves (the same tensors of the same casts: ``save_original_input``
and the saved-bytes accounting are unchanged) and computes the same bits: the routes launch what
the general path launches, and tests/test_lean.py compares the two paths with ``torch.equal`` for
every recipe, with the flag on and off, on one device and at TP=2.

Plans live on the layer's ``LinearQuantizers`` (so a new recipe starts without them), keyed by
the input's shape, dtype and device, the weight's shape and dtype, the flags, the
amax-reduction groups and the settings (``routes.settings``). ``MEGATRON_FP8_LEAN``: ``auto``
(the default) makes plans for CUDA inputs, ``1`` on any device (routes there are the general
calls: how the CPU tests run this autograd function), ``0`` none. A plan's first forward that
fails warns once, naming the layer, and the general path serves that layer's signature from
then on.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from ..quant.tensor import Operand, QuantizedTensor
from ..settings import env_choice
from . import paths, routes

if TYPE_CHECKING:
    from .linear import LinearQuantizers

_MISSING = object()


def lean_mode() -> str:
    """``MEGATRON_FP8_LEAN``: ``auto`` (plans for CUDA inputs), ``1`` (any device) or ``0``."""
    return env_choice("MEGATRON_FP8_LEAN", "auto",
                      {"auto": "plans for CUDA inputs", "1": "any device", "0": "the general path only"})


def _lean_here(t: torch.Tensor) -> bool:
    """Whether ``MEGATRON_FP8_LEAN`` lets the lean path serve tensors on ``t``'s device."""
    lean = lean_mode()
    return lean == "1" or (lean == "auto" and t.is_cuda)


def lean_cast(q: Any, w: torch.Tensor) -> QuantizedTensor | None:
    """Both copies of a weight through its route (``routes.cast_route``), where the lean path
    makes plans for ``w``'s device; else None (the caller quantizes)."""
    if not _lean_here(w) or w.dim() != 2 or not w.numel():
        return None
    row, row_s, col, col_s, scale = routes.cast_route(q, w, True, True)(w)
    return QuantizedTensor(w.shape, w.dtype, q.fp8_dtype, Operand(row, row_s, q.layout), Operand(col, col_s, q.layout),
                           scale)


class LinearPlan:
    """The routes of one linear for one input signature: x's cast, the three GEMMs (made at
    their first use, from the operands they first see) and dy's cast."""

    __slots__ = ("q", "soi", "wgrad", "comm", "cast_x", "fprop", "dgrad", "wgrad_gemm", "wgrad_add", "dy_route",
                 "out_dtype", "proven", "backward_proven")

    def __init__(self, q: LinearQuantizers, x2d: torch.Tensor, soi: bool, wgrad: bool, comm: Any) -> None:
        self.q, self.soi, self.wgrad, self.comm = q, soi, wgrad, comm
        self.cast_x = routes.cast_route(q.input, x2d, True, wgrad and not soi)
        self.fprop: routes.GemmRoute | None = None
        self.dgrad: routes.GemmRoute | None = None
        self.wgrad_gemm: routes.GemmRoute | None = None
        self.wgrad_add: routes.AccumulateRoute | None = None  # the wgrad added into main_grad (fused)
        self.dy_route: routes.CastRoute | None = None
        self.out_dtype = x2d.dtype
        self.proven = False  # a forward ran through it
        self.backward_proven = False  # a backward ran through it


def plan_for(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, w_fp8: QuantizedTensor,
             q: LinearQuantizers, soi: bool, wgrad: bool, fuse_wgrad: bool, comm: Any = None) -> LinearPlan | None:
    """The layer's plan for this call, made at its first call; None where the general path
    serves it (padding, a capture, FP8 state it does not cover, the lean path off)."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # graphs take the general path's capture routes
    plans: dict[tuple[Any, ...], LinearPlan | None] = q.__dict__.setdefault("_plans", {})
    key = (x.shape, x.dtype, x.device, weight.shape, weight.dtype, w_fp8.shape[0], w_fp8.rowwise is None,
           w_fp8.columnwise is None, soi, wgrad, fuse_wgrad, bias is None, comm, getattr(q.input, "group", None),
           getattr(q.grad_output, "group", None), routes.settings())
    plan = plans.get(key, _MISSING)
    if plan is _MISSING:
        plan = plans[key] = _make(x, weight, w_fp8, q, soi, wgrad, comm)
    return plan  # type: ignore[return-value]


def _make(x: torch.Tensor, weight: torch.Tensor, w_fp8: QuantizedTensor, q: LinearQuantizers, soi: bool,
          wgrad: bool, comm: Any) -> LinearPlan | None:
    if not _lean_here(x) or x.dim() < 1 or x.shape[-1] == 0:
        return None
    if w_fp8.shape[0] != weight.shape[0] or w_fp8.rowwise is None or w_fp8.columnwise is None:
        return None  # padded weight rows (ops.linear.cast_weight), or a weight cast without both copies
    if wgrad:
        from .linear import _token_padding, check_wgrad_shapes

        if _token_padding(x, q, comm):
            return None  # the general path pads the tokens
        try:  # the casts backward will do: the general path raises its errors
            check_wgrad_shapes(x, weight, q)
        except ValueError:
            return None
    return LinearPlan(q, x.reshape(-1, x.shape[-1]), soi, wgrad, comm)


def save_for_gradients(ctx: Any, wgrad: bool, soi: bool, x: torch.Tensor, xs: torch.Tensor | None, xc: Any, xcs: Any,
                       w_data: torch.Tensor, w_scale: torch.Tensor, first: tuple[torch.Tensor, ...] = ()) -> None:
    """Save what a lean backward reads, as the general paths save it: ``first`` (the grouped
    layer's padding index), x's columnwise copy (with ``save_original_input``: x itself and its
    per-tensor scale, if any; nothing without a wgrad), then the weight's columnwise copy."""
    if not wgrad:
        saved: tuple[torch.Tensor, ...] = ()
    elif soi:
        saved = (x, xs) if xs is not None else (x,)
    else:
        saved = (xc, xcs)
    ctx.save_for_backward(*first, *saved, w_data, w_scale)


class LeanLinear(torch.autograd.Function):
    """``ops.linear._Linear``'s FP8 path on a plan: the same saved tensors and bits."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, w_fp8: QuantizedTensor,
        plan: LinearPlan, fuse_wgrad: bool,
    ) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        xr, xrs, xc, xcs, xs = plan.cast_x(x2d)
        if plan.comm is not None:  # sequence parallelism: the rowwise FP8 copy of every rank's tokens
            row = plan.comm.gather_fp8(Operand(xr, xrs, plan.q.input.layout), columnwise=False).wait()
            xr, xrs = row.data, row.scale_inv
        wr, wc = w_fp8.rowwise, w_fp8.columnwise
        fprop = plan.fprop
        if fprop is None:
            fprop = routes.gemm_route("fprop", Operand(xr, xrs, plan.q.input.layout), wr, x.dtype, True)
            if not getattr(fprop, "relearn", False):
                plan.fprop = fprop
        y = fprop(xr, xrs, wr.data, wr.scale_inv)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.plan, ctx.weight, ctx.x_shape, ctx.fuse_wgrad = plan, weight, x.shape, fuse_wgrad
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.w_layout = wc.layout
        save_for_gradients(ctx, plan.wgrad, plan.soi, x, xs, xc, xcs, wc.data, wc.scale_inv)
        paths.note("lean linear")  # (a forward that failed above is the general path's)
        if plan.comm is not None:
            return y.reshape(-1, *x.shape[1:-1], y.shape[-1])  # dim 0 may have been gathered
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from .linear import _accumulate_wgrad

        plan: LinearPlan = ctx.plan
        dy = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        need_dw = need_dw and plan.wgrad
        saved = ctx.saved_tensors
        if plan.backward_proven:
            dx, dw = _gradients(ctx, plan, dy, grad_out.dtype, saved, need_dx, need_dw)
        else:  # its first backward: a route this device refuses leaves the general calls in its place
            try:
                dx, dw = _gradients(ctx, plan, dy, grad_out.dtype, saved, need_dx, need_dw)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - the casts and GEMMs are pure: run them again
                _warn_failed(plan, exc, "backward")
                q = plan.q
                wgrad_dtype = torch.float32 if ctx.fuse_wgrad else ctx.weight.dtype
                cached = q.grad_output.__dict__.get("_lean_routes", {})
                for key in cached:  # dy's casts too, for every plan of this layer
                    cached[key] = routes.general_cast(q.grad_output, key[3], key[4])
                plan.dy_route = routes.general_cast(q.grad_output, True, True)
                plan.dgrad = routes.general_gemm("dgrad", (q.grad_output.layout, ctx.w_layout), plan.out_dtype, False)
                plan.wgrad_gemm = routes.general_gemm("wgrad", (q.grad_output.layout, q.input.layout), wgrad_dtype,
                                                      False)
                plan.wgrad_add = routes.general_accumulate("wgrad", q.grad_output.layout, q.input.layout)
                dx, dw = _gradients(ctx, plan, dy, grad_out.dtype, saved, need_dx, need_dw)
            plan.backward_proven = True
        if ctx.fuse_wgrad and (dw is not None or getattr(ctx, "wgrad_added", False)):
            dw = _accumulate_wgrad(ctx.weight, dw)
        db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if (ctx.bias_dtype is not None and need_db) else None
        return dx, dw, db, None, None, None


def _gradients(ctx: Any, plan: LinearPlan, dy: torch.Tensor, dx_dtype: torch.dtype, saved: tuple[torch.Tensor, ...],
               need_dx: bool, need_dw: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dgrad and wgrad on the plan's routes (made at their first use), as ``ops.linear._backward_fp8``
    computes them, in its order: dy's casts, x's columnwise copy (``save_original_input``), dgrad, wgrad."""
    q = plan.q
    *x_saved, w_data, w_sinv = saved
    if need_dx and need_dw:
        route = plan.dy_route
        if route is None:
            route = plan.dy_route = routes.cast_route(q.grad_output, dy, True, True)
    else:  # one of the two (frozen weight, or an input without grad)
        route = routes.cast_route(q.grad_output, dy, need_dx, need_dw)
    dyr, dyrs, dyc, dycs, _ = route(dy)
    xc = xcs = None
    if need_dw:
        if plan.soi:  # x's columnwise copy, cast now with the forward's scale (ops.linear._input_columnwise)
            x = x_saved[0]
            qt = q.input.quantize(x.reshape(-1, x.shape[-1]), rowwise=False, columnwise=True,
                                  scale=x_saved[1] if len(x_saved) > 1 else None, record_amax=False)
            xc, xcs = qt.columnwise.data, qt.columnwise.scale_inv
        else:
            xc, xcs = x_saved
    comm = plan.comm
    x_pending = dx_pending = None
    if need_dw and comm is not None:  # gathering x's columnwise copy hides behind dgrad
        x_pending = comm.gather_fp8(Operand(xc, xcs, q.input.layout), columnwise=True)
    dx = dw = None
    if need_dx:
        dgrad = plan.dgrad if dx_dtype == plan.out_dtype else None
        if dgrad is None:
            dgrad = routes.gemm_route("dgrad", Operand(dyr, dyrs, q.grad_output.layout),
                                      Operand(w_data, w_sinv, ctx.w_layout), dx_dtype, False)
            if dx_dtype == plan.out_dtype and not getattr(dgrad, "relearn", False):
                plan.dgrad = dgrad
        dx = dgrad(dyr, dyrs, w_data, w_sinv)
        if comm is not None:  # the reduction hides behind wgrad
            dx_pending = comm.reduce_dgrad(dx)
        else:
            dx = dx.reshape(ctx.x_shape)
    if x_pending is not None:
        gathered = x_pending.wait()
        xc, xcs = gathered.data, gathered.scale_inv
    if need_dw and ctx.fuse_wgrad:
        add = plan.wgrad_add
        if add is None:
            add = plan.wgrad_add = routes.accumulate_route("wgrad", Operand(dyc, dycs, q.grad_output.layout),
                                                           Operand(xc, xcs, q.input.layout), ctx.weight.main_grad)
        added = add(dyc, dycs, xc, xcs, ctx.weight.main_grad)
    else:
        added = False
    if added:
        ctx.wgrad_added = True  # in main_grad already, as ops.linear._backward_fp8 adds it
    elif need_dw:
        wgrad = plan.wgrad_gemm  # its dtype is fixed by the key (the weight's, or FP32 when fused)
        if wgrad is None:
            wgrad = routes.gemm_route("wgrad", Operand(dyc, dycs, q.grad_output.layout),
                                      Operand(xc, xcs, q.input.layout),
                                      torch.float32 if ctx.fuse_wgrad else ctx.weight.dtype, False)
            if not getattr(wgrad, "relearn", False):
                plan.wgrad_gemm = wgrad
        dw = wgrad(dyc, dycs, xc, xcs)
    if dx_pending is not None:
        dx = dx_pending.wait().reshape(ctx.x_shape)
    return dx, dw


def _warn_failed(plan: LinearPlan, exc: BaseException, where: str) -> None:
    owner = plan.q.input.name.rsplit(" ", 1)[0]  # the layer ("Linear(proj)") of "Linear(proj) input"
    warnings.warn(f"megatron_fp8: {owner}: the lean FP8 path failed in {where} ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0] if str(exc) else ''}); "
                  + ("calls of this shape take the general path" if where == "forward" else
                     "its backward casts and GEMMs take the general calls from now on")
                  + " (MEGATRON_FP8_LEAN=0 turns the lean path off everywhere)", RuntimeWarning, stacklevel=4)


def lean_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, w_fp8: QuantizedTensor,
                plan: LinearPlan, fuse_wgrad: bool) -> torch.Tensor | None:
    """``LeanLinear`` on ``plan``; its first forward, if it fails, warns (naming the layer), retires
    the plan for this signature and returns None (the caller runs the general path)."""
    if plan.proven:
        return LeanLinear.apply(x, weight, bias, w_fp8, plan, fuse_wgrad)
    try:
        y = LeanLinear.apply(x, weight, bias, w_fp8, plan, fuse_wgrad)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a route this device refuses: the general path serves it
        # (an error of the caller's input raises again there, after this warning)
        plans = plan.q.__dict__.get("_plans", {})
        for key in [k for k, p in plans.items() if p is plan]:
            plans[key] = None
        _warn_failed(plan, exc, "forward")
        return None
    plan.proven = True
    return y
