"""Current scaling in one launch (CUDA): a persistent cast whose programs meet at one barrier.

``triton_cast.cast_current`` takes two launches: an amax pass, then a cast whose programs turn
the amax partials into the scale. Here one launch of as many programs as the GPU holds at once
(the driver's occupancy, up to 2 per SM) does both. Each program owns a contiguous run of the
128x128 tiles, row-major, so a run crosses at most a few segments (the experts; one segment for
a plain tensor):

1. it reduces ``|x|`` over its tiles, per segment, and folds each segment's maximum into that
   segment's amax word (an integer ``atomic_max`` over FP32 bit patterns: for non-negative
   floats the integer order is the float order, and a NaN sorts above inf, as in
   ``triton_cast``);
2. it arrives at the barrier and waits for every program;
3. program 0 publishes every segment's ``(scale, 1/scale)`` (``triton_cast``'s arithmetic), and
   each program casts its tiles again, last read first, so the tail of what it read is still in
   L2.

The bits are ``cast_current``'s: an amax is a maximum (order-free), and scale and cast are the
same code (the GPU tests compare them with ``torch.equal`` at several grid sizes). The sync words
(arrivals, departures, one amax per segment) are cleared by the last program to leave, so they
are zero between launches; each stream has its own (kernels on two streams may overlap). The
launch is cooperative: the driver refuses a grid that cannot be resident at once (then one
program per SM is used) rather than letting the barrier wait forever. Triton's interpreter runs
programs one after another, so there the grid is one program.

Measured on an H200 (``scripts/bench_current_cast.py``, docs/benchmarks.md): a plain tensor's
cast 1.27-1.31x faster; the experts' casts level with the two-launch cast on the GPU (within
1-5%), one launch fewer each, which the host-bound eager grouped step feels (0.90x host time).
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from typing import Any

import torch
import triton
import triton.language as tl

from ..triton_launch import Launcher, cdiv
from .tensor import aligned_scalars
from .triton_cast import SCALE_STRIDE, TILE, _fp8_consts, _load_transposed, _quantize, _tensor_scale, cast_warps


@triton.jit
def _segment_at(row, seg_ptr, n_seg):
    """Index of the segment holding ``row`` (``offsets[e] <= row < offsets[e + 1]``)."""
    e = 0
    for j in range(1, n_seg):
        e += (row >= tl.load(seg_ptr + j)).to(tl.int32)
    return e


@triton.jit
def _current_persistent_kernel(
    x_ptr, row_ptr, col_ptr, scale_ptr, inv_ptr, seg_ptr, sync_ptr, M, K, n_kb, n_seg, chunk,
    DO_ROW: tl.constexpr, DO_COL: tl.constexpr, SEG: tl.constexpr, FMAX: tl.constexpr, OUT: tl.constexpr,
    T: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr, BE: tl.constexpr,
):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    ar = tl.arange(0, T)
    n_tiles = tl.cdiv(M, T) * n_kb
    lo = pid.to(tl.int64) * chunk  # this program's tiles: [lo, hi), row-major (k fastest)
    hi = tl.minimum(lo + chunk, n_tiles)
    amax_ptr = sync_ptr + 4  # sync words: arrivals, departures, 2 spare, then one amax per segment
    # 1. amax of this program's tiles, per segment (folded in when the tiles leave a segment)
    e = 0
    end = tl.zeros((), dtype=tl.int64) + M
    if SEG:  # segments are whole row tiles (multiples of T rows)
        e = _segment_at((lo // n_kb) * T, seg_ptr, n_seg)
        end = tl.load(seg_ptr + e + 1)
    acc = tl.zeros((), dtype=tl.int32)
    for t in range(lo, hi):
        rows = (t // n_kb) * T + ar
        if SEG:
            while (t // n_kb) * T >= end:
                tl.atomic_max(amax_ptr + e, acc, sem="relaxed")
                acc = tl.zeros((), dtype=tl.int32)
                e += 1
                end = tl.load(seg_ptr + e + 1)
        offs_k = (t % n_kb) * T + ar
        mask = (rows[:, None] < M) & (offs_k[None, :] < K)
        v = tl.load(x_ptr + rows[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
        acc = tl.maximum(acc, tl.max(tl.max(v.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF,
                                            axis=1), axis=0))
    tl.atomic_max(amax_ptr + e, acc, sem="relaxed")
    # 2. every program's amaxes are in: the barrier
    tl.atomic_add(sync_ptr, 1, sem="release")
    while tl.atomic_add(sync_ptr, 0, sem="acquire") < n_prog:
        pass
    if pid == 0:  # publish every segment's scale and 1/scale
        for b in range(0, n_seg, BE):
            offs = b + tl.arange(0, BE)
            a = tl.load(amax_ptr + offs, mask=offs < n_seg, other=0, volatile=True).to(tl.float32, bitcast=True)
            s_all, inv_all = _tensor_scale(a, FMAX, EPS, 1.0, POW2)
            tl.store(scale_ptr + offs * SCALE_STRIDE, s_all, mask=offs < n_seg)
            tl.store(inv_ptr + offs * SCALE_STRIDE, inv_all, mask=offs < n_seg)
    # 3. the cast of the same tiles, last read first (still in L2)
    start = tl.zeros((), dtype=tl.int64)
    length = tl.zeros((), dtype=tl.int64) + M
    if SEG:
        start = tl.load(seg_ptr + e)
        length = end - start
    s, _ = _tensor_scale(tl.load(amax_ptr + e, volatile=True).to(tl.float32, bitcast=True), FMAX, EPS, 1.0, POW2)
    for i in range(0, hi - lo):
        t = hi - 1 - i
        rows = (t // n_kb) * T + ar
        if SEG:
            if (t // n_kb) * T < start:  # into an earlier segment (possibly past empty ones)
                while (t // n_kb) * T < start:
                    e -= 1
                    start = tl.load(seg_ptr + e)
                length = tl.load(seg_ptr + e + 1) - start
                s, _ = _tensor_scale(tl.load(amax_ptr + e, volatile=True).to(tl.float32, bitcast=True),
                                     FMAX, EPS, 1.0, POW2)
        offs_k = (t % n_kb) * T + ar
        mask = (rows[:, None] < M) & (offs_k[None, :] < K)
        if DO_ROW or not DO_COL:
            x = tl.load(x_ptr + rows[:, None] * K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        if DO_ROW:
            tl.store(row_ptr + rows[:, None] * K + offs_k[None, :], _quantize(x, s, FMAX, OUT), mask=mask)
        if DO_COL:
            if DO_ROW:  # the quantized tile transposed: [T(k), T(m)]
                q = tl.trans(_quantize(x, s, FMAX, OUT))
            else:  # column only: the tile loaded transposed
                q = _quantize(_load_transposed(x_ptr, rows, rows, offs_k, M, K), s, FMAX, OUT)
            # a segment's copy is [K, m_e] at offset K * start (the whole [K, M] without segments)
            dst = start * K + offs_k[:, None].to(tl.int64) * length + (rows[None, :] - start)
            tl.store(col_ptr + dst, q, mask=(offs_k[:, None] < K) & (rows[None, :] < M))
    # 4. the last program to leave clears the sync words for the next launch
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel") == n_prog - 1:
        for b in range(0, n_seg, BE):
            offs = b + tl.arange(0, BE)
            tl.store(amax_ptr + offs, tl.zeros([BE], dtype=tl.int32), mask=offs < n_seg)
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed")


_PERSISTENT = Launcher(_current_persistent_kernel)
ENABLED = os.environ.get("MEGATRON_FP8_ONE_LAUNCH_CAST", "1") != "0"  # off: the two-launch cast (A/B timing)
COOPERATIVE = os.environ.get("MEGATRON_FP8_COOPERATIVE", "1") != "0"  # a cooperative launch (see below)
PROGRAMS_PER_SM = int(os.environ.get("MEGATRON_FP8_PERSISTENT_PER_SM", "0"))  # 0: as many as fit (at most 2)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_sync: dict[tuple[int, int], torch.Tensor] = {}
_resident: dict[tuple[object, ...], int] = {}  # programs per SM that fit, per specialization
_sm_count: dict[int, int] = {}


def persistent_ok(x: torch.Tensor) -> bool:
    """Whether the one-launch cast serves ``x``: CUDA, not Triton's interpreter, ``ENABLED``
    (``MEGATRON_FP8_ONE_LAUNCH_CAST=0`` at import turns it off)."""
    return ENABLED and x.is_cuda and not _INTERPRET


def disable(error: BaseException) -> None:
    """Turn the one-launch cast off for this process, with one warning (``cast_current`` falls
    back to its two launches when this Triton cannot build or launch the persistent kernel)."""
    global ENABLED
    ENABLED = False
    warnings.warn(f"megatron_fp8: one-launch current-scaling cast unavailable ({type(error).__name__}: "
                  f"{str(error).splitlines()[0] if str(error) else ''}); using two launches", RuntimeWarning,
                  stacklevel=3)


def _sync_words(device: int, n_seg: int) -> torch.Tensor:
    """This stream's sync words (4, then one per segment), zero between launches; grown as needed."""
    key = (device, triton.runtime.driver.active.get_current_stream(device))
    buf = _sync.get(key)
    if buf is None or buf.numel() < 4 + n_seg:
        buf = torch.zeros((4 + max(n_seg, 60),), dtype=torch.int32, device=torch.device("cuda", device))
        _sync[key] = buf
    return buf


@functools.cache
def _libcuda() -> Any:
    return ctypes.CDLL("libcuda.so.1")


def _fits_per_sm(kernel: Any, num_warps: int) -> int:
    """Programs of a compiled kernel that one SM holds at once, from the driver
    (``cuOccupancyMaxActiveBlocksPerMultiprocessor``); 1 where that cannot be asked."""
    try:
        n = ctypes.c_int(0)
        rc = _libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), ctypes.c_void_p(int(kernel.function)), ctypes.c_int(32 * num_warps),
            ctypes.c_size_t(int(kernel.metadata.shared)))
        return n.value if rc == 0 and n.value > 0 else 1
    except (OSError, AttributeError, TypeError, ValueError):
        return 1


def cast_current_persistent(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool, *, power_2_scale: bool = False,
    amax_epsilon: float = 0.0, splits: list[int] | None = None, offsets: torch.Tensor | None = None,
    programs: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``triton_cast.cast_current`` in one launch, same outputs and bits (``splits``: positive
    multiples of 128 rows). ``programs``: the grid (default: as many as the GPU holds at once);
    Triton's interpreter runs a grid of one (its programs run one after another)."""
    x = x.contiguous()
    m, k = x.shape
    if not m or not k:
        raise ValueError(f"cast_current_persistent: x {tuple(x.shape)} is empty (the two-launch cast serves it)")
    n_kb = cdiv(k, TILE)
    n_seg = len(splits) if splits is not None else 1
    dev = x.device
    row = torch.empty((m, k), dtype=fp8_dtype, device=dev) if rowwise else None
    col = (torch.empty((k * m,) if splits is not None else (k, m), dtype=fp8_dtype, device=dev)
           if columnwise else None)
    scale, inv = aligned_scalars(n_seg, dev), aligned_scalars(n_seg, dev)
    fmax, _, _, out = _fp8_consts(fp8_dtype)
    warps = cast_warps("tensor", rowwise, columnwise)
    spec = (dev, x.dtype, fp8_dtype, rowwise, columnwise, splits is not None, warps, COOPERATIVE)
    fits = _resident.get(spec)
    n_tiles = cdiv(m, TILE) * n_kb
    if dev.type == "cuda":
        device = dev.index if dev.index is not None else torch.cuda.current_device()
        if device not in _sm_count:
            _sm_count[device] = torch.cuda.get_device_properties(device).multi_processor_count
        sync = _sync_words(device, n_seg)
        if programs is None:
            programs = _sm_count[device] * (1 if fits is None else min(fits, PROGRAMS_PER_SM or 2))
    else:  # Triton's interpreter
        sync, programs = torch.zeros((4 + n_seg,), dtype=torch.int32, device=dev), 1
    chunk = cdiv(n_tiles, programs)
    dummy = x
    args = (x, row if row is not None else dummy, col if col is not None else dummy, scale, inv,
            offsets if offsets is not None else dummy, sync, m, k, n_kb, n_seg)
    kw = dict(DO_ROW=rowwise, DO_COL=columnwise, SEG=splits is not None, FMAX=fmax, OUT=out, T=TILE,
              EPS=float(amax_epsilon), POW2=power_2_scale, BE=128, num_warps=warps,
              launch_cooperative_grid=COOPERATIVE)
    try:
        _PERSISTENT((cdiv(n_tiles, chunk),), *args, chunk, **kw)
    except RuntimeError as e:  # more programs than fit at once (the driver refused): one per SM
        if "cooperative" not in str(e) or fits is None or dev.type != "cuda":
            raise
        _resident[spec] = 1
        chunk = cdiv(n_tiles, _sm_count[device])
        _PERSISTENT((cdiv(n_tiles, chunk),), *args, chunk, **kw)
    if fits is None:  # first launch of this specialization (one program per SM): how many fit
        kept = _PERSISTENT.kept_last
        _resident[spec] = _fits_per_sm(kept.kernel, warps) if kept is not None else 1
    return row, col, scale, inv
