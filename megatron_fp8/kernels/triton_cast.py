"""Fused FP8 cast kernels (Triton, CUDA only): one launch writes the rowwise copy, the
transposed columnwise copy and their scales (a tile read from DRAM once; where measured faster,
the columnwise copy quantizes the tile re-read transposed from L2); per-tensor amaxes and scales
without a round trip through small eager kernels.

One program of the cast kernel owns a 128x128 tile of ``x [M, K]``:

=============  =====================================  ======================================
mode           rowwise copy ``[M, K]``                columnwise copy ``[K, M]`` (transposed)
=============  =====================================  ======================================
``1x128``      scale per row of the tile (1x128)      scale per column of the tile (128x1)
``128x128``    one scale for the tile                 the same scale (the tile transposed)
``tensor``     the given per-tensor scale             the same scale
=============  =====================================  ======================================

Row + column casts of BF16 tiles in every mode (tensor mode with its scales given) go to the
CUDA C kernel of ``cuda_cast`` (the tile loaded once; measured faster) where that serves; its
outputs are these kernels', bit for bit.

1x128 scales are written in the layout the SM90 block GEMM reads (the scaled dim outermost:
storage ``[K/128, M]`` viewed as ``[M, K/128]``), so the GEMM core copies nothing.

Segments (MoE experts): ``x`` holds ``E`` row groups back to back (``offsets [E+1]``). Then the
per-tensor scale is per segment, and each segment's columnwise copy ``[K, m_e]`` (and its
1x128 scales) is contiguous on its own, as a separate cast of that segment would give; one
launch casts every expert. Segmented block casts need every offset to be a multiple of 128 (a
block never spans two experts; 128x128 segments are the experts' weights stacked). When every
offset is (``ALIGNED``), a tile lies in one segment and its segment, scale and destination are
scalars; otherwise (tensor mode only) they are looked up per row, which costs store
bandwidth.

Per-tensor amaxes and scales (the partials the fused casts reduce, per-segment scales,
delayed-scaling steps) are ``triton_scale``'s.

Current scaling without a group reduction (``cast_current``) takes one launch by default (the
persistent cast of ``triton_persistent.py``), else two: the amax kernel leaves one partial per
program, and every cast program reduces its tensor's (or segment's) partials and computes the
scale itself; the first program of each segment publishes scale and 1/scale. Launches, not
bandwidth, bound the small casts (see ``triton_launch.Launcher``).

The arithmetic is the reference's (``reference.py``), bit for bit: power-of-two block scales
come from the exponent and mantissa bits of the amax of the block's finite values (no
division), values are multiplied by the scale, clamped to +-FP8_MAX, and rounded to
nearest-even by the FP8 conversion; NaN and +-inf inputs get the reference's non-finite bytes
(``triton_tiles._quantize``). The GPU tests compare every output with the CPU reference with
``torch.equal``. On the GPU the conversion (``cvt.rn.satfinite``) saturates finite values by
itself, so the explicit clamp is the same bits (``formats.cast_clamp``); the interpreter's
conversion (torch's, on the CPU) needs it.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ..quant.tensor import aligned_scalars
from . import cuda_cast, triton_persistent
from .triton_launch import Launcher, cdiv
from .triton_scale import _R, SCALE_STRIDE, _amax_of_partials, _amax_partials, _tensor_scale, amax_and_scale
from .triton_tiles import (  # noqa: F401  (TILE, cast_warps, fp8_copies: also this module's API)
    _SB,
    TILE,
    _bounds,
    _finite_abs,
    _fp8_consts,
    _load_transposed,
    _pow2_scale,
    _quantize,
    _segment_of,
    _segment_of_row,
    cast_warps,
    fp8_buffers,
    fp8_copies,
)

_MODES = cuda_cast.MODES  # the kernel's MODE constexpr, numbered as the CUDA kernel's

@triton.jit
def _cast_tile_kernel(
    x_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, tensor_scale_ptr, seg_ptr, src_ptr,
    part_ptr, inv_ptr, M, K, n_kb, n_mb, n_seg, n_part, S_PART,
    MODE: tl.constexpr, DO_ROW: tl.constexpr, DO_COL: tl.constexpr, SEG: tl.constexpr,
    ALIGNED: tl.constexpr, FMAX: tl.constexpr, F_EXP: tl.constexpr, F_MANT: tl.constexpr, OUT: tl.constexpr,
    T: tl.constexpr, FUSED: tl.constexpr, R_AMAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
    BP: tl.constexpr, GATHER: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * T + tl.arange(0, T)
    offs_k = pid_k * T + tl.arange(0, T)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    if GATHER:  # (ALIGNED segments, scales not computed here) experts padded to T rows, held unpadded:
        # src_ptr holds the real counts' offsets; a row past its expert's real count reads as zero
        g_eid = _segment_of_row(pid_m.to(tl.int64) * T, seg_ptr, n_seg)
        g_from = tl.load(src_ptr + g_eid)
        g_local = offs_m.to(tl.int64) - tl.load(seg_ptr + g_eid)  # the rows within their expert
        g_real = tl.load(src_ptr + g_eid + 1) - g_from
        g_rows = g_from + g_local
        x = tl.load(x_ptr + g_rows[:, None] * K + offs_k[None, :],
                    mask=(g_local[:, None] < g_real) & (offs_k[None, :] < K), other=0.0)
    else:
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    a = _finite_abs(x)  # block amaxes: finite values only
    rows64 = offs_m.to(tl.int64)
    if SEG:  # each row's segment: its start and length (a separate cast's [K, m_e] layout)
        if ALIGNED:  # every segment a multiple of T rows: one segment per tile, scalars
            eid = _segment_of_row(pid_m.to(tl.int64) * T, seg_ptr, n_seg)
            start = tl.multiple_of(tl.load(seg_ptr + eid), T)  # the hints keep the stores vectorized
            length = tl.multiple_of(tl.load(seg_ptr + eid + 1) - start, T)
        else:  # tensor mode only: a tile may span segments, so per row ([1, T] for the transposed store)
            eid = _segment_of(rows64, seg_ptr, n_seg)
            start = tl.load(seg_ptr + eid, mask=offs_m < M, other=0)[None, :]
            length = tl.load(seg_ptr + eid + 1, mask=offs_m < M, other=0)[None, :] - start
    if MODE == 2 and FUSED:  # current scaling: this tile's (segment's) amax from the partials
        if SEG:  # ALIGNED: the segment's amax programs are whole, back to back
            lo = (start // R_AMAX) * S_PART
            hi = ((start + length) // R_AMAX) * S_PART
        else:
            lo = 0
            hi = n_part
        s_all, inv_all = _tensor_scale(_amax_of_partials(part_ptr, lo, hi, BP), FMAX, EPS, 1.0, POW2)
        if SEG:
            first = (pid_k == 0) & (pid_m.to(tl.int64) * T == start)
            dst_e = eid * SCALE_STRIDE
        else:
            first = (pid_k == 0) & (pid_m == 0)
            dst_e = 0
        if first:  # one program per segment publishes the scale the GEMM and a later cast use
            tl.store(tensor_scale_ptr + dst_e, s_all)
            tl.store(inv_ptr + dst_e, inv_all)
    elif MODE == 2:
        if SEG and ALIGNED:
            s_all = tl.load(tensor_scale_ptr + eid * SCALE_STRIDE)
        elif SEG:
            s_all = tl.load(tensor_scale_ptr + eid * SCALE_STRIDE, mask=offs_m < M, other=1.0)[:, None]
        else:
            s_all = tl.load(tensor_scale_ptr)
    elif MODE == 1:
        s_all, inv_all = _pow2_scale(tl.max(tl.max(a, axis=1), axis=0), F_EXP, F_MANT)
        tl.store(row_s_ptr + pid_m * n_kb + pid_k, inv_all)
    if DO_ROW:
        if MODE == 0:
            s_r, inv_r = _pow2_scale(tl.max(a, axis=1), F_EXP, F_MANT)  # [T]: one per row
            # scale storage [K/128, m_e] per segment (scaled dim outermost)
            if SEG:
                dst_s = start * n_kb + pid_k * length + (rows64 - start)
            else:
                dst_s = pid_k * M + rows64
            tl.store(row_s_ptr + dst_s, inv_r, mask=offs_m < M)
            q = _quantize(x, s_r[:, None], FMAX, OUT)
        else:
            q = _quantize(x, s_all, FMAX, OUT)
        tl.store(row_ptr + rows64[:, None] * K + offs_k[None, :], q, mask=mask)
    if DO_COL:
        # The tile loaded again, transposed by its pointers (an L2 hit; the only load of a
        # column-only cast): [T(k), T(m)], the stored layout. Measured on an H200 against
        # quantizing x and transposing the FP8 tile (16384x4096 bf16, same bits): 1x128 column
        # only 63 vs 87 us, row + column 112 vs 118; tensor column only 54 vs 64, but row +
        # column 79-82 vs 75, so there the FP8 tile is transposed.
        if MODE == 0:
            if GATHER:
                xt = _load_transposed(x_ptr, g_rows, g_local, offs_k, g_real, K)
            else:
                xt = _load_transposed(x_ptr, rows64, offs_m, offs_k, M, K)
            s_c, inv_c = _pow2_scale(tl.max(_finite_abs(xt), axis=1), F_EXP, F_MANT)  # [T]: one per column
            # scale storage [M/128, K]: a segment's blocks are its own rows of it
            tl.store(col_s_ptr + pid_m.to(tl.int64) * K + offs_k, inv_c, mask=offs_k < K)
            q = _quantize(xt, s_c[:, None], FMAX, OUT)
        elif MODE == 2 and not DO_ROW and GATHER:  # a scalar scale, column only, padded experts
            q = _quantize(_load_transposed(x_ptr, g_rows, g_local, offs_k, g_real, K), s_all, FMAX, OUT)
        elif MODE == 2 and not DO_ROW and (ALIGNED or not SEG):  # a scalar scale, column only
            q = _quantize(_load_transposed(x_ptr, rows64, offs_m, offs_k, M, K), s_all, FMAX, OUT)
        else:
            q = tl.trans(_quantize(x, s_all, FMAX, OUT))  # [T(k), T(m)], stored row-major into the [K, m] copy
        if SEG:  # segment e's copy is [K, m_e] at offset K * start_e
            dst = start * K + offs_k[:, None].to(tl.int64) * length + (rows64[None, :] - start)
        else:
            dst = offs_k[:, None].to(tl.int64) * M + rows64[None, :]
        tl.store(col_ptr + dst, q, mask=(offs_k[:, None] < K) & (offs_m[None, :] < M))


# ---- launching ----------------------------------------------------------------------------
Copy = tuple[torch.Tensor, torch.Tensor | None]
Raw = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
_CAST = Launcher(_cast_tile_kernel)


def cast_tiles(
    x: torch.Tensor, fp8_dtype: torch.dtype, mode: str, rowwise: bool, columnwise: bool,
    tensor_scale: torch.Tensor | None = None,
) -> tuple[Copy | None, Copy | None]:
    """Cast ``x [M, K]`` (contiguous, CUDA). Returns ``(row, col)``, each ``(data, scale_inv)``
    or None; ``scale_inv`` is None in ``tensor`` mode (the caller holds the scale)."""
    m, k = x.shape
    rowwise = rowwise or mode == "128x128"  # the 2-D block scales come with the rowwise pass
    row, row_s, col, col_s = _launch(x.contiguous(), fp8_dtype, mode, rowwise, columnwise, tensor_scale, None, 1)
    if mode == "128x128":
        col_s = col_s.view(cdiv(k, TILE), cdiv(m, TILE)) if col_s is not None else row_s.t().contiguous()
        return (row, row_s), ((col, col_s) if columnwise else None)
    if mode == "1x128":
        row_s = row_s.view(cdiv(k, TILE), m).t() if row_s is not None else None  # [M, K/128], M-major
        col_s = col_s.t() if col_s is not None else None  # [K, M/128], K-major
    return ((row, row_s) if rowwise else None), ((col, col_s) if columnwise else None)


def cast_segments(
    x: torch.Tensor, offsets: torch.Tensor, splits: list[int], fp8_dtype: torch.dtype, mode: str,
    rowwise: bool, columnwise: bool, tensor_scale: torch.Tensor | None = None,
) -> Raw:
    """Cast each row segment of ``x`` (``splits``; ``offsets`` their device prefix sums) as a
    separate ``cast_tiles`` of it would, in one launch: the raw buffers ``(row, row_s, col,
    col_s)`` that ``quant.tensor.Pack`` views per segment (None where not asked for). ``tensor``
    mode: ``tensor_scale [E]`` per segment, no scale buffers; ``1x128`` and ``128x128``: every
    split a multiple of 128 (no block spans two segments; the experts' weights stacked, for
    ``128x128``, whose columnwise scales are every segment's transposed blocks ``[E, K/128,
    m/128]`` for equal splits, else None: the rowwise ones serve)."""
    aligned = all(s % TILE == 0 for s in splits)
    if mode != "tensor" and not aligned:
        raise ValueError(f"cast_segments: {mode} segments must be multiples of {TILE} rows, got {splits}")
    rowwise_out = rowwise
    rowwise = rowwise or mode == "128x128"  # the 2-D block scales come with the rowwise pass
    row, row_s, col, col_s = _launch(x.contiguous(), fp8_dtype, mode, rowwise, columnwise, tensor_scale, offsets,
                                     len(splits), aligned)
    if mode == "128x128" and columnwise and len(set(splits)) == 1:  # every transposed scale block in one buffer
        e, n_mb, n_kb = len(splits), splits[0] // TILE, cdiv(x.shape[1], TILE)
        col_s = (col_s.view(e, n_kb, n_mb) if col_s is not None  # the CUDA kernel wrote them
                 else row_s.view(e, n_mb, n_kb).transpose(1, 2).contiguous())
    elif mode == "128x128":
        col_s = None
    return (row, row_s, col, col_s) if rowwise_out else (None, row_s, col, col_s)


class _Fused:
    """Current scaling computed inside the cast: per-program amax partials ``part`` (``s``
    slices per row program), outputs ``inv`` (``1/scale``; the scale goes to ``tensor_scale``)."""

    def __init__(self, part: torch.Tensor, s: int, inv: torch.Tensor, eps: float, pow2: bool) -> None:
        self.part, self.s, self.inv, self.eps, self.pow2 = part, s, inv, eps, pow2


def _outputs(m: int, k: int, dev: torch.device, fp8_dtype: torch.dtype, mode: str, rowwise: bool, columnwise: bool,
             segmented: bool) -> Raw:
    """The raw buffers ``(row, row_s, col, col_s)`` a cast of ``[m, k]`` writes (``_launch``)."""
    n_mb, n_kb = cdiv(m, TILE), cdiv(k, TILE)
    row, col = fp8_buffers(m, k, dev, fp8_dtype, rowwise, columnwise, segmented)
    row_s = col_s = None
    if mode == "1x128":
        row_s = torch.empty((n_kb * m,), dtype=torch.float32, device=dev) if rowwise else None
        col_s = torch.empty((n_mb, k), dtype=torch.float32, device=dev) if columnwise else None
    elif mode == "128x128":
        row_s = torch.empty((n_mb, n_kb), dtype=torch.float32, device=dev)
    return row, row_s, col, col_s


def cast_segments_gathered(
    x: torch.Tensor, real_offsets: torch.Tensor, offsets: torch.Tensor, splits: list[int], fp8_dtype: torch.dtype,
    mode: str, tensor_scale: torch.Tensor | None = None, rowwise: bool = True, columnwise: bool = True,
) -> Raw | None:
    """``cast_segments`` (``1x128``, or ``tensor`` with the scales given) of experts zero-padded to
    ``splits`` (multiples of 128; ``offsets`` their prefix sums) that ``x`` holds unpadded
    (``real_offsets``: the real counts' prefix sums), without writing the padded tensor: the cast
    reads a row past its expert's real count as zeros (the CUDA tile cast's ``gather`` where it
    serves, both copies of BF16; else this module's kernel with ``GATHER``). Same raw buffers,
    same bits; None for a cast this does not cover (the caller pads)."""
    total = sum(splits)
    if mode not in ("1x128", "tensor") or (mode == "tensor" and tensor_scale is None) or not total \
            or any(s % TILE for s in splits) or not (rowwise or columnwise):
        return None
    return _launch(x.contiguous(), fp8_dtype, mode, rowwise, columnwise, tensor_scale, offsets, len(splits),
                   aligned=True, gather=(real_offsets, total))


def _launch(x: torch.Tensor, fp8_dtype: torch.dtype, mode: str, rowwise: bool, columnwise: bool,
            tensor_scale: torch.Tensor | None, offsets: torch.Tensor | None, n_seg: int, aligned: bool = False,
            fused: _Fused | None = None, gather: tuple[torch.Tensor, int] | None = None,
            ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Run the cast kernel; raw outputs ``(row, row_s, col, col_s)`` (flat where segmented).
    ``gather``: ``(real offsets, M)``, ``cast_segments_gathered``'s cast of ``M`` padded rows."""
    if gather is not None and (fused is not None or offsets is None or not aligned):
        raise ValueError("triton_cast._launch: a gathered cast takes aligned segments and given scales")
    m, k = x.shape if gather is None else (gather[1], x.shape[1])
    n_mb, n_kb = cdiv(m, TILE), cdiv(k, TILE)
    dev = x.device
    row, row_s, col, col_s = _outputs(m, k, dev, fp8_dtype, mode, rowwise, columnwise, offsets is not None)
    if cuda_cast.serves(x, fp8_dtype, mode, rowwise, columnwise, offsets is None or aligned,
                        scale_given=fused is None and tensor_scale is not None, gathered=gather is not None):
        if mode == "128x128":  # the CUDA kernel also writes the scales transposed (cuda_cast.cast)
            col_s = torch.empty((n_mb * n_kb,), dtype=torch.float32, device=dev)
        if cuda_cast.cast(x, fp8_dtype, mode, offsets, n_seg, row, row_s, col, col_s, tensor_scale, gather):
            return row, row_s, col, col_s  # the CUDA kernel's: each tile loaded once
        col_s = None if mode == "128x128" else col_s
    fmax, f_exp, f_mant, out = _fp8_consts(fp8_dtype)
    dummy = x  # placeholder pointer for absent outputs

    def ptr(t: torch.Tensor | None) -> torch.Tensor:
        return t if t is not None else dummy

    # every constexpr given (the launcher shortcut binds no defaults)
    extra: dict[str, object] = dict(FUSED=fused is not None, R_AMAX=_R, EPS=float(fused.eps) if fused else 0.0,
                                    POW2=fused.pow2 if fused else False, BP=1024, GATHER=gather is not None)
    _CAST((n_mb, n_kb),
        x, ptr(row), ptr(row_s), ptr(col), ptr(col_s), ptr(tensor_scale), ptr(offsets),
        gather[0] if gather is not None else dummy,
        fused.part if fused else dummy, fused.inv if fused else dummy, m, k, n_kb, n_mb, n_seg,
        fused.part.numel() if fused else 0, fused.s if fused else 1,
        MODE=_MODES[mode], DO_ROW=rowwise, DO_COL=columnwise, SEG=offsets is not None, ALIGNED=aligned,
        FMAX=fmax, F_EXP=f_exp, F_MANT=f_mant, OUT=out, T=TILE,
        num_warps=cast_warps(mode, rowwise, columnwise, offsets is None or aligned),
        **extra,
    )
    return row, row_s, col, col_s


def cast_current(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool, *, power_2_scale: bool = False,
    amax_epsilon: float = 0.0, splits: list[int] | None = None, offsets: torch.Tensor | None = None,
    one_launch: bool = False, scales_first: bool = False,
) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    """Current scaling: ``(row, col, scale, 1/scale)`` for a non-empty ``x [M, K]``; with
    ``splits`` (each a positive multiple of 128; ``offsets`` their prefix sums) per segment: the
    raw ``row [M, K]`` and flat ``col [K * M]`` that ``quant.tensor.Pack`` views per segment, and
    ``scale [E]`` / ``1/scale [E]``, 16 bytes apart. ``one_launch``: in one launch (the persistent
    cast of ``triton_persistent``; the caller decides, as ``kernels.cast_current`` does by
    ``one_launch_ok``); otherwise two: amax partials, then the cast, whose programs turn them into
    the scale. ``scales_first``: amax and scale launches, then the cast with the scales given,
    which the CUDA tile cast takes where it serves (``cuda_current_ok``)."""
    n_seg = len(splits) if splits is not None else 1
    if scales_first:
        x = x.contiguous()
        _, scale, inv = amax_and_scale(x, fp8_dtype, offsets=offsets, n_seg=n_seg, power_2_scale=power_2_scale,
                                       amax_epsilon=amax_epsilon)
        raw = _launch(x, fp8_dtype, "tensor", rowwise, columnwise, scale, offsets, n_seg, aligned=True)
        return raw[0], raw[2], scale, inv
    if one_launch and x.numel():
        return triton_persistent.cast_current_persistent(x, fp8_dtype, rowwise, columnwise, power_2_scale=power_2_scale,
                                                     amax_epsilon=amax_epsilon, splits=splits, offsets=offsets)
    x = x.contiguous()
    part, s = _amax_partials(x, per_program=True)
    scale, inv = aligned_scalars(n_seg, x.device), aligned_scalars(n_seg, x.device)
    fused = _Fused(part, s, inv, amax_epsilon, power_2_scale)
    raw = _launch(x, fp8_dtype, "tensor", rowwise, columnwise, scale, offsets, n_seg, aligned=splits is not None,
                  fused=fused)
    return raw[0], raw[2], scale, inv


def cuda_current_ok(x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool) -> bool:
    """Whether current scaling's cast of ``x`` (segments aligned to 128 rows, as
    ``kernels.cast_current_segments`` ensures) goes as amax, scale and the CUDA tile cast
    (``cast_current(..., scales_first=True)``; ``cuda_cast.current_enabled``). Where it does not
    only because no graph is being captured, the kernel is built now, for the captures to come."""
    if not (x.numel() > 0 and cuda_cast.serves(x, fp8_dtype, "tensor", rowwise, columnwise, aligned=True)):
        return False
    if cuda_cast.current_enabled():
        return True
    if cuda_cast.current_setting() == "capture":
        cuda_cast.prebuild("tensor", fp8_dtype, x.device)
    return False


def one_launch_ok(x: torch.Tensor) -> bool:
    """Whether the one-launch cast serves ``x`` here (``triton_persistent.persistent_ok``)."""
    return triton_persistent.persistent_ok(x)
