"""The shared quantized-GEMM core: every FP8 matmul in the package goes through ``gemm``.

All three linear GEMMs have one shape once operands are K-major (RECIPES.md):

==========  =====================  ===============================  ==================
GEMM        computes               operand a ``[m, k]``             operand b ``[n, k]``
==========  =====================  ===============================  ==================
fprop       ``y  = x @ w.T``       x rowwise ``[M, K]``             w rowwise ``[N, K]``
dgrad       ``dx = dy @ w``        dy rowwise ``[M, N]``            w columnwise ``[K, N]``
wgrad       ``dw = dy.T @ x``      dy columnwise ``[N, M]``         x columnwise ``[K, M]``
==========  =====================  ===============================  ==================

so ``gemm(a, b) = a @ b.T`` with both operands' last dim contracted. The backend is chosen per
call: ``native`` (``torch._scaled_mm`` / ``torch.nn.functional.scaled_mm``) where the device runs
that pair of scale layouts, else ``emulate`` (dequantize, FP32 matmul, cast to the output dtype).
``accumulate`` adds a per-tensor-scaled wgrad into Megatron's FP32 ``main_grad`` in the GEMM's
epilogue, on cuBLASLt called directly (``kernels.cublaslt``; ``MEGATRON_FP8_TENSOR_GEMM=cublaslt``
sends every per-tensor GEMM there: torch's bits, opt-in).
Block-scaled GEMMs with an E5M2 operand (HYBRID gradients), which torch refuses, run natively on
cuBLASLt called directly (``kernels.cublaslt``) or on our Triton GEMM, recorded as
``name[cublaslt]`` / ``name[triton]``. ``force_backend`` pins one; ``record_gemms`` lists what
ran. The experts' grouped GEMMs, built on ``gemm``, are in ``gemm_grouped``.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .kernels import cublaslt
from .quant.formats import ScaleLayout
from .quant.tensor import Operand

__all__ = [
    "Backend",
    "GemmCall",
    "gemm",
    "emulate",
    "select_backend",
    "native_supported",
    "force_backend",
    "forced_backend",
    "record_gemms",
    "notice_emulation",
]

L = ScaleLayout


class Backend(enum.Enum):
    NATIVE = "native"
    EMULATE = "emulate"


@dataclass(frozen=True)
class GemmCall:
    """One GEMM as it ran: which backend, which layouts, which shape."""

    name: str
    backend: Backend
    layouts: tuple[ScaleLayout, ScaleLayout]
    mnk: tuple[int, int, int]


class _State:
    """Process-wide, not per thread: autograd runs CUDA backward passes on worker threads, and
    ``force_backend`` / ``record_gemms`` must reach the dgrad and wgrad GEMMs there too."""

    def __init__(self) -> None:
        self.forced: Backend | None = None
        self.records: list[Any] = []  # open record_gemms() collections (lists, or tallies)


_state = _State()

_BLOCK_PAIRS = {
    (L.BLOCK_1x128, L.BLOCK_128x128),
    (L.BLOCK_1x128, L.BLOCK_1x128),
    (L.BLOCK_128x128, L.BLOCK_1x128),
}


def _cuda_at_least(major: int, minor: int) -> bool:
    v = torch.version.cuda
    if not v:
        return False
    parts = tuple(int(p) for p in v.split(".")[:2])
    return parts >= (major, minor)


def native_supported(a: ScaleLayout, b: ScaleLayout, device: torch.device) -> bool:
    """Whether this device has a native FP8 GEMM for the layout pair ``(a, b)``."""
    return _native_supported(a, b, torch.device(device))


@functools.cache  # called per GEMM (per expert in grouped layers): keep it cheap
def _native_supported(a: ScaleLayout, b: ScaleLayout, device: torch.device) -> bool:
    pair = (a, b)
    if device.type == "cpu":
        return pair in {(L.TENSOR, L.TENSOR), (L.ROW, L.ROW)}
    if device.type != "cuda" or torch.version.hip:
        return False
    cap = torch.cuda.get_device_capability(device)
    if pair in {(L.TENSOR, L.TENSOR), (L.ROW, L.ROW)}:
        return cap >= (8, 9)
    if pair in _BLOCK_PAIRS:
        return cap[0] == 9 and _cuda_at_least(12, 9)
    # MXFP8 needs SM100 and swizzled scale layouts; we have no SM100 to verify them on, so
    # MXFP8 is emulated everywhere (see RECIPES.md, recipe 4).
    return False


def _env_backend() -> Backend | None:
    v = os.environ.get("MEGATRON_FP8_GEMM_BACKEND", "auto").lower()
    if v == "auto":
        return None
    try:
        return Backend(v)
    except ValueError:
        raise ValueError(
            f"MEGATRON_FP8_GEMM_BACKEND={v!r}; allowed: 'auto', 'native', 'emulate'"
        ) from None


def _aligned(a: ScaleLayout, mnk: tuple[int, int, int] | None) -> bool:
    """cuBLAS FP8 GEMMs want every dim a multiple of 16 (block layouts are multiples of 128
    by construction): an expert with 5 tokens, say, is emulated instead."""
    return mnk is None or a not in (L.TENSOR, L.ROW) or all(d % 16 == 0 for d in mnk)


def select_backend(a: ScaleLayout, b: ScaleLayout, device: torch.device,
                   mnk: tuple[int, int, int] | None = None) -> Backend:
    """The backend ``gemm`` uses for these layouts (and, if given, this ``(m, n, k)``) here.

    Auto: native on CUDA where supported and the dims are aligned; emulate elsewhere (on CPU the
    emulation is the reference, though CPU ``_scaled_mm`` exists for tensorwise/rowwise and can
    be forced).
    """
    forced = forced_backend()
    if forced is Backend.NATIVE and not native_supported(a, b, device):
        raise RuntimeError(
            f"native FP8 GEMM forced, but {device} has none for scale layouts "
            f"({a.value}, {b.value}); use backend 'emulate' or 'auto'"
        )
    if forced is Backend.NATIVE and device.type == "cuda" and not _aligned(a, mnk):
        raise RuntimeError(f"native FP8 GEMM forced, but (m, n, k)={mnk} are not all multiples of 16; "
                           f"use backend 'emulate' or 'auto' (which emulates such shapes)")
    if forced is not None:
        return forced
    if device.type == "cuda" and native_supported(a, b, device) and _aligned(a, mnk):
        return Backend.NATIVE
    return Backend.EMULATE


def forced_backend() -> Backend | None:
    """The backend pinned by ``force_backend`` or ``MEGATRON_FP8_GEMM_BACKEND`` (None: auto)."""
    return _state.forced or _env_backend()


@contextlib.contextmanager
def force_backend(backend: Backend | str | None) -> Iterator[None]:
    """Pin the GEMM backend (``"native"``, ``"emulate"``; ``None`` = auto) inside the block."""
    prev = _state.forced
    _state.forced = Backend(backend) if backend is not None else None
    try:
        yield
    finally:
        _state.forced = prev


@contextlib.contextmanager
def record_gemms(into: Any = None) -> Iterator[Any]:
    """Collect a ``GemmCall`` for every GEMM run inside the block: into a new list, or into
    ``into`` (anything with ``append``, e.g. a tally that keeps counts, not calls)."""
    calls = [] if into is None else into
    _state.records.append(calls)
    try:
        yield calls
    finally:  # by identity: two open lists may compare equal (both empty), list.remove would take either
        _state.records[:] = [r for r in _state.records if r is not calls]


def cublaslt_scale(op: Operand) -> torch.Tensor:
    """``scale_inv`` as cuBLAS takes it (``lt_scale``)."""
    return lt_scale(op.scale_inv, op.layout)


def lt_scale(s: torch.Tensor, layout: L) -> torch.Tensor:
    """A ``scale_inv`` ``s`` of ``layout`` as cuBLAS takes it: the per-tensor scalar as it is,
    block scales as ``block_scale_layout`` lays them out."""
    return s if layout is L.TENSOR else block_scale_layout(s, layout)


def _block_scale_layout(op: Operand) -> torch.Tensor:
    """``block_scale_layout`` of a block-scaled operand."""
    return block_scale_layout(op.scale_inv, op.layout)


def block_scale_layout(s: torch.Tensor, layout: L) -> torch.Tensor:
    """A block-scaled operand's ``scale_inv`` ``s`` (of ``layout``) as ``scaled_mm`` wants it on SM90
    (outer-dim-major; 128x128 K-padded to 4)."""
    if layout is L.BLOCK_1x128:
        if s.stride() == (1, s.shape[0]):  # the casts' own layout already (ops.routes): no copy, no view
            return s
        return s.t().contiguous().t()  # (rows, k/128) with strides (1, rows)
    kb = s.shape[1]
    pad = (-kb) % 4
    if pad:
        s = F.pad(s, (0, pad), value=1.0)
    return s.contiguous().t()  # (round_up(k/128, 4), rows/128), column-major


def _into(out: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """``y``, written into ``out`` where the caller gave one."""
    return y if out is None else out.copy_(y)


_OUT_ALIGN = 256  # bytes: cuBLASLt's default minimum pointer alignment (torch asks for none lower)


def _native(a: Operand, b: Operand, out_dtype: torch.dtype, fast_accum: bool,
            out: torch.Tensor | None = None) -> torch.Tensor:
    if out is not None and out.data_ptr() % _OUT_ALIGN:  # e.g. rows after an odd, emulated expert
        return out.copy_(_native(a, b, out_dtype, fast_accum))
    where = {} if out is None else {"out": out}
    if a.layout is L.TENSOR:
        y = _cublaslt(a, b, out_dtype, out, fast_accum)  # opt-in: MEGATRON_FP8_TENSOR_GEMM=cublaslt
        if y is not None:
            return y
        return torch._scaled_mm(
            a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, out_dtype=out_dtype,
            use_fast_accum=fast_accum, **where,
        )
    if a.layout is L.ROW:
        dtype = torch.bfloat16 if a.data.is_cuda else out_dtype  # SM90 rowwise: BF16 output only
        if dtype != out_dtype:
            where = {}
        y = torch._scaled_mm(
            a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv.t(),
            out_dtype=dtype, use_fast_accum=fast_accum, **where,
        )
        return y if where else _into(out, y.to(out_dtype))
    return _native_block(a, b, out_dtype, out)


# requested -> what cuBLAS accepted; BF16 is the fallback itself, so never asked for: the asking
# call returns a new tensor that is then copied into ``out``, which in the first captured step
# (eager steps take the Triton grouped GEMMs) was a 3.8 us copy of expert 0's output
# (docs/benchmarks.md run W)
_BLOCK_OUT_DTYPES: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.bfloat16}


def _native_block(a: Operand, b: Operand, out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Block-scaled GEMM; asks for ``out_dtype`` once and falls back to BF16 output (cast after)
    if this cuBLAS refuses it, remembering the answer. Given ``out`` (of ``out_dtype``), cuBLAS
    writes into it directly (``_scaled_mm_v2.out``) once the output dtype is known to be
    accepted; the asking call, and BF16-then-cast, copy into it."""
    st = F.ScalingType
    kinds = {L.BLOCK_1x128: st.BlockWise1x128, L.BLOCK_128x128: st.BlockWise128x128}

    def run(dtype: torch.dtype, into: torch.Tensor | None = None) -> torch.Tensor:
        if into is None:
            return F.scaled_mm(
                a.data, b.data.t(), _block_scale_layout(a), kinds[a.layout], _block_scale_layout(b),
                kinds[b.layout], swizzle_a=F.SwizzleType.NO_SWIZZLE, swizzle_b=F.SwizzleType.NO_SWIZZLE,
                output_dtype=dtype,
            )
        none = [F.SwizzleType.NO_SWIZZLE.value]  # the ints F.scaled_mm passes on
        return torch._scaled_mm_v2(
            a.data, b.data.t(), [_block_scale_layout(a)], [kinds[a.layout].value], none,
            [_block_scale_layout(b)], [kinds[b.layout].value], none, None, dtype, out=into,
        )

    y = _cublaslt(a, b, out_dtype, out)  # two E4M3 operands too, unless MEGATRON_FP8_BLOCK_GEMM=torch
    if y is not None:
        return y
    dtype = _BLOCK_OUT_DTYPES.get(out_dtype)
    if dtype is None:
        try:
            y = run(out_dtype)
        except RuntimeError:
            _BLOCK_OUT_DTYPES[out_dtype] = dtype = torch.bfloat16
        else:
            _BLOCK_OUT_DTYPES[out_dtype] = out_dtype
            return _into(out, y)
    if dtype == out_dtype:
        return run(dtype, out)
    return _into(out, run(dtype).to(out_dtype))


def emulate(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """Dequantize both operands, FP32 matmul, cast: the reference every native path must match."""
    return (a.dequantize() @ b.dequantize().t()).to(out_dtype)


def record(name: str, backend: Backend, layouts: tuple[ScaleLayout, ScaleLayout],
           mnk: tuple[int, int, int]) -> None:
    """Tell every open ``record_gemms()`` which GEMM ran on which backend (the grouped GEMMs of
    ``gemm_grouped`` report their one-launch calls here too)."""
    for calls in _state.records:
        calls.append(GemmCall(name, backend, layouts, mnk))


def gemm(
    a: Operand,
    b: Operand,
    out_dtype: torch.dtype,
    *,
    name: str = "gemm",
    fast_accum: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a @ b.T`` for K-major FP8 operands ``a [m, k]``, ``b [n, k]``, output ``[m, n]``;
    written into ``out`` (contiguous ``[m, n]`` of ``out_dtype``) where given, which is how the
    grouped loop fills each expert's rows of one output without a concatenation."""
    (m, k), (n, kb) = a.shape, b.shape
    if k != kb:
        raise ValueError(f"{name}: contraction dims differ: a {tuple(a.shape)} vs b {tuple(b.shape)}")
    if out is not None and (tuple(out.shape) != (m, n) or out.dtype != out_dtype or not out.is_contiguous()):
        raise ValueError(f"{name}: out must be a contiguous [{m}, {n}] {out_dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype} (contiguous: {out.is_contiguous()})")
    backend = select_backend(a.layout, b.layout, a.data.device, (m, n, k))
    empty = m == 0 or n == 0 or k == 0
    if backend is Backend.NATIVE and a.data.is_cuda and _e5m2_blocks(a, b) and not empty:
        done = _hybrid_blocks(a, b, out_dtype, fast_accum, out, name)
        if done is not None:
            via, y = done
            record(f"{name}[{via}]", backend, (a.layout, b.layout), (m, n, k))
            return y
        backend = Backend.EMULATE
        notice_emulation(name, (a.layout, b.layout), (m, n, k), "E5M2 operands with block scales: torch's "
                         "scaled_mm refuses them, and neither cuBLASLt nor our Triton GEMM takes this shape and "
                         "layout pair (both need every dim a multiple of 128)")
    elif backend is Backend.EMULATE and a.data.is_cuda and forced_backend() is None:
        notice_emulation(name, (a.layout, b.layout), (m, n, k), _emulation_reason(a, b))
    record(name, backend, (a.layout, b.layout), (m, n, k))
    if empty:
        if out is not None:
            return out.zero_()
        return torch.zeros(m, n, dtype=out_dtype, device=a.data.device)
    if backend is Backend.NATIVE:
        return _native(a, b, out_dtype, fast_accum, out)
    return _into(out, emulate(a, b, out_dtype))


def accumulate(a: Operand, b: Operand, into: torch.Tensor, *, name: str = "wgrad") -> bool:
    """``into += a @ b.T`` in the GEMM's epilogue (beta = 1; ``into`` an FP32 ``[m, n]``, e.g. a
    weight's ``main_grad``): Megatron's gradient-accumulation fusion without a separate add.
    Where cuBLASLt called directly serves the GEMM natively (``kernels.cublaslt.serves``: per-tensor
    scales, HYBRID block scales) and ``into`` is contiguous and 256-byte aligned; False, with nothing
    done, elsewhere (the caller computes the GEMM and adds)."""
    if not accumulates(a, b, into) or into.data_ptr() % cublaslt.ALIGN:
        return False
    if not cublaslt.matmul(a.data, cublaslt_scale(a), a.layout, b.data, cublaslt_scale(b), b.layout, into,
                           accumulate=True):
        return False
    (m, k), (n, _) = a.shape, b.shape
    record(direct_name(name, a, b), Backend.NATIVE, (a.layout, b.layout), (m, n, k))
    return True


def accumulates(a: Operand, b: Operand, into: torch.Tensor) -> bool:
    """Whether ``accumulate`` may take this GEMM (its pointers aside): an FP32, contiguous
    ``[m, n]`` ``into``, a native GEMM that cuBLASLt called directly serves."""
    (m, k), (n, _) = a.shape, b.shape
    if into.dtype != torch.float32 or tuple(into.shape) != (m, n) or not into.is_contiguous() or not (m and n and k):
        return False
    return (select_backend(a.layout, b.layout, a.data.device, (m, n, k)) is Backend.NATIVE
            and cublaslt.serves(a.data, a.layout, b.data, b.layout, torch.float32, accumulate=True))


def direct_name(name: str, a: Operand, b: Operand) -> str:
    """The name ``record_gemms`` gets for a GEMM on cuBLASLt called directly: ``name[cublaslt]``
    for the HYBRID block GEMMs (which torch's ``scaled_mm`` refuses), else ``name`` (as ``gemm``)."""
    return f"{name}[cublaslt]" if _e5m2_blocks(a, b) else name


# ---- HYBRID block scaling: E5M2 gradients with 1x128 / 128x128 scales ----
def _e5m2_blocks(a: Operand, b: Operand) -> bool:
    return a.layout in (L.BLOCK_1x128, L.BLOCK_128x128) and torch.float8_e5m2 in (a.data.dtype, b.data.dtype)


def _hybrid_blocks(a: Operand, b: Operand, out_dtype: torch.dtype, fast_accum: bool, out: torch.Tensor | None,
                   name: str) -> tuple[str, torch.Tensor] | None:
    """A HYBRID block GEMM on cuBLASLt called directly (``kernels.cublaslt``: torch's ``scaled_mm``
    refuses the E5M2 operand, cuBLASLt does not) or else on our Triton GEMM: (the path, the
    output); None where neither serves the shape (the caller emulates). ``MEGATRON_FP8_HYBRID_GEMM``
    picks (``auto``, ``cublaslt``, ``triton``)."""
    y = _cublaslt(a, b, out_dtype, out)
    if y is not None:
        return "cublaslt", y
    if cublaslt.choice() == "cublaslt":
        raise RuntimeError(f"{name} {tuple(a.shape)} x {tuple(b.shape)} ({a.layout.value} {a.data.dtype} x "
                           f"{b.layout.value} {b.data.dtype} -> {out_dtype}): cuBLASLt declined it (no kernel, a "
                           f"shape or pointer it does not take, or no libcublasLt loaded); "
                           f"MEGATRON_FP8_HYBRID_GEMM=cublaslt forbids the Triton fallback, 'auto' allows it")
    if _triton_serves(a, b):
        return "triton", _into(out, _triton_blocks(a, b, out_dtype, fast_accum))
    return None


def _cublaslt(a: Operand, b: Operand, out_dtype: torch.dtype, out: torch.Tensor | None,
              fast_accum: bool = False) -> torch.Tensor | None:
    """``a @ b.T`` on cuBLASLt called directly (``kernels.cublaslt``) where it serves the GEMM,
    written into ``out`` where given (computed aside and copied in when ``out`` is not 256-byte
    aligned); None where it does not serve it (nothing launched)."""
    if not cublaslt.serves(a.data, a.layout, b.data, b.layout, out_dtype):
        return None
    aligned = out is not None and out.data_ptr() % cublaslt.ALIGN == 0
    y = out if aligned else torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=a.data.device)
    if not cublaslt.matmul(a.data, cublaslt_scale(a), a.layout, b.data, cublaslt_scale(b), b.layout, y, fast_accum):
        return None
    return y if aligned or out is None else _into(out, y)


def _triton_serves(a: Operand, b: Operand) -> bool:
    """Our Triton GEMMs (``triton_grouped``, one group) take 1x128 x 128x128 (fprop, dgrad) and
    1x128 x 1x128 (wgrad) operands with every dim a multiple of 128."""
    (m, k), (n, _) = a.shape, b.shape
    pair = (a.layout, b.layout)
    return pair in ((L.BLOCK_1x128, L.BLOCK_128x128), (L.BLOCK_1x128, L.BLOCK_1x128)) and not (m % 128 or n % 128
                                                                                              or k % 128)


def _triton_blocks(a: Operand, b: Operand, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """``a @ b.T`` for block-scaled operands with an E5M2 one (HYBRID), which torch's
    ``scaled_mm`` refuses on SM90: our Triton grouped GEMMs with one group. The products of each
    128-deep K step are scaled and summed in FP32 (DeepSeek-V3's promotion), so results match
    cuBLAS's E4M3 path within accumulation order, not bitwise."""
    from .kernels import triton_grouped
    from .quant.kernels import segment_offsets

    (m, k), (n, _) = a.shape, b.shape
    if b.layout is L.BLOCK_128x128:  # fprop / dgrad: a's 1x128 scales M-major ([K/128, M]), b's [N/128, K/128]
        return triton_grouped.grouped_rows(a.data.contiguous(), b.data.contiguous().view(1, n, k),
                                           a.scale_inv.t().contiguous(), b.scale_inv.contiguous(),
                                           segment_offsets([m], a.data.device), out_dtype, blocked=True,
                                           fast_accum=fast_accum)
    # wgrad: both 1x128 along the contraction (the tokens), each scale as [K/128, rows]
    return triton_grouped.grouped_kgroup(a.data.contiguous(), b.data.contiguous(), a.scale_inv.t().contiguous(),
                                         b.scale_inv.t().contiguous(), segment_offsets([k], a.data.device), m, n,
                                         out_dtype, blocked=True, fast_accum=fast_accum)[0]


# ---- emulation on a GPU is never silent ----
_noticed: set[tuple[str, str]] = set()


def _emulation_reason(a: Operand, b: Operand) -> str:
    if not native_supported(a.layout, b.layout, a.data.device):
        return "this GPU has no native FP8 GEMM for these scale layouts"
    return "cuBLAS's FP8 GEMMs need m, n and k multiples of 16"


def notice_emulation(name: str, layouts: tuple[ScaleLayout, ScaleLayout], mnk: tuple[int, int, int],
                     why: str) -> None:
    """A GEMM on a GPU is emulated (dequantize + FP32 matmul: right numbers, several times slower):
    warn once per GEMM kind and reason; with ``MEGATRON_FP8_STRICT=1`` raise instead, so that
    benchmarks and GPU CI can forbid it."""
    if os.environ.get("MEGATRON_FP8_STRICT", "0") not in ("", "0"):
        raise RuntimeError(f"{name} {mnk} ({layouts[0].value} x {layouts[1].value}) would be emulated on the GPU: "
                           f"{why} (MEGATRON_FP8_STRICT=1 forbids emulation)")
    key = (name.split("[")[0], why)
    if key in _noticed:
        return
    _noticed.add(key)
    warnings.warn(f"megatron_fp8: {name} {mnk} ({layouts[0].value} x {layouts[1].value}) is emulated on the GPU "
                  f"(dequantize + FP32 matmul, several times slower): {why}. Shown once per GEMM kind and "
                  f"reason; MEGATRON_FP8_STRICT=1 makes it an error", RuntimeWarning, stacklevel=3)
