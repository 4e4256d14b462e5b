"""Routes: one FP8 cast or GEMM of the linear, decided once for a signature and kept.

Through the general path (``Quantizer.quantize``, ``gemm.gemm``) every cast and GEMM decides its
route again on each call: backend settings read from the environment, capture state, shape and
dtype checks, kernel choice, the key of a Triton launch, and the objects that describe the result.
A route makes those decisions once for a signature (shape, dtype, device, copies, settings) and
keeps what they decided; a call then allocates its outputs and launches.

A fast route exists where this module launches exactly what the general path launches for the
signature (the same kernels with the same arguments, so the same bits): current scaling's
one-launch cast, the 1x128 / 128x128 block casts, delayed scaling's amax-and-cast, cuBLASLt's
bound call for block GEMMs (torch's ``scaled_mm`` for E4M3 ones where
``MEGATRON_FP8_BLOCK_GEMM=torch``) and wgrads added into ``main_grad``, torch's ``_scaled_mm``
for per-tensor GEMMs (cuBLASLt where ``MEGATRON_FP8_TENSOR_GEMM=cublaslt``). Elsewhere the
route is the general call itself behind the same signature. ``ops.lean`` builds a linear's plan
from them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import gemm as gemm_mod
from ..gemm import Backend, gemm
from ..kernels import cublaslt
from ..quant import kernels
from ..quant.block_scaling import Block1DQuantizer, Block2DQuantizer
from ..quant.formats import HIGH_PRECISION_DTYPES, ScaleLayout
from ..quant.quantizer import Quantizer, _grouped
from ..quant.tensor import Operand
from ..quant.tensor_scaling import CurrentScalingQuantizer, DelayedScalingQuantizer, fold_amax

L = ScaleLayout
# (row, row scale_inv, col, col scale_inv, per-tensor scale): the raw tensors of a QuantizedTensor
Cast = tuple[Any, Any, Any, Any, Any]
CastRoute = Callable[[torch.Tensor], Cast]
GemmRoute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# the settings a route depends on: a plan made under one set is not used under another
_SETTINGS = ("MEGATRON_FP8_LEAN", "MEGATRON_FP8_CAST_BACKEND", "MEGATRON_FP8_CUDA_CAST", "MEGATRON_FP8_CUDA_CURRENT",
             "MEGATRON_FP8_GEMM_BACKEND", "MEGATRON_FP8_HYBRID_GEMM", "MEGATRON_FP8_BLOCK_GEMM",
             "MEGATRON_FP8_TENSOR_GEMM",
             "MEGATRON_FP8_STRICT", "MEGATRON_FP8_GROUPED_GEMM", "TRITON_INTERPRET", "CUBLASLT_WORKSPACE_SIZE")
_ENV_DATA = getattr(os.environ, "_data", None)  # CPython's own store: one dict lookup a setting
_ENV_KEYS = tuple(os.environ.encodekey(k) for k in _SETTINGS) if hasattr(os.environ, "encodekey") else None


def settings() -> tuple[Any, ...]:
    """The values of every setting a plan depends on (and ``force_backend``'s pin): part of the
    plan's key, so that a changed setting makes a new plan. ~1 us: read from the environment's
    own dictionary where this Python keeps one."""
    if _ENV_DATA is not None and _ENV_KEYS is not None:
        data = _ENV_DATA
        return (*[data.get(k) for k in _ENV_KEYS], gemm_mod._state.forced)
    return (*[os.environ.get(k) for k in _SETTINGS], gemm_mod._state.forced)


# ---- cast routes ------------------------------------------------------------------------------
def general_cast(q: Quantizer, rowwise: bool, columnwise: bool) -> CastRoute:
    """``q.quantize`` itself, its outputs as raw tensors (the route's ``general`` attribute says so)."""
    def run(x: torch.Tensor) -> Cast:
        qt = q.quantize(x, rowwise=rowwise, columnwise=columnwise)
        r, c = qt.rowwise, qt.columnwise
        return (r.data if r is not None else None, r.scale_inv if r is not None else None,
                c.data if c is not None else None, c.scale_inv if c is not None else None, qt.scale)
    run.general = True  # type: ignore[attr-defined]
    return run


def cast_route(q: Quantizer, x: torch.Tensor, rowwise: bool, columnwise: bool) -> CastRoute:
    """The route of ``q.quantize(x', rowwise=, columnwise=)`` for tensors ``x'`` like ``x`` (same
    shape, dtype, device; contiguous): a fast one where this module has it, else the general one.
    Kept on the quantizer per signature (its own cache, so the weight's cast has one too); the
    signature includes the quantizer's amax-reduction group, which a TP layer sets per call."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return general_cast(q, rowwise, columnwise)  # a capture takes the general path's graph routes
    routes: dict[tuple[Any, ...], CastRoute] = q.__dict__.setdefault("_lean_routes", {})
    key = (x.shape, x.dtype, x.device, rowwise, columnwise, getattr(q, "group", None), settings())
    route = routes.get(key)
    if route is None:
        route = routes[key] = _fast_cast(q, x, rowwise, columnwise) or general_cast(q, rowwise, columnwise)
    return route


def _fast_cast(q: Quantizer, x: torch.Tensor, rowwise: bool, columnwise: bool) -> CastRoute | None:
    """The fast route of this cast, or None where the general path would take another kernel
    (or raise): off the kernels' device, dtypes no cast takes, backends pinned elsewhere, amaxes
    reduced over a group, recipes without a fast route (MXFP8)."""
    if not (kernels._kernel_device(x) and x.dim() == 2 and x.numel() and (rowwise or columnwise)):
        return None
    if x.dtype not in HIGH_PRECISION_DTYPES:
        return None  # the general cast raises its error
    if not kernels.segments_fused(x, columnwise):
        return None  # the kernels do not serve it here
    if type(q) is CurrentScalingQuantizer and not _grouped(q.group):
        return _current_cast(q, x, rowwise, columnwise)
    if type(q) in (Block1DQuantizer, Block2DQuantizer):
        return _block_cast(q, x, rowwise, columnwise)
    if type(q) is DelayedScalingQuantizer and not _grouped(q.group):
        return _delayed_cast(q, x, rowwise, columnwise)
    return None


def _current_cast(q: CurrentScalingQuantizer, x: torch.Tensor, rowwise: bool, columnwise: bool) -> CastRoute | None:
    """Current scaling's one-launch cast (``triton_persistent``), where the general path takes it
    eagerly: its launch prepared once, its sync words and SM count looked up once a call."""
    from ..kernels import triton_cast
    from ..kernels import triton_persistent as tp
    from ..kernels.triton_tiles import TILE

    if triton_cast.cuda_current_ok(x, q.fp8_dtype, rowwise, columnwise) or not tp.persistent_ok(x) \
            or not kernels._one_launch.ok:
        return None
    m, k = x.shape
    device, fp8 = x.device, q.fp8_dtype
    dev = torch.cuda.current_device()
    if device.index != dev:
        return None
    n_kb = -(-k // TILE)
    kw = tp.launch_options(fp8, rowwise, columnwise, segmented=False, power_2_scale=q.power_2_scale,
                           amax_epsilon=q.amax_epsilon)  # cast_current_persistent's launch, as it makes it
    warps = kw["num_warps"]
    kw.update(PHASES=0, launch_cooperative_grid=True, **tp._register_cap(warps))
    programs = tp.cuda_programs(dev, warps)
    grid = (min(programs, -(-m // TILE) * n_kb),)
    launch: Any = None
    f32 = torch.float32
    general = general_cast(q, rowwise, columnwise)

    def run(x: torch.Tensor) -> Cast:
        nonlocal launch
        if not kernels._one_launch.ok or tp.cuda_programs(dev, warps) != programs:
            return general(x)  # the general path's guards turned the one launch off, or cut its grid
        x = x.contiguous()
        row = torch.empty((m, k), dtype=fp8, device=device) if rowwise else x
        col = torch.empty((k, m), dtype=fp8, device=device) if columnwise else x
        scale, inv = torch.empty((), dtype=f32, device=device), torch.empty((), dtype=f32, device=device)
        sync = tp._sync_words(dev, 1)
        if launch is not None and x.data_ptr() % 16 == 0:
            launch(x, row, col, scale, inv, x, sync)
        else:  # the first call, or an input the prepared launch's alignment does not cover
            try:
                prepared = tp._PERSISTENT.prepare(grid, 7, x, row, col, scale, inv, x, sync, m, k, n_kb, 1, **kw)
            except (torch.OutOfMemoryError, ValueError):
                raise
            except Exception:  # noqa: BLE001 - a refused grid, a kernel that does not build: the general
                return general(x)  # path's guards handle both, as kernels._KernelGuard does (and warn)
            if launch is None and x.data_ptr() % 16 == 0:
                launch = prepared
        return (row if rowwise else None), (inv if rowwise else None), (col if columnwise else None), \
            (inv if columnwise else None), scale
    return run


def _block_cast(q: Block1DQuantizer | Block2DQuantizer, x: torch.Tensor, rowwise: bool,
                columnwise: bool) -> CastRoute | None:
    """1x128 / 128x128 casts on the CUDA tile kernel where it serves (both copies of an aligned
    BF16 tensor), else on the Triton tile cast called directly; scales as ``cast_tiles`` views them."""
    from ..kernels import cuda_cast, triton_cast
    from ..kernels.triton_tiles import TILE

    mode = "1x128" if type(q) is Block1DQuantizer else "128x128"
    if not kernels._block_kernel_ok(x, columnwise, q.block, q.power_2_scale, q.amax_epsilon):
        return None
    try:
        q.check_shape(tuple(x.shape), rowwise=rowwise, columnwise=columnwise)
    except ValueError:
        return None  # the general path raises its error
    m, k = x.shape
    n_mb, n_kb = -(-m // TILE), -(-k // TILE)
    device, fp8, f32 = x.device, q.fp8_dtype, torch.float32
    row_too = rowwise or mode == "128x128"
    cuda = cuda_cast.serves(x.contiguous(), fp8, mode, row_too, columnwise, True, scale_given=False) \
        and cuda_cast.prebuild(mode, fp8, device) is not None

    def tiles(x: torch.Tensor) -> Cast:
        row, col = triton_cast.cast_tiles(x, fp8, mode, rowwise, columnwise)
        return (*(row if row is not None else (None, None)), *(col if col is not None else (None, None)), None)
    if not cuda:
        return tiles

    def run(x: torch.Tensor) -> Cast:
        x = x.contiguous()
        row = torch.empty((m, k), dtype=fp8, device=device)
        col = torch.empty((k, m), dtype=fp8, device=device)
        if mode == "1x128":
            row_s = torch.empty((n_kb * m,), dtype=f32, device=device)
            col_s = torch.empty((n_mb, k), dtype=f32, device=device)
            if not cuda_cast.cast(x, fp8, mode, None, 1, row, row_s, col, col_s):
                return tiles(x)  # as triton_cast._launch does where the kernel cannot be built
            return (row if rowwise else None), row_s.view(n_kb, m).t(), col, col_s.t(), None
        row_s = torch.empty((n_mb, n_kb), dtype=f32, device=device)
        col_s = torch.empty((n_mb * n_kb,), dtype=f32, device=device)
        if not cuda_cast.cast(x, fp8, mode, None, 1, row, row_s, col, col_s):
            return tiles(x)
        return (row if rowwise else None), (row_s if rowwise else None), col, col_s.view(n_kb, n_mb), None
    return run


def _delayed_cast(q: DelayedScalingQuantizer, x: torch.Tensor, rowwise: bool, columnwise: bool) -> CastRoute | None:
    """Delayed scaling: the step's scale (``_advance``), this cast's amax folded into the
    history in one launch (``triton_scale.fold_amax_into``), the cast with the scale in force
    (CUDA tile kernel where it serves)."""
    from ..kernels import cuda_cast, triton_cast

    q._to(x.device)
    if not kernels.amax_folds(x, q.amax_history):
        return None
    scales = kernels._scales()
    m, k = x.shape
    device, fp8 = x.device, q.fp8_dtype
    cuda = cuda_cast.serves(x.contiguous(), fp8, "tensor", rowwise, columnwise, True, scale_given=True) \
        and cuda_cast.prebuild("tensor", fp8, device) is not None

    work = scales.fold_work(device)  # this route's atomic words (its casts run one after another)
    fold: Any = None  # the fold's launch, prepared at the first call (on x's device only: it keeps that device)
    preparable = x.is_cuda and device.index == torch.cuda.current_device()

    def run(x: torch.Tensor) -> Cast:
        nonlocal fold
        x = x.contiguous()
        q._to(x.device)
        q._advance()
        hist = q.amax_history
        if hist.is_contiguous():  # the amax joins the history in its one launch
            aligned = not (x.data_ptr() % 16 or hist.data_ptr() % 16)
            if fold is not None and aligned:
                fold(x, work, hist)
            else:  # the first call, or a tensor the prepared launch's alignment does not cover
                prepared = scales.prepared_fold(x, hist, work)
                if fold is None and preparable and aligned:
                    fold = prepared
        else:
            fold_amax(hist, scales.amax_and_scale(x, torch.float8_e4m3fn, scale=False)[0].view(()))
        scale, inv = q.scale, q._scale_inv()
        if cuda:
            row = torch.empty((m, k), dtype=fp8, device=device)
            col = torch.empty((k, m), dtype=fp8, device=device)
            if cuda_cast.cast(x, fp8, "tensor", None, 1, row, None, col, None,
                              scale if scale.dtype == torch.float32 else scale.float()):
                return row, inv, col, inv, scale
        row, col = triton_cast.cast_tiles(x, fp8, "tensor", rowwise, columnwise, scale.float())
        return (row[0] if row else None), (inv if row else None), (col[0] if col else None), \
            (inv if col else None), scale
    return run


# ---- GEMM routes ----------------------------------------------------------------------------
def general_gemm(name: str, layouts: tuple[ScaleLayout, ScaleLayout], out_dtype: torch.dtype,
                 fast_accum: bool) -> GemmRoute:
    """``gemm`` itself on Operands of the raw tensors (the route's ``general`` attribute says so)."""
    la, lb = layouts

    def run(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
        return gemm(Operand(a, sa, la), Operand(b, sb, lb), out_dtype, name=name, fast_accum=fast_accum)
    run.general = True  # type: ignore[attr-defined]
    return run


def relearning(route: GemmRoute) -> GemmRoute:
    """``route`` marked to be decided again after its call (see ``gemm_route``)."""
    def run(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
        return route(a, sa, b, sb)
    run.general = True  # type: ignore[attr-defined]
    run.relearn = True  # type: ignore[attr-defined]
    return run


def gemm_route(name: str, a: Operand, b: Operand, out_dtype: torch.dtype, fast_accum: bool) -> GemmRoute:
    """The route of ``gemm(a', b', out_dtype)`` for operands like ``a`` and ``b`` (same shapes,
    dtypes, layouts, device): cuBLASLt's bound call where ``gemm`` calls cuBLASLt (block scales,
    E4M3 ones unless ``MEGATRON_FP8_BLOCK_GEMM=torch``; per-tensor ones under
    ``MEGATRON_FP8_TENSOR_GEMM=cublaslt``), torch's ``scaled_mm`` for the other per-tensor and
    E4M3 block GEMMs, else ``gemm``. Every route reports to ``record_gemms`` as ``gemm`` does."""
    layouts = (a.layout, b.layout)
    (m, k), (n, _) = a.shape, b.shape
    backend = gemm_mod.select_backend(a.layout, b.layout, a.data.device, (m, n, k))
    general = general_gemm(name, layouts, out_dtype, fast_accum)
    if backend is not Backend.NATIVE or not a.data.is_cuda or not (m and n and k):
        return general
    records = gemm_mod._state.records
    if cublaslt.serves(a.data, a.layout, b.data, b.layout, out_dtype):  # (per-tensor ones: opt-in)
        la, lb = layouts
        scale = gemm_mod.lt_scale
        bound = cublaslt.bind(a.data, scale(a.scale_inv, la), la, b.data, scale(b.scale_inv, lb), lb, out_dtype,
                              fast_accum and la is L.TENSOR)  # (block GEMMs accumulate in full)
        if bound is None:  # no kernel for it: gemm decides (torch's, Triton's) and records
            return general
        recorded = gemm_mod.direct_name(name, a, b)  # as gemm records them
        device = a.data.device

        def lt(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
            y = torch.empty((m, n), dtype=out_dtype, device=device)
            if not bound(a, scale(sa, la), b, scale(sb, lb), y):
                return general(a, sa, b, sb)  # a pointer it does not take: gemm decides
            if records:
                gemm_mod.record(recorded, backend, layouts, (m, n, k))
            return y
        return lt
    if a.layout is L.TENSOR:
        def tensorwise(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
            if records:
                gemm_mod.record(name, backend, layouts, (m, n, k))
            return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum)
        return tensorwise
    if a.layout not in (L.BLOCK_1x128, L.BLOCK_128x128) or gemm_mod._e5m2_blocks(a, b):
        return general  # HYBRID blocks cuBLASLt does not serve: Triton's GEMM or emulation (gemm decides)
    layout_of = gemm_mod.block_scale_layout
    if gemm_mod._BLOCK_OUT_DTYPES.get(out_dtype) != out_dtype:
        # gemm finds out once whether cuBLAS writes this dtype itself: until it has, the caller
        # asks again after each call (``relearn``), so the fast route follows once it knows
        if out_dtype not in gemm_mod._BLOCK_OUT_DTYPES:
            return relearning(general)
        return general
    st = F.ScalingType
    kinds = {L.BLOCK_1x128: st.BlockWise1x128, L.BLOCK_128x128: st.BlockWise128x128}
    ka, kb = kinds[layouts[0]], kinds[layouts[1]]
    none = F.SwizzleType.NO_SWIZZLE

    def block(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
        if records:
            gemm_mod.record(name, backend, layouts, (m, n, k))
        # F.scaled_mm with gemm._native_block's arguments (its output dtype known to be accepted)
        return F.scaled_mm(a, b.t(), layout_of(sa, layouts[0]), ka, layout_of(sb, layouts[1]), kb, swizzle_a=none,
                           swizzle_b=none, output_dtype=out_dtype)
    return block


AccumulateRoute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], bool]


def general_accumulate(name: str, la: ScaleLayout, lb: ScaleLayout) -> AccumulateRoute:
    """``gemm.accumulate`` itself on raw tensors of layouts ``la`` and ``lb``."""
    def run(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, into: torch.Tensor) -> bool:
        return gemm_mod.accumulate(Operand(a, sa, la), Operand(b, sb, lb), into, name=name)
    run.general = True  # type: ignore[attr-defined]
    return run


def accumulate_route(name: str, a: Operand, b: Operand, into: torch.Tensor) -> AccumulateRoute:
    """The route of ``gemm.accumulate(a', b', into')`` (``into' += a' @ b'.T`` in the GEMM's
    epilogue; True where done, False where the caller must add) for operands and buffer like
    these: cuBLASLt's bound call (``kernels.cublaslt.bind``) where ``accumulate`` would call
    cuBLASLt, else ``accumulate`` itself. Records as ``accumulate`` does."""
    la, lb = a.layout, b.layout
    general = general_accumulate(name, la, lb)
    if not gemm_mod.accumulates(a, b, into):  # (CUDA only: cuBLASLt serves nothing else)
        return general
    scale = gemm_mod.lt_scale
    bound = cublaslt.bind(a.data, scale(a.scale_inv, la), la, b.data, scale(b.scale_inv, lb), lb, torch.float32,
                          accumulate=True)
    if bound is None:
        return general
    (m, k), (n, _) = a.shape, b.shape
    records = gemm_mod._state.records
    recorded = gemm_mod.direct_name(name, a, b)

    def acc(a_: torch.Tensor, sa: torch.Tensor, b_: torch.Tensor, sb: torch.Tensor, into_: torch.Tensor) -> bool:
        if into_.dtype != torch.float32 or into_.shape != (m, n) or not into_.is_contiguous():
            return general(a_, sa, b_, sb, into_)
        if not bound(a_, scale(sa, la), b_, scale(sb, lb), into_):
            return general(a_, sa, b_, sb, into_)  # (a pointer it does not take: accumulate declines it too)
        if records:
            gemm_mod.record(recorded, Backend.NATIVE, (la, lb), (m, n, k))
        return True
    return acc
