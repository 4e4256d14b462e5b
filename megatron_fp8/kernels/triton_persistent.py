"""Current scaling in one launch (CUDA): a persistent cast whose programs meet at one barrier.

``triton_cast.cast_current`` can take two launches: an amax pass, then a cast whose programs turn
the amax partials into the scale. Here one launch of two programs per SM does both. Each program
owns a contiguous run of the 128x128 tiles, row-major (runs differ by one tile at most), so a run
crosses at most a few segments (the experts; one segment for a plain tensor):

1. it reduces ``|x|`` over its tiles, per segment, and folds each segment's maximum into that
   segment's amax word (an integer ``atomic_max`` over FP32 bit patterns: for non-negative
   floats the integer order is the float order, and a NaN sorts above inf, as in
   ``triton_cast``);
2. it arrives at the barrier and waits for every program;
3. program 0 publishes every segment's ``(scale, 1/scale)`` (``triton_cast``'s arithmetic), and
   each program casts its tiles again, last read first, so the tail of what it read is still in
   L2.

The bits are ``cast_current``'s: an amax is a maximum (order-free), and scale and cast are the
same code (tests compare them with ``torch.equal`` at several grid sizes).

Sync words (arrivals, departures, one amax per segment): the last program to leave clears them,
after a CTA barrier so that none of its threads still reads an amax. In eager mode each stream
keeps its own (launches on one stream run in order, kernels on two may overlap); while a CUDA
graph is captured each launch gets new ones, zeroed by a node of the graph.

Residency: a barrier over programs that are not all resident at once never opens. Every variant
is built with at most 128 registers a thread at 8 warps (``maxnreg``, from the warp count; the
variants Triton specializes for unaligned shapes would otherwise take 255 and fit once per SM, and
spill with the cap) and uses at most 32 KB of shared memory, so two fit on an SM; and the launch
is cooperative: the driver refuses a grid that cannot be resident (fewer SMs to this process, as
under MPS) instead of starting it, and the device then drops to one program per SM. Triton's
interpreter runs programs one after another, so there a grid of several programs runs as two
launches of the same kernel (amax, then cast: ``PHASES``), which checks the partition and the
segment walks on CPU.

Measured on an H200 (``scripts/bench_current_cast.py``, docs/benchmarks.md, 2026-12-03, torch
2.11.0+cu130): a plain tensor's cast 1.27-1.30x faster than the two-launch cast, the experts'
casts 1.03-1.12x, small (launch-bound) casts 5x; its GPU tests and the whole GPU suite with it on
passed in the same call. On by default; ``MEGATRON_FP8_ONE_LAUNCH_CAST=0`` (read when this module
is first imported) turns it off, leaving the two-launch cast. A build or launch failure falls back
to two launches with one warning (``kernels._KernelGuard``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from ..quant.tensor import aligned_scalars
from .triton_launch import Launcher, Prepared, cdiv
from .triton_scale import SCALE_STRIDE, _tensor_scale
from .triton_tiles import (
    TILE,
    _fp8_consts,
    _load_transposed,
    _quantize,
    _segment_of_row,
    cast_warps,
    fp8_copies,
)


@triton.jit
def _tile(t, n_kb, M, K, T: tl.constexpr):
    """Tile ``t`` (row-major, k fastest): its rows, columns and in-bounds mask."""
    ar = tl.arange(0, T)
    rows = (t // n_kb) * T + ar
    offs_k = (t % n_kb) * T + ar
    return rows, offs_k, (rows[:, None] < M) & (offs_k[None, :] < K)


@triton.jit
def _tile_amax_bits(x_ptr, t, n_kb, M, K, T: tl.constexpr):
    """max |x| over tile ``t`` as FP32 bits."""
    rows, offs_k, mask = _tile(t, n_kb, M, K, T)
    v = tl.load(x_ptr + rows[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
    return tl.max(tl.max(v.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0)


@triton.jit
def _cast_tile(x_ptr, row_ptr, col_ptr, t, n_kb, M, K, s, start, length, DO_ROW: tl.constexpr,
               DO_COL: tl.constexpr, FMAX: tl.constexpr, OUT: tl.constexpr, T: tl.constexpr):
    """Tile ``t`` cast with ``s``: its rowwise tile, and its columnwise one into the copy of the
    segment at rows ``[start, start + length)`` (the whole ``[K, M]`` without segments)."""
    rows, offs_k, mask = _tile(t, n_kb, M, K, T)
    if DO_ROW:
        x = tl.load(x_ptr + rows[:, None] * K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(row_ptr + rows[:, None] * K + offs_k[None, :], _quantize(x, s, FMAX, OUT), mask=mask)
    if DO_COL:
        if DO_ROW:  # the quantized tile transposed: [T(k), T(m)]
            q = tl.trans(_quantize(x, s, FMAX, OUT))
        else:  # column only: the tile loaded transposed
            q = _quantize(_load_transposed(x_ptr, rows, rows, offs_k, M, K), s, FMAX, OUT)
        # a segment's copy is [K, m_e] at offset K * start (the whole [K, M] without segments)
        dst = tl.multiple_of(start * K, T) + offs_k[:, None].to(tl.int64) * length + (rows[None, :] - start)
        tl.store(col_ptr + dst, q, mask=(offs_k[:, None] < K) & (rows[None, :] < M))


@triton.jit
def _segment_scale(amax_ptr, e, FMAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr):
    """Segment ``e``'s ``(scale, 1/scale)`` from its published amax word."""
    return _tensor_scale(tl.load(amax_ptr + e, volatile=True).to(tl.float32, bitcast=True), FMAX, EPS, 1.0, POW2)


@triton.jit
def _current_persistent_kernel(
    x_ptr, row_ptr, col_ptr, scale_ptr, inv_ptr, seg_ptr, sync_ptr, M, K, n_kb, n_seg,
    DO_ROW: tl.constexpr, DO_COL: tl.constexpr, SEG: tl.constexpr, FMAX: tl.constexpr, OUT: tl.constexpr,
    T: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr, BE: tl.constexpr, PHASES: tl.constexpr,
):
    """``PHASES`` 0: the whole cast, with the barrier; 1 / 2: only the amax / only the cast, as two
    launches of the same grid (for Triton's interpreter, which cannot run a barrier)."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    amax_ptr = sync_ptr + 4  # sync words: arrivals, departures, 2 unused, then one amax per segment
    n_tiles = tl.cdiv(M, T).to(tl.int64) * n_kb
    lo = pid * n_tiles // n_prog  # this program's tiles: [lo, hi), row-major (k fastest), never empty
    hi = (pid + 1) * n_tiles // n_prog
    if PHASES != 2:
        # 1. amax of this program's tiles, per segment (folded in when the tiles leave a segment)
        e = 0
        end = tl.zeros((), dtype=tl.int64) + M
        if SEG:  # segments are whole row tiles (multiples of T rows)
            e = _segment_of_row((lo // n_kb) * T, seg_ptr, n_seg)
            end = tl.load(seg_ptr + e + 1)
        acc = tl.zeros((), dtype=tl.int32)
        for t in range(lo, hi):
            if SEG:
                while (t // n_kb) * T >= end:
                    tl.atomic_max(amax_ptr + e, acc, sem="relaxed")
                    acc = tl.zeros((), dtype=tl.int32)
                    e += 1
                    end = tl.load(seg_ptr + e + 1)
            acc = tl.maximum(acc, _tile_amax_bits(x_ptr, t, n_kb, M, K, T))
        tl.atomic_max(amax_ptr + e, acc, sem="relaxed")
    if PHASES == 0:
        # 2. every program's amaxes are in: the barrier
        tl.atomic_add(sync_ptr, 1, sem="release")
        while tl.atomic_add(sync_ptr, 0, sem="acquire") < n_prog:
            pass
    if PHASES != 1:
        if pid == 0:  # publish every segment's scale and 1/scale
            for b in range(0, n_seg, BE):
                offs = b + tl.arange(0, BE)
                a = tl.load(amax_ptr + offs, mask=offs < n_seg, other=0, volatile=True).to(tl.float32, bitcast=True)
                s_all, inv_all = _tensor_scale(a, FMAX, EPS, 1.0, POW2)
                tl.store(scale_ptr + offs * SCALE_STRIDE, s_all, mask=offs < n_seg)
                tl.store(inv_ptr + offs * SCALE_STRIDE, inv_all, mask=offs < n_seg)
        # 3. the cast of the same tiles, last read first (still in L2)
        e = 0
        start = tl.zeros((), dtype=tl.int64)
        length = tl.zeros((), dtype=tl.int64) + M
        if SEG:  # the hints keep the column copy's stores 16 bytes wide
            e = _segment_of_row(((hi - 1) // n_kb) * T, seg_ptr, n_seg)
            start = tl.multiple_of(tl.load(seg_ptr + e), T)
            length = tl.multiple_of(tl.load(seg_ptr + e + 1) - start, T)
        s, _ = _segment_scale(amax_ptr, e, FMAX, EPS, POW2)
        for i in range(0, hi - lo):
            t = hi - 1 - i
            if SEG:
                if (t // n_kb) * T < start:  # into an earlier segment (possibly past empty ones)
                    while (t // n_kb) * T < start:
                        e -= 1
                        start = tl.multiple_of(tl.load(seg_ptr + e), T)
                    length = tl.multiple_of(tl.load(seg_ptr + e + 1) - start, T)
                    s, _ = _segment_scale(amax_ptr, e, FMAX, EPS, POW2)
            _cast_tile(x_ptr, row_ptr, col_ptr, t, n_kb, M, K, s, start, length, DO_ROW, DO_COL, FMAX, OUT, T)
        # 4. the last program to leave clears the sync words for the next launch; the CTA barrier
        # first, so that none of this program's threads still reads an amax word
        tl.debug_barrier()
        if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel") == n_prog - 1:
            for b in range(0, n_seg, BE):
                offs = b + tl.arange(0, BE)
                tl.store(amax_ptr + offs, tl.zeros([BE], dtype=tl.int32), mask=offs < n_seg)
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed")


_PERSISTENT = Launcher(_current_persistent_kernel)


def enabled_from_env() -> bool:
    """``MEGATRON_FP8_ONE_LAUNCH_CAST``: ``1`` (the default) or ``0`` (the two-launch cast serves
    every tensor); anything else raises, when this module is first imported (the first
    current-scaling cast on CUDA), rather than guessing. Where the Triton casts do not run (CPU,
    ``MEGATRON_FP8_CAST_BACKEND=compile|eager``) the variable is not read."""
    v = os.environ.get("MEGATRON_FP8_ONE_LAUNCH_CAST", "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"MEGATRON_FP8_ONE_LAUNCH_CAST={v!r}; allowed: '1' (one-launch current-scaling "
                         f"casts, the default) or '0' (two launches each)")
    return v == "1"


ENABLED = enabled_from_env()  # read once, when the first current-scaling cast on CUDA imports this module
# Programs per SM. Every variant is built with a register cap that fits this many (``_register_cap``)
# and uses at most 32 KB of shared memory; the driver still checks (a cooperative launch), and a
# refusal (fewer SMs to this process, as under MPS) drops the device, for that warp count, to one.
PROGRAMS_PER_SM = 2
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_sync: dict[tuple[int, int], torch.Tensor] = {}
_per_sm: dict[tuple[int, int], int] = {}  # (device, warps) where PROGRAMS_PER_SM per SM was refused
_sm_count: dict[int, int] = {}
_PREPARED_KEPT = 64
_prepared: dict[tuple[Any, ...], Prepared] = {}  # cast_current_persistent's launches, by signature


def _register_cap(warps: int) -> dict[str, int]:
    """``maxnreg`` so that ``PROGRAMS_PER_SM`` programs of ``warps`` warps fit an SM's 64K
    registers (none where 255, the most a thread can have, already fits)."""
    cap = 65536 // (PROGRAMS_PER_SM * 32 * warps) // 8 * 8
    return {"maxnreg": cap} if cap < 255 else {}


def persistent_ok(x: torch.Tensor) -> bool:
    """Whether the one-launch cast serves ``x``: CUDA, not Triton's interpreter, ``ENABLED``
    (on unless ``MEGATRON_FP8_ONE_LAUNCH_CAST=0`` at import)."""
    return ENABLED and x.is_cuda and not _INTERPRET


def _sync_words(device: int, n_seg: int) -> torch.Tensor:
    """Zeroed sync words (4, then one per segment). In eager mode this stream's own, kept: the
    kernel leaves them zero, and launches on one stream run one after another. While a CUDA graph
    is captured, a new buffer per launch: its zeroing is a node of the graph, so every replay
    starts from zero and no two graphs (captured on one stream, replayed on any) share words."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros((4 + n_seg,), dtype=torch.int32, device=torch.device("cuda", device))
    key = (device, triton.runtime.driver.active.get_current_stream(device))
    buf = _sync.get(key)
    if buf is None or buf.numel() < 4 + n_seg:  # a replaced buffer is freed in stream order: safe
        buf = torch.zeros((4 + max(n_seg, 252),), dtype=torch.int32, device=torch.device("cuda", device))
        _sync[key] = buf
    return buf


def launch_options(fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool, *, segmented: bool,
                   power_2_scale: bool, amax_epsilon: float) -> dict[str, Any]:
    """The cast's constexprs and warp count (``PHASES`` and the CUDA launch options apart)."""
    fmax, _, _, out = _fp8_consts(fp8_dtype)
    return dict(DO_ROW=rowwise, DO_COL=columnwise, SEG=segmented, FMAX=fmax, OUT=out, T=TILE, EPS=float(amax_epsilon),
                POW2=power_2_scale, BE=128, num_warps=cast_warps("tensor", rowwise, columnwise))


def cuda_programs(device: int, warps: int) -> int:
    """The default grid on CUDA ``device``: ``PROGRAMS_PER_SM`` programs of ``warps`` warps per SM
    (one where the driver refused that many, ``_per_sm``)."""
    if device not in _sm_count:
        _sm_count[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sm_count[device] * _per_sm.get((device, warps), PROGRAMS_PER_SM)


def cast_current_persistent(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool, *, power_2_scale: bool = False,
    amax_epsilon: float = 0.0, splits: list[int] | None = None, offsets: torch.Tensor | None = None,
    programs: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``triton_cast.cast_current`` in one launch, same outputs and bits (``splits``: positive
    multiples of 128 rows summing to the rows of ``x``; ``offsets``: their prefix sums on the
    device). ``programs``: at most this many programs (default: ``PROGRAMS_PER_SM`` per SM; one
    per 128x128 tile at most). Under Triton's interpreter, which runs programs one after another,
    more than one program run as two launches (amax, then cast), without the barrier."""
    x = x.contiguous()
    m, k = x.shape
    if not m or not k:
        raise ValueError(f"cast_current_persistent: x {tuple(x.shape)} is empty (the two-launch cast serves it)")
    if splits is not None and (sum(splits) != m or any(s <= 0 or s % TILE for s in splits) or offsets is None
                               or offsets.shape != (len(splits) + 1,) or offsets.dtype != torch.int64
                               or offsets.device != x.device):
        raise ValueError(f"cast_current_persistent: splits {splits} must be positive multiples of {TILE} "
                         f"summing to the {m} rows of x, with their int64 prefix sums on x's device")
    if programs is not None and programs < 1:
        raise ValueError(f"cast_current_persistent: programs={programs}; give at least 1")
    n_kb = cdiv(k, TILE)
    n_seg = len(splits) if splits is not None else 1
    dev = x.device
    row, col = fp8_copies(x, fp8_dtype, rowwise, columnwise, splits is not None)
    scale, inv = aligned_scalars(n_seg, dev), aligned_scalars(n_seg, dev)
    warps = cast_warps("tensor", rowwise, columnwise)  # (launch_options' num_warps)
    n_tiles = cdiv(m, TILE) * n_kb
    dummy = x
    args = (x, row if row is not None else dummy, col if col is not None else dummy, scale, inv,
            offsets if offsets is not None else dummy)
    if dev.type != "cuda":  # Triton's interpreter
        kw = launch_options(fp8_dtype, rowwise, columnwise, segmented=splits is not None,
                            power_2_scale=power_2_scale, amax_epsilon=amax_epsilon)
        sync = torch.zeros((4 + n_seg,), dtype=torch.int32, device=dev)
        grid = min(programs or 1, n_tiles)
        for phases in ((0,) if grid == 1 else (1, 2)):
            _PERSISTENT((grid,), *args, sync, m, k, n_kb, n_seg, **kw, PHASES=phases)
        return row, col, scale, inv
    device = torch.cuda.current_device()  # where the launcher launches
    sync = _sync_words(device, n_seg)
    default = programs is None
    if default:
        programs = cuda_programs(device, warps)
    grid = (min(programs, n_tiles),)
    # the launch prepared per signature (the kernel's ints and constexprs, the grid; fresh outputs and
    # an aligned x share the specialization): ~10 us less host time than a keyed launch
    # (fresh outputs: 16-byte aligned, as the caching allocator hands out every block)
    key = (device, grid, m, k, n_seg, x.dtype, fp8_dtype, rowwise, columnwise, splits is not None, offsets is None,
           power_2_scale, amax_epsilon)
    aligned = x.data_ptr() % 16 == 0 and (offsets is None or offsets.data_ptr() % 16 == 0)
    launch = _prepared.get(key) if aligned else None
    if launch is not None:
        try:
            launch(*args, sync)
            return row, col, scale, inv
        except RuntimeError as e:  # a grid refused now (the driver's answer can change): the keyed launch
            if "cooperative" not in str(e):
                raise
            _prepared.pop(key, None)
    kw = launch_options(fp8_dtype, rowwise, columnwise, segmented=splits is not None, power_2_scale=power_2_scale,
                        amax_epsilon=amax_epsilon)
    kw.update(PHASES=0, launch_cooperative_grid=True, **_register_cap(warps))
    try:
        launch = _PERSISTENT.prepare(grid, 7, *args, sync, m, k, n_kb, n_seg, **kw)
    except RuntimeError as e:  # the driver refused a grid this large (fewer SMs to this process): one per SM
        if not (default and "cooperative" in str(e) and _per_sm.get((device, warps)) != 1):
            raise
        _per_sm[(device, warps)] = 1
        _PERSISTENT((min(_sm_count[device], n_tiles),), *args, sync, m, k, n_kb, n_seg, **kw)
        return row, col, scale, inv
    if launch is not None and aligned:
        while len(_prepared) >= _PREPARED_KEPT:  # router splits: a few row counts a step
            _prepared.pop(next(iter(_prepared)))
        _prepared[key] = launch
    return row, col, scale, inv
