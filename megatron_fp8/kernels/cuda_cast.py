"""The tile casts of BF16 tensors (both copies) as a CUDA C kernel (``cuda_cast.cu``), compiled at
first use by NVRTC through ``torch.cuda._compile_kernel``.

A block of 256 threads owns a 128x128 tile: it loads the tile once, casts the rowwise copy from
registers, takes the column amaxes (1x128) from the tile parked in shared memory and writes the
transposed FP8 tile out 128 bytes a warp. The Triton cast (``triton_cast``) re-reads the tile
transposed for its 1x128 column copy. Built with the K tiles fastest in the grid, evict-first
FP8 stores and, unless ``formats.cast_clamp`` says otherwise, no clamp ahead of the conversion
(whose ``.satfinite`` gives the same bits). Measured on an H200 (``scripts/probe_cuda_cast.py``,
docs/benchmarks.md run W), Triton -> CUDA: eight experts' x at K=4096 112 -> 77 us (1x128),
their dy at N=7168 190 -> 128 us, their weights 83 -> 74 us (128x128), x with given per-expert
scales 82 -> 73 us (tensor); same bits.

Serves both copies of a BF16 tensor whose rows and columns are multiples of 128, with segments
(experts) aligned to 128 rows, in the three modes: ``1x128``, ``128x128`` and ``tensor`` with
the scales given (delayed scaling, and current scaling's cast after its amax and scale
launches while a CUDA graph is captured: ``triton_cast.cast_current``,
``MEGATRON_FP8_CUDA_CURRENT``). ``serves`` declines anything else, and ``cast`` returns False
where the kernel cannot be built (no NVRTC): either way the Triton cast runs.
``MEGATRON_FP8_CUDA_CAST=0`` turns it off. Outputs fill the Triton cast's raw buffers
(``triton_cast._launch``) with its bits: the GPU tests compare both with the CPU reference.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..quant.formats import cast_clamp

TILE = 128
_SRC = Path(__file__).with_name("cuda_cast.cu")
_BLOCKS_PER_SM = 3  # 80 registers; at 4 (64 registers, 88 bytes spilled) it ran 5-10% slower
# the cast modes, numbered as both kernels number them (cuda_cast.cu's MODE, triton_cast's MODE)
MODES = {"1x128": 0, "128x128": 1, "tensor": 2}
_CLAMP = cast_clamp()  # read once, at import, as triton_cast reads it: both casts agree


def enabled() -> bool:
    """``MEGATRON_FP8_CUDA_CAST``: ``1`` (the default), the casts ``serves`` takes run here; ``0``:
    every cast runs in Triton. Anything else raises."""
    v = os.environ.get("MEGATRON_FP8_CUDA_CAST", "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"MEGATRON_FP8_CUDA_CAST={v!r}; allowed: '1' (the CUDA tile cast where it serves) "
                         "or '0' (Triton casts only)")
    return v == "1"


def current_enabled() -> bool:
    """``MEGATRON_FP8_CUDA_CURRENT``: whether current scaling's casts of the tensors ``serves``
    takes run as amax and scale launches, then this kernel with the scales given, instead of the
    one-launch Triton cast (``triton_cast.cast_current``). ``capture`` (the default): only while
    a CUDA graph is being captured, where launches cost nothing at replay: the graphed grouped
    step ran 0.7-1.2% faster with it (docs/benchmarks.md run W), but eagerly the three launches
    cost ~130 us of host time per cast against ~60-85 for the one launch, and the GPU then waits
    on the host (run X); ``1``: always; ``0``: never. Anything else raises."""
    v = current_setting()
    if v == "0" or not enabled():
        return False
    return v == "1" or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def current_setting() -> str:
    """``MEGATRON_FP8_CUDA_CURRENT``, checked: ``capture`` (unset), ``1`` or ``0``."""
    v = os.environ.get("MEGATRON_FP8_CUDA_CURRENT", "capture").strip()
    if v not in ("capture", "0", "1"):
        raise ValueError(f"MEGATRON_FP8_CUDA_CURRENT={v!r}; allowed: 'capture' (the default: while a CUDA graph "
                         "is captured), '1' (always) or '0' (never)")
    return v


def prebuild(mode: str, fp8_dtype: torch.dtype, device: torch.device, gather: bool = False) -> Any | None:
    """The kernel for ``mode``, ``fp8_dtype`` and ``device``, built now if it is not yet (NVRTC and
    module loading; None where it cannot be built): ``cast`` launches it, and an eager step calls
    it for the captured steps that follow under ``MEGATRON_FP8_CUDA_CURRENT=capture``, so that a
    capture only launches it."""
    return _kernel(mode, fp8_dtype == torch.float8_e5m2,
                   device.index if device.index is not None else torch.cuda.current_device(), gather)


@functools.cache
def _kernel(mode: str, e5m2: bool, device: int, gather: bool = False) -> _Kernel | None:
    """The compiled kernel for ``mode`` on ``device`` (``gather``: reading padded experts' rows
    from their unpadded tensor, ``cast``), or None (with one warning) where it cannot be built: no
    NVRTC, or a torch without ``torch.cuda._compile_kernel``."""
    options = [f"-DMODE={MODES[mode]}", f"-DE5M2={int(e5m2)}", f"-DMINB={_BLOCKS_PER_SM}", "-DKFAST=1",
               "-DSTREAM=1", f"-DNOCLAMP={int(not _CLAMP)}", f"-DGATHER={int(gather)}"]
    try:
        with torch.cuda.device(device):
            ensure_context(device)
            built = torch.cuda._compile_kernel(_SRC.read_text(), "cast_tile", nvcc_options=options)
        return _Kernel(built, built.func, device)
    except Exception as exc:  # noqa: BLE001 - any build failure means the Triton cast runs
        warnings.warn(f"megatron_fp8: the CUDA {mode} cast could not be built ({type(exc).__name__}: {exc}); "
                      "the Triton cast runs instead (MEGATRON_FP8_CUDA_CAST=0 silences this)", stacklevel=2)
        return None


_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT


def ensure_context(device: int) -> None:
    """Make ``device``'s primary context current on this thread if no context is. The driver API
    (module loading, ``cuLaunchKernel``) needs one, and a thread whose CUDA work so far went
    through torch may have none: torch does not set the device when it already reads as the
    current one, and the runtime makes its context current only at its first launch. The
    autograd engine's backward thread is such a thread when a backward's first CUDA work is
    this cast (seen on the H200 as "invalid device context", docs/benchmarks.md run AD)."""
    lib = torch.cuda._utils._get_gpu_runtime_library()
    ctx = ctypes.c_void_p()
    torch.cuda._utils._check_cuda(lib.cuCtxGetCurrent(ctypes.byref(ctx)))
    if ctx.value:
        return
    dev = ctypes.c_int()
    torch.cuda._utils._check_cuda(lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(device)))
    torch.cuda._utils._check_cuda(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))  # kept: torch holds it too
    torch.cuda._utils._check_cuda(lib.cuCtxSetCurrent(ctx))


class _Kernel(NamedTuple):
    """A built ``cast_tile``: torch's kernel object (it owns the loaded module) and the function
    handle ``_launch`` passes to the driver, on device ``device``."""

    built: Any
    func: Any
    device: int


class _Args(ctypes.Structure):
    """``cast_tile``'s parameters, in its order: eight pointers, then ``M``, ``K``, ``n_seg``."""

    _fields_ = [*((f"p{i}", ctypes.c_void_p) for i in range(8)), ("m", ctypes.c_int), ("k", ctypes.c_int),
                ("n_seg", ctypes.c_int)]


_ARGV = ctypes.c_void_p * len(_Args._fields_)
_OFFSETS = [getattr(_Args, name).offset for name, _ in _Args._fields_]


@functools.cache
def _driver_launch() -> Any:
    """The driver's ``cuLaunchKernel``, typed, looked up once. (torch's kernel object opens the
    driver library, looks the function up, builds its argument array and makes a stream object on
    every call: on the H200's host, eager blocks steps (three casts) took 16-23% more host time
    with it, docs/benchmarks.md run AA.)"""
    fn = torch.cuda._utils._get_gpu_runtime_library().cuLaunchKernel
    fn.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def _launch(kernel: _Kernel, grid: tuple[int, int], ptrs: tuple[int, ...], m: int, k: int, n_seg: int) -> None:
    """``cast_tile<<<grid, 256>>>`` on the current stream of the kernel's device. The arguments live
    in one structure for the call (the driver copies them at launch), so threads never share one."""
    args = _Args(*ptrs, m, k, n_seg)
    base = ctypes.addressof(args)
    argv = _ARGV(*[base + off for off in _OFFSETS])
    stream = torch._C._cuda_getCurrentRawStream(kernel.device)
    # the driver launches in the current device's context: the kernel's, where it was loaded
    here = torch.cuda.current_device() == kernel.device
    with contextlib.nullcontext() if here else torch.cuda.device(kernel.device):
        rc = _driver_launch()(kernel.func, grid[0], grid[1], 1, 256, 1, 1, 0, stream, argv, None)
        if rc == _INVALID_CONTEXT:  # a thread with no current context yet (ensure_context)
            ensure_context(kernel.device)
            rc = _driver_launch()(kernel.func, grid[0], grid[1], 1, 256, 1, 1, 0, stream, argv, None)
    if rc:
        torch.cuda._utils._check_cuda(rc)


def serves(x: torch.Tensor, fp8_dtype: torch.dtype, mode: str, rowwise: bool, columnwise: bool, aligned: bool,
           scale_given: bool = True, gathered: bool = False) -> bool:
    """Whether ``cast`` takes this cast (then only a build failure sends it back). ``aligned``:
    no segments, or every segment a multiple of 128 rows; ``scale_given``: tensor mode's scales
    exist before the cast (not computed inside it, as the fused Triton cast does); ``gathered``:
    ``x`` holds the real rows of experts the cast pads (any count; ``cast``'s ``gather``)."""
    m, k = x.shape
    return (enabled() and x.is_cuda and x.dtype == torch.bfloat16 and rowwise and columnwise and aligned
            and mode in MODES and (mode != "tensor" or scale_given)
            and m > 0 and k > 0 and (gathered or m % TILE == 0) and k % TILE == 0 and x.is_contiguous()
            and fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2))


def cast(x: torch.Tensor, fp8_dtype: torch.dtype, mode: str, offsets: torch.Tensor | None, n_seg: int,
         row: torch.Tensor, row_s: torch.Tensor | None, col: torch.Tensor, col_s: torch.Tensor | None,
         tensor_scale: torch.Tensor | None = None, gather: tuple[torch.Tensor, int] | None = None) -> bool:
    """Cast ``x [M, K]`` into the Triton cast's buffers (``triton_cast._launch``): ``row [M, K]``
    and ``col``, with ``row_s [K/128 * M]`` and ``col_s [M/128, K]`` (1x128), ``row_s [M/128,
    K/128]`` and the same scales transposed per segment into ``col_s [M/128 * K/128]``
    (segment e's ``[K/128, m_e/128]`` at ``start_e/128 * K/128``; 128x128), or the segments'
    given scales ``tensor_scale``, 16 bytes apart (tensor). False where the kernel cannot be
    built (nothing written). ``offsets``: the segments' device prefix sums (every one a multiple
    of 128), or None for one tensor. ``gather``: ``(real offsets, M)``: ``x`` holds only the
    segments' real rows (their device prefix sums), each padded with zero rows to its count in
    ``offsets`` (``M`` rows in all): the outputs are those of a cast of the padded tensor. Only for
    casts ``serves`` accepts."""
    if mode == "128x128" and (col_s is None or row_s is None):
        raise ValueError("cuda_cast.cast: 128x128 writes row_s and its transpose col_s; give both buffers")
    if gather is not None and offsets is None:
        raise ValueError("cuda_cast.cast: a gathered cast needs the padded segments' offsets")
    kernel = prebuild(mode, fp8_dtype, x.device, gather is not None)
    if kernel is None:
        return False
    m, k = x.shape if gather is None else (gather[1], x.shape[1])
    unread = x.data_ptr()  # for buffers this mode never touches; segments unread when n_seg is 0
    ptrs = tuple(t.data_ptr() if t is not None else unread
                 for t in (x, row, row_s, col, col_s, offsets, tensor_scale, gather[0] if gather else None))
    _launch(kernel, (k // TILE, m // TILE), ptrs, m, k, n_seg if offsets is not None else 0)  # KFAST: K tiles fastest
    return True
