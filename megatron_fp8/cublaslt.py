"""FP8 GEMMs through cuBLASLt itself (ctypes on the ``libcublasLt`` torch loaded), for the
tensorwise and block-scaled native GEMMs of ``gemm``.

Why: torch's ``scaled_mm`` builds its cuBLASLt descriptors and asks the heuristic again on every
call. Measured on an H200 (docs/benchmarks.md run Y, ``scripts/probe_cublaslt_algos.py --host``):
~60-67 us of host time per block-scaled GEMM and ~34-49 us per tensorwise one, more than the GPU
spends on an expert's GEMM of 2048 tokens (27-57 us), so an eager step that runs one GEMM per
expert waited on the host. Here each problem (shape, dtypes, scale layouts, pointer alignment)
builds its descriptors and takes the heuristic's first answer once; a call then sets the two
scale pointers and launches: ~19-21 us of host time, and the same kernel, bit for bit (the same
first answer torch takes when its workspace is off, ``CUBLASLT_WORKSPACE_SIZE=0``).

No workspace is offered, so no GEMM needs one (nor the memsets of cuBLAS's stream-K kernels) and
a captured CUDA graph holds no buffer of ours. Where cuBLASLt has no answer (an output dtype it
refuses for these scales, say), ``matmul`` returns False and ``gemm`` calls torch as before.
Rowwise GEMMs stay with torch (CUTLASS on SM90). ``MEGATRON_FP8_CUBLASLT=0`` turns this off.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass

import torch

from .quant.formats import ScaleLayout

L = ScaleLayout

# cublasLt.h / library_types.h values
COMPUTE_32F, R_32F = 68, 0
DTYPES = {torch.float8_e4m3fn: 28, torch.float8_e5m2: 29, torch.bfloat16: 14, torch.float16: 2, torch.float32: 0}
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER, DESC_FAST_ACCUM = 3, 4, 17, 18, 25
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
SCALE_MODES = {L.TENSOR: 0, L.BLOCK_1x128: 4, L.BLOCK_128x128: 5}  # SCALAR_32F, VEC128_32F, BLK128x128_32F
PREF_MAX_WORKSPACE_BYTES = 1
PREF_MIN_ALIGNMENT_BYTES = (5, 6, 7, 8)  # A, B, C, D
_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)


class Algo(ctypes.Structure):
    """``cublasLtMatmulAlgo_t``: 64 opaque bytes."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    """``cublasLtMatmulHeuristicResult_t``."""

    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def enabled() -> bool:
    """``MEGATRON_FP8_CUBLASLT``: ``1`` (the default), tensorwise and block-scaled native GEMMs call
    cuBLASLt here; ``0``: through torch's ``scaled_mm``. Anything else raises."""
    v = os.environ.get("MEGATRON_FP8_CUBLASLT", "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"MEGATRON_FP8_CUBLASLT={v!r}; allowed: '1' (cuBLASLt called directly, descriptors kept) "
                         "or '0' (torch's scaled_mm)")
    return v == "1"


def serves(a_layout: ScaleLayout, b_layout: ScaleLayout, out_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``matmul`` may take this GEMM (it can still find no cuBLASLt answer)."""
    return (device.type == "cuda" and a_layout in SCALE_MODES and b_layout in SCALE_MODES
            and (a_layout is L.TENSOR) == (b_layout is L.TENSOR) and out_dtype in DTYPES
            and enabled() and library() is not None)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The ``libcublasLt`` this process loaded with torch's CUDA libraries (found in its memory
    map), or None (not Linux, or not loaded)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.current_blas_handle()  # torch's cuBLAS is up (and with it cuBLASLt)
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libcublasLt.so" in line})
        return ctypes.CDLL(paths[0]) if paths else None
    except OSError:
        return None


def _ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"megatron_fp8.cublaslt: {what} failed with cuBLAS status {status} "
                           "(MEGATRON_FP8_CUBLASLT=0 routes the GEMMs through torch instead)")


@functools.cache
def _handle(device: int) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        _ok(library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@dataclass
class _Plan:
    """One problem's descriptors and the kernel the heuristic picked for it."""

    handle: ctypes.c_void_p
    desc: ctypes.c_void_p
    a: ctypes.c_void_p  # cuBLASLt's A: our b, ``[n, k]`` K-major seen as ``[k, n]``, transposed
    b: ctypes.c_void_p  # cuBLASLt's B: our a, ``[m, k]`` seen as ``[k, m]``
    d: ctypes.c_void_p  # the output ``[m, n]`` row-major seen as ``[n, m]``
    algo: Algo
    lock: threading.Lock


_plans: dict[tuple, _Plan | None] = {}


def _set(lib: ctypes.CDLL, desc: ctypes.c_void_p, attr: int, value: ctypes._SimpleCData) -> None:
    _ok(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
        f"matmul descriptor attribute {attr}")


def _layout(lib: ctypes.CDLL, dtype: int, rows: int, cols: int) -> ctypes.c_void_p:
    lay = ctypes.c_void_p()
    _ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                                       ctypes.c_int64(rows)), "matrix layout")
    return lay


def _plan(key: tuple) -> _Plan | None:
    """Build the plan for ``key`` (see ``matmul``), or None where cuBLASLt has no kernel for it."""
    device, m, n, k, a_dtype, b_dtype, out_dtype, a_layout, b_layout, fast_accum, aligns = key
    lib = library()
    desc = ctypes.c_void_p()
    _ok(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, R_32F), "matmul descriptor")
    _set(lib, desc, DESC_TRANSA, ctypes.c_int32(OP_T))
    _set(lib, desc, DESC_TRANSB, ctypes.c_int32(OP_N))
    _set(lib, desc, DESC_A_SCALE_MODE, ctypes.c_int32(SCALE_MODES[b_layout]))
    _set(lib, desc, DESC_B_SCALE_MODE, ctypes.c_int32(SCALE_MODES[a_layout]))
    _set(lib, desc, DESC_FAST_ACCUM, ctypes.c_int8(int(fast_accum)))
    la, lb = _layout(lib, DTYPES[b_dtype], k, n), _layout(lib, DTYPES[a_dtype], k, m)
    ld = _layout(lib, DTYPES[out_dtype], n, m)
    pref = ctypes.c_void_p()
    _ok(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "matmul preference")
    try:
        _ok(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ctypes.c_uint64(0)),
                                                     8), "workspace preference")
        for attr, align in zip(PREF_MIN_ALIGNMENT_BYTES, aligns):
            _ok(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(ctypes.c_uint32(align)), 4),
                "alignment preference")
        found, got = Heuristic(), ctypes.c_int(0)
        handle = _handle(device)
        status = lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, ld, ld, pref, 1, ctypes.byref(found),
                                                    ctypes.byref(got))
    finally:
        lib.cublasLtMatmulPreferenceDestroy(pref)
    if status != 0 or got.value < 1 or found.state != 0:
        for lay in (la, lb, ld):
            lib.cublasLtMatrixLayoutDestroy(lay)
        lib.cublasLtMatmulDescDestroy(desc)
        return None
    return _Plan(handle, desc, la, lb, ld, found.algo, threading.Lock())


def _alignment(t: torch.Tensor) -> int:
    """The largest power of two up to 256 dividing ``t``'s address (what cuBLASLt may assume)."""
    p = t.data_ptr()
    return min(p & -p, 256) if p else 256


def matmul(a: torch.Tensor, a_scale: torch.Tensor, a_layout: ScaleLayout, b: torch.Tensor, b_scale: torch.Tensor,
           b_layout: ScaleLayout, out: torch.Tensor, fast_accum: bool = False) -> bool:
    """``out = a @ b.T`` (``a [m, k]``, ``b [n, k]``, both FP8 and K-major, ``out`` a contiguous
    ``[m, n]``) with the scales as torch's ``scaled_mm`` takes them (``gemm._block_scale_layout``
    for blocks, one-element tensors for tensorwise). False (nothing launched) where cuBLASLt has
    no kernel for the problem. Only for layouts ``serves`` accepts."""
    (m, k), (n, _) = a.shape, b.shape
    device = a.device.index if a.device.index is not None else torch.cuda.current_device()
    key = (device, m, n, k, a.dtype, b.dtype, out.dtype, a_layout, b_layout, bool(fast_accum),
           (_alignment(b), _alignment(a), _alignment(out), _alignment(out)))
    plan = _plans.get(key, False)
    if plan is False:
        plan = _plans[key] = _plan(key)
    if plan is None:
        return False
    if torch.cuda.current_device() != device:
        with torch.cuda.device(device):
            return matmul(a, a_scale, a_layout, b, b_scale, b_layout, out, fast_accum)
    lib = library()
    stream = torch.cuda.current_stream(device).cuda_stream
    with plan.lock:  # the descriptor carries this call's scale pointers until it is launched
        _set(lib, plan.desc, DESC_A_SCALE_POINTER, ctypes.c_void_p(b_scale.data_ptr()))
        _set(lib, plan.desc, DESC_B_SCALE_POINTER, ctypes.c_void_p(a_scale.data_ptr()))
        _ok(lib.cublasLtMatmul(plan.handle, plan.desc, ctypes.byref(_ONE), ctypes.c_void_p(b.data_ptr()), plan.a,
                               ctypes.c_void_p(a.data_ptr()), plan.b, ctypes.byref(_ZERO),
                               ctypes.c_void_p(out.data_ptr()), plan.d, ctypes.c_void_p(out.data_ptr()), plan.d,
                               ctypes.byref(plan.algo), None, ctypes.c_size_t(0), ctypes.c_void_p(stream)),
            "cublasLtMatmul")
    return True
