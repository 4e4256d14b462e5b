"""FP8 GEMMs called on cuBLASLt itself through ctypes: the block-scaled ones (E4M3 operands:
``block_choice``; with an E5M2 operand, HYBRID block scaling's gradients, which torch refuses), the
wgrads that add themselves into Megatron's ``main_grad`` (``accumulate``) and, opt-in, every
per-tensor-scaled one (``tensor_choice``). ``bind`` keeps one problem's call (``Bound``): what the
lean routes launch every step, with plain ints through ctypes and nothing looked up per call.

Per-tensor scales: the same question torch's ``_scaled_mm`` asks (descriptor attributes,
layouts, workspace size), asked once per problem: torch's kernel, so torch's bits
(tests/test_cublaslt_gpu.py, H100). What it adds over torch: ``accumulate`` (beta = 1), a wgrad
added into Megatron's FP32 ``main_grad`` in the GEMM's epilogue, the gradient-accumulation fusion
without a separate add kernel (which reads a BF16 gradient and the FP32 ``main_grad`` and writes
it back: 10 bytes a parameter per micro-batch).

Why: torch's ``scaled_mm`` refuses E5M2 operands with 1x128 / 128x128 scales on SM90 ("Invalid
scaling configuration"), but cuBLASLt's block-scaled kernels take one E5M2 operand (E4M3 x E5M2
and E5M2 x E4M3; Transformer Engine's exact block-GEMM tests run both on Hopper). Without this
module those GEMMs (every dgrad and wgrad under ``Float8BlockScaling(fp8_format=HYBRID)``, which
Megatron's ``--fp8-format hybrid`` gives) run on our Triton GEMM (``triton_grouped``, one
group): in Megatron-LM's loop on an H200 at ~620-720 TFLOP/s, against ~1000 for cuBLAS's E4M3
block GEMMs (docs/benchmarks.md, run AC).

The call is cuBLASLt's column-major view of ``out[m, n] = a @ b.T`` (``a [m, k]``, ``b [n, k]``,
both K-major): ``D[n, m] = op(A) @ B`` with A = b's bytes seen as ``[k, n]`` and transposed,
B = a's as ``[k, m]``, A's scales b's and B's a's, laid out as torch hands them to cuBLASLt
(``gemm._block_scale_layout``): the arrangement ``scripts/probes/probe_cublaslt_algos.py``
verified bit for bit against torch's E4M3 block GEMMs on the H200 (run Y). Each problem (shape,
dtypes, scale layouts, device) builds its descriptors and takes the heuristic's first answer
once; a call sets the two scale pointers and launches. cuBLASLt is offered a workspace as torch
offers it for its own ``scaled_mm`` (``CUBLASLT_WORKSPACE_SIZE`` KiB, default 32 MiB on SM90),
one per device and stream, kept for the process's life (a CUDA graph may replay it at any time).
The default 256-byte pointer alignment
is assumed, so a call whose pointers are not 256-byte aligned is declined, as is a problem
cuBLASLt has no kernel for: ``matmul`` then returns False and ``gemm`` runs the Triton GEMM.

Why the workspace: without one the heuristic cannot choose split-K or stream-K kernels. In
Megatron-LM's loop at dense-1b (run AD) the HYBRID block step, its dgrad and wgrad here without
a workspace, took 149 ms an iteration against 129 for the same recipe with E4M3 gradients, all
on torch's ``scaled_mm`` with its workspace: ~150 us more per direct GEMM. Same env variable,
same sizes as torch: with equal settings both ask cuBLASLt the same question (the bitwise test
of ``tests/test_cublaslt_gpu.py`` sets 0 for both).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import warnings
from dataclasses import dataclass

import torch

from ..quant.formats import ScaleLayout
from ..settings import env_choice

L = ScaleLayout

# cublasLt.h / library_types.h values (those probe_cublaslt_algos.py ran on the H200)
COMPUTE_32F, R_32F = 68, 0
DTYPES = {torch.float8_e4m3fn: 28, torch.float8_e5m2: 29, torch.bfloat16: 14, torch.float16: 2, torch.float32: 0}
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the GEMM core's outputs (C = D: never FP8)
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 3, 4, 17, 18
DESC_FAST_ACCUM, DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 25, 31, 32
SCALE_MODES = {L.TENSOR: 0, L.BLOCK_1x128: 4, L.BLOCK_128x128: 5}  # SCALAR_32F, VEC128_32F, BLK128x128_32F
PREF_MAX_WORKSPACE_BYTES = 1
ALIGN = 256  # bytes: cuBLASLt's default minimum alignment of A, B, C and D (no preference lowers it)
_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)
_ONE_ADDR, _ZERO_ADDR = ctypes.addressof(_ONE), ctypes.addressof(_ZERO)


class Algo(ctypes.Structure):
    """``cublasLtMatmulAlgo_t``: 64 opaque bytes."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    """``cublasLtMatmulHeuristicResult_t``."""

    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def choice() -> str:
    """``MEGATRON_FP8_HYBRID_GEMM``: ``auto`` (the default; cuBLASLt where it has a kernel, else
    our Triton GEMM), ``cublaslt`` (an error where cuBLASLt declines: for benchmarks that must
    not fall back) or ``triton``. Anything else raises."""
    return env_choice("MEGATRON_FP8_HYBRID_GEMM", "auto", {
        "auto": "cuBLASLt where it has a kernel, else Triton", "cublaslt": "cuBLASLt or an error", "triton": ""})


@functools.cache
def library() -> ctypes.CDLL | None:
    """The ``libcublasLt`` this process loaded with torch's CUDA libraries (found in its memory
    map), or None (no CUDA, not Linux, or not loaded)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.current_blas_handle()  # torch's cuBLAS is up, and with it cuBLASLt
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libcublasLt.so" in line})
    except OSError:
        return None
    return ctypes.CDLL(paths[0]) if paths else None


def _ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"megatron_fp8 cuBLASLt: {what} failed with cuBLAS status {status} "
                           f"(MEGATRON_FP8_HYBRID_GEMM=triton runs these GEMMs on our Triton kernel instead)")


@functools.cache
def _handle(device: int) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        _ok(library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@functools.cache
def _calls() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:
    """``cublasLtMatmulDescSetAttribute`` and ``cublasLtMatmul`` as function objects of their own
    with argument types declared (plain ints pass as pointers: no ctypes object made per call)."""
    lib, vp = library(), ctypes.c_void_p
    set_attr, mm = lib["cublasLtMatmulDescSetAttribute"], lib["cublasLtMatmul"]
    set_attr.argtypes, set_attr.restype = [vp, ctypes.c_int, vp, ctypes.c_size_t], ctypes.c_int
    mm.argtypes, mm.restype = [vp] * 14 + [ctypes.c_size_t, vp], ctypes.c_int
    return set_attr, mm


@dataclass
class _Plan:
    """One problem's descriptors and the kernel the heuristic picked for it."""

    handle: ctypes.c_void_p
    desc: ctypes.c_void_p
    a: ctypes.c_void_p  # cuBLASLt's A: our b ``[n, k]`` seen as ``[k, n]``, transposed
    b: ctypes.c_void_p  # cuBLASLt's B: our a ``[m, k]`` seen as ``[k, m]``
    d: ctypes.c_void_p  # our out ``[m, n]`` row-major seen as ``[n, m]`` (also C)
    algo: Algo
    lock: threading.Lock  # the descriptor holds one call's scale pointers until it is launched

    def __post_init__(self) -> None:
        # the scale pointers' host-side boxes and every fixed argument, as plain ints
        self.boxes = (ctypes.c_void_p(), ctypes.c_void_p())
        self.box_addrs = tuple(ctypes.addressof(b) for b in self.boxes)
        self.fixed = (self.handle.value, self.desc.value, self.a.value, self.b.value, self.d.value,
                      ctypes.addressof(self.algo))

    def launch(self, a: int, a_scale: int, b: int, b_scale: int, out: int, accumulate: bool, ws: int, ws_bytes: int,
               stream: int) -> None:
        """``out (+)= a @ b.T`` on ``stream``, every argument a pointer (an int)."""
        set_attr, mm = _calls()
        handle, desc, lay_a, lay_b, lay_d, algo = self.fixed
        box_a, box_b = self.boxes
        with self.lock:
            box_a.value, box_b.value = b_scale, a_scale  # cuBLASLt's A is our b
            status = (set_attr(desc, DESC_A_SCALE_POINTER, self.box_addrs[0], 8)
                      or set_attr(desc, DESC_B_SCALE_POINTER, self.box_addrs[1], 8))
            if not status:
                status = mm(handle, desc, _ONE_ADDR, b, lay_a, a, lay_b, _ONE_ADDR if accumulate else _ZERO_ADDR, out,
                            lay_d, out, lay_d, algo, ws or None, ws_bytes, stream)
        _ok(status, "cublasLtMatmul")


_plans: dict[tuple, _Plan | None] = {}


def _set(lib: ctypes.CDLL, desc: ctypes.c_void_p, attr: int, value: ctypes._SimpleCData) -> None:
    _ok(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.c_size_t(ctypes.sizeof(value))),
        f"matmul descriptor attribute {attr}")


def _layout(lib: ctypes.CDLL, dtype: int, rows: int, cols: int) -> ctypes.c_void_p:
    lay = ctypes.c_void_p()
    _ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                                       ctypes.c_int64(rows)), "matrix layout")
    return lay


@functools.cache
def workspace_bytes(device: int) -> int:
    """The workspace offered to cuBLASLt: ``CUBLASLT_WORKSPACE_SIZE`` (KiB, as torch reads it),
    else torch's default for the device (32 MiB on SM90 and newer, 4 MiB before). Read once."""
    v = os.environ.get("CUBLASLT_WORKSPACE_SIZE")
    if v is not None:
        try:
            kib = int(v)
        except ValueError:
            raise ValueError(f"CUBLASLT_WORKSPACE_SIZE={v!r}: a size in KiB (0: no workspace)") from None
        if kib < 0:
            raise ValueError(f"CUBLASLT_WORKSPACE_SIZE={v!r}: a size in KiB (0: no workspace)")
        return kib * 1024
    return (32 if torch.cuda.get_device_capability(device)[0] >= 9 else 4) * 2**20


_workspaces: dict[tuple[int, int], torch.Tensor] = {}


def _workspace(device: int, stream: int) -> torch.Tensor | None:
    """The workspace of ``stream`` on ``device`` (made at its first GEMM, kept for good), or None
    (size 0). A stream first seen inside a CUDA graph capture gets its buffer from the graph's
    memory pool, as torch's own cuBLASLt workspaces do: the same size as eagerly, so a captured
    GEMM asks the heuristic what the eager one asks and gets the same kernel (the same bits)."""
    ws = _workspaces.get((device, stream))
    if ws is None and workspace_bytes(device):
        ws = _workspaces[(device, stream)] = torch.empty(workspace_bytes(device), dtype=torch.uint8,
                                                         device=torch.device("cuda", device))
    return ws


def _plan(key: tuple, a_scale: torch.Tensor, b_scale: torch.Tensor) -> _Plan | None:
    """Descriptors and the heuristic's first kernel for ``key`` (see ``matmul``), asked with the
    first call's scale pointers set (as torch and the verified probe ask it) and the workspace
    size in the key; None where cuBLASLt has none. Frees what it made when it returns None or
    raises."""
    device, m, n, k, a_dtype, b_dtype, out_dtype, a_layout, b_layout, ws_bytes, fast_accum = key
    lib = library()
    desc, pref, lays = ctypes.c_void_p(), ctypes.c_void_p(), []
    found, got, status = Heuristic(), ctypes.c_int(0), -1
    try:
        _ok(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, R_32F), "matmul descriptor")
        _set(lib, desc, DESC_TRANSA, ctypes.c_int32(OP_T))
        _set(lib, desc, DESC_TRANSB, ctypes.c_int32(OP_N))
        _set(lib, desc, DESC_A_SCALE_MODE, ctypes.c_int32(SCALE_MODES[b_layout]))
        _set(lib, desc, DESC_B_SCALE_MODE, ctypes.c_int32(SCALE_MODES[a_layout]))
        if a_layout is L.TENSOR:  # as torch's scaled_mm sets it for per-tensor scales
            _set(lib, desc, DESC_FAST_ACCUM, ctypes.c_int8(1 if fast_accum else 0))
        _set(lib, desc, DESC_A_SCALE_POINTER, ctypes.c_void_p(b_scale.data_ptr()))
        _set(lib, desc, DESC_B_SCALE_POINTER, ctypes.c_void_p(a_scale.data_ptr()))
        for dtype, rows, cols in ((b_dtype, k, n), (a_dtype, k, m), (out_dtype, n, m)):
            lays.append(_layout(lib, DTYPES[dtype], rows, cols))
        _ok(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "matmul preference")
        _ok(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES,
                                                     ctypes.byref(ctypes.c_uint64(ws_bytes)), ctypes.c_size_t(8)),
            "workspace preference")
        status = lib.cublasLtMatmulAlgoGetHeuristic(_handle(device), desc, lays[0], lays[1], lays[2], lays[2], pref,
                                                    ctypes.c_int(1), ctypes.byref(found), ctypes.byref(got))
    finally:
        if pref.value:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        if status != 0 or got.value < 1 or found.state != 0:
            for lay in lays:
                lib.cublasLtMatrixLayoutDestroy(lay)
            if desc.value:
                lib.cublasLtMatmulDescDestroy(desc)
    if status != 0 or got.value < 1 or found.state != 0:
        return None
    return _Plan(_handle(device), desc, *lays, found.algo, threading.Lock())


_failed: set[tuple] = set()


def _plan_or_none(key: tuple, a_scale: torch.Tensor, b_scale: torch.Tensor) -> _Plan | None:
    """``_plan``, with a failing cuBLASLt call (a status other than "no kernel") turned into None
    and a warning naming the problem: the caller then runs the Triton GEMM, never silently."""
    try:
        return _plan(key, a_scale, b_scale)
    except RuntimeError as e:
        if key not in _failed:
            _failed.add(key)
            warnings.warn(f"megatron_fp8: cuBLASLt could not plan the FP8 GEMM {key[1:4]} ({key[4]} x {key[5]} -> "
                          f"{key[6]}): {e}; torch's scaled_mm or our Triton GEMM runs it instead", RuntimeWarning,
                          stacklevel=4)
        return None


def block_choice() -> str:
    """``MEGATRON_FP8_BLOCK_GEMM``: who runs the block GEMMs with two E4M3 operands (native only
    on SM90, ``gemm.native_supported``), ``cublaslt`` (the default) or ``torch`` (its ``scaled_mm``, which rebuilds
    the descriptors and asks the heuristic on every call). ``cublaslt``: ``matmul`` here, and the
    lean routes' bound call (``Bound``), torch's question to cuBLASLt asked once per problem with the
    same workspace size. With the bound call an eager blockwise ``Linear`` step took 17-19% less
    host time than on torch's (docs/benchmarks.md run AU, fresh processes alternated, H100); the
    grouped steps about the same."""
    return env_choice("MEGATRON_FP8_BLOCK_GEMM", "cublaslt",
                      {"cublaslt": "cuBLASLt called directly, the default", "torch": "torch's scaled_mm"})


def tensor_choice() -> str:
    """``MEGATRON_FP8_TENSOR_GEMM``: who runs the per-tensor-scaled GEMMs (current and delayed
    scaling) on CUDA, ``torch`` (the default: ``torch._scaled_mm``) or ``cublaslt`` (``matmul``
    here: the question torch asks cuBLASLt, with the descriptors and the heuristic's answer kept
    per problem instead of rebuilt on every call; the same bits, but no host time saved in an
    eager ``Linear`` step on the H100: run AK within the noise, run AN 26% more, and with the bound
    call of run AU -11% and +7% in two readings). The wgrads that add themselves into
    ``main_grad`` (``gemm.accumulate``) call cuBLASLt whichever is set."""
    return env_choice("MEGATRON_FP8_TENSOR_GEMM", "torch",
                      {"torch": "torch's _scaled_mm, the default", "cublaslt": "cuBLASLt called directly"})


_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def serves(a: torch.Tensor, a_layout: ScaleLayout, b: torch.Tensor, b_layout: ScaleLayout,
           out_dtype: torch.dtype, accumulate: bool = False) -> bool:
    """Whether ``matmul`` may take this GEMM (it can still find no kernel): on CUDA, per-tensor
    scales on both operands (not two E5M2 ones), every dim a multiple of 16, to ``accumulate``
    or under ``MEGATRON_FP8_TENSOR_GEMM=cublaslt``; block scales with every dim a multiple of 128 and one
    E5M2 operand (unless ``MEGATRON_FP8_HYBRID_GEMM=triton``) or two E4M3 ones (unless
    ``MEGATRON_FP8_BLOCK_GEMM=torch``)."""
    if not (a.is_cuda and a_layout in SCALE_MODES and b_layout in SCALE_MODES and out_dtype in OUT_DTYPES):
        return False
    (m, k), (n, _) = a.shape, b.shape
    if a_layout is L.TENSOR or b_layout is L.TENSOR:
        return (a_layout is b_layout and not (m % 16 or n % 16 or k % 16) and (a.dtype, b.dtype) != (_E5M2, _E5M2)
                and (accumulate or tensor_choice() == "cublaslt") and library() is not None)
    if (a_layout, b_layout) == (L.BLOCK_128x128, L.BLOCK_128x128) or m % 128 or n % 128 or k % 128:
        return False
    dtypes = (a.dtype, b.dtype)
    if dtypes in ((_E5M2, _E4M3), (_E4M3, _E5M2)):
        wanted = choice() != "triton"
    else:
        wanted = dtypes == (_E4M3, _E4M3) and block_choice() == "cublaslt"
    return wanted and library() is not None


def matmul(a: torch.Tensor, a_scale: torch.Tensor, a_layout: ScaleLayout, b: torch.Tensor, b_scale: torch.Tensor,
           b_layout: ScaleLayout, out: torch.Tensor, fast_accum: bool = False, accumulate: bool = False) -> bool:
    """``out = a @ b.T`` (``a [m, k]``, ``b [n, k]``, FP8 and K-major; ``out`` a contiguous
    ``[m, n]``), the scales laid out as torch hands them to cuBLASLt (``gemm.cublaslt_scale``);
    with ``accumulate``, ``out += a @ b.T`` (beta = 1, C = D = ``out``: the wgrad added into an
    FP32 ``main_grad`` in the GEMM's epilogue); ``fast_accum`` as torch's ``use_fast_accum``
    (per-tensor scales only). False, with nothing launched, where cuBLASLt has no kernel for the
    problem (or failed to plan it: warned once), a pointer is not 256-byte aligned (block scales:
    16) or an operand is not contiguous. Only for what ``serves`` accepts. A failing launch raises."""
    bound = bind(a, a_scale, a_layout, b, b_scale, b_layout, out.dtype, fast_accum, accumulate)
    if bound is None:
        return False
    if torch._C._cuda_getDevice() != bound.device:  # the handle and the launch belong to a's device
        with torch.cuda.device(bound.device):
            return bound(a, a_scale, b, b_scale, out)
    return bound(a, a_scale, b, b_scale, out)


class Bound:
    """``matmul`` for one problem with its plan found: what a lean route (``ops.routes``) calls
    every step. Per call it only checks the operands' shapes and pointers, reads the current
    stream and launches (``_Plan.launch``); ``matmul`` also builds the problem's key, looks the
    plan up and makes Python objects for every pointer. Same plan, same kernel, same bits."""

    __slots__ = ("plan", "device", "a_shape", "b_shape", "scale_align", "ws_bytes", "accumulate")

    def __init__(self, plan: _Plan, device: int, a_shape: torch.Size, b_shape: torch.Size, scale_align: int,
                 ws_bytes: int, accumulate: bool) -> None:
        self.plan, self.device, self.a_shape, self.b_shape = plan, device, a_shape, b_shape
        self.scale_align, self.ws_bytes, self.accumulate = scale_align, ws_bytes, accumulate

    def __call__(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                 out: torch.Tensor) -> bool:
        """``out (+)= a @ b.T`` as ``matmul``; False, with nothing launched, where ``matmul`` would
        decline it, or for operands of other shapes or another device than the bound ones (the
        caller then runs the general GEMM)."""
        pa, pb, po, psa, psb = a.data_ptr(), b.data_ptr(), out.data_ptr(), a_scale.data_ptr(), b_scale.data_ptr()
        if (pa % ALIGN or pb % ALIGN or po % ALIGN or psa % self.scale_align or psb % self.scale_align
                or a.shape != self.a_shape or b.shape != self.b_shape or not (a.is_contiguous() and b.is_contiguous())
                or torch._C._cuda_getDevice() != self.device):
            return False
        stream = torch._C._cuda_getCurrentRawStream(self.device)
        ws = _workspace(self.device, stream)
        self.plan.launch(pa, psa, pb, psb, po, self.accumulate, ws.data_ptr() if ws is not None else 0,
                         self.ws_bytes, stream)
        return True


def bind(a: torch.Tensor, a_scale: torch.Tensor, a_layout: ScaleLayout, b: torch.Tensor, b_scale: torch.Tensor,
         b_layout: ScaleLayout, out_dtype: torch.dtype, fast_accum: bool = False, accumulate: bool = False
         ) -> Bound | None:
    """``matmul`` for operands like these (same shapes, dtypes, layouts, device) bound to its plan,
    or None where cuBLASLt has no kernel for it. Only for what ``serves`` accepts."""
    device = a.device.index if a.device.index is not None else torch.cuda.current_device()
    ws_bytes = workspace_bytes(device)
    (m, k), (n, _) = a.shape, b.shape
    key = (device, m, n, k, a.dtype, b.dtype, out_dtype, a_layout, b_layout, ws_bytes,
           fast_accum and a_layout is L.TENSOR)
    plan = _plans.get(key, False)
    if plan is False:
        with torch.cuda.device(device):
            plan = _plans[key] = _plan_or_none(key, a_scale, b_scale)
    if plan is None:
        return None
    return Bound(plan, device, a.shape, b.shape, 4 if a_layout is L.TENSOR else 16, ws_bytes, accumulate)
