"""The pieces of the Triton cast kernels that ``triton_cast`` and ``triton_persistent`` share:
the 128x128 tile, quantization with the reference's rounding and non-finite bytes, block amaxes
over finite values, segment lookups, the transposed load, the FP8 format constants and the warps
per tile. (Kept apart so that neither cast module
imports the other.)"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..quant.formats import cast_clamp, fp8_max
from ..quant.reference import E5M2_NEG_INF_BITS, E5M2_POS_INF_BITS, FP8_NAN_BITS

TILE = 128
CAST_WARPS = 0  # warps per 128x128 cast tile; 0: cast_warps' rule (profile_casts.py --warps sweeps it)


@triton.jit
def _pow2_scale(amax, F_EXP: tl.constexpr, F_MANT: tl.constexpr):
    """``(scale, 1 / scale)``: the largest power of two <= FP8_MAX / amax (FP8_MAX =
    1.F_MANT * 2**F_EXP), from exponent bits; (1, 1) for a zero or non-finite amax; the scale is
    at most 2**127 (the reference clamps to the FP32 range before rounding down)."""
    bits = amax.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    mant = bits & 0x7FFFFF
    e = F_EXP - exp - tl.where(mant <= F_MANT, 0, 1)
    e = tl.maximum(tl.minimum(e, 127), -126)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv_bits = tl.where(e == 127, 1 << 22, (127 - e) << 23)  # 2**-127 is subnormal
    inv = inv_bits.to(tl.float32, bitcast=True)
    good = (amax > 0) & (amax < float("inf"))
    return tl.where(good, scale, 1.0), tl.where(good, inv, 1.0)


_CLAMP = tl.constexpr(cast_clamp())
_NAN_BITS = tl.constexpr(FP8_NAN_BITS)
_POS_INF, _NEG_INF = tl.constexpr(E5M2_POS_INF_BITS), tl.constexpr(E5M2_NEG_INF_BITS)


@triton.jit
def _finite_abs(v):
    """|v| where finite, else 0: block amaxes are taken over finite values (NaN < inf is false)."""
    a = tl.abs(v)
    return tl.where(a < float("inf"), a, 0.0)


@triton.jit
def _quantize(v, scale, FMAX: tl.constexpr, OUT: tl.constexpr):
    """``v * scale`` (FP32 ``v``) in FP8: a finite ``v`` saturates (by the clamp, or by the GPU's
    ``.satfinite`` conversion, which would also turn +-inf into +-FP8_MAX); a NaN or +-inf ``v``
    gets ``reference.nonfinite_bits``' byte (E4M3 NaN; E5M2 NaN or +-inf), chosen on ``v``'s bits."""
    q = v * scale
    if _CLAMP:
        q = tl.minimum(tl.maximum(q, -FMAX, propagate_nan=tl.PropagateNan.ALL), FMAX,
                       propagate_nan=tl.PropagateNan.ALL)
    bits = v.to(tl.int32, bitcast=True)
    special = (bits & 0x7F800000) == 0x7F800000
    if FMAX > 448.0:  # E5M2: +-inf stays +-inf, NaN is NaN
        inf_bits = tl.where(bits < 0, _NEG_INF, _POS_INF)
        nonfinite = tl.where((bits & 0x7FFFFF) == 0, inf_bits, _NAN_BITS)
    else:
        nonfinite = _NAN_BITS
    byte = tl.where(special, nonfinite, q.to(OUT).to(tl.uint8, bitcast=True).to(tl.int32))
    return byte.to(tl.uint8).to(OUT, bitcast=True)


# Segment lookups: the count of inner boundaries ``offsets[1:n_seg]`` at or below a row, read
# _SB boundaries per vector load. The lookup they replace loaded one boundary per loop step,
# which (read as one load latency per step) fits what it cost: eight experts'
# 128x128 weight cast (8 x 2048 x 4096) took 124 us with it and 85 us with these (the plain cast
# of the same tensor: 80 us), H200, scripts/probe_cast_variants.py --segments [--lookup old].
_SB = tl.constexpr(32)


@triton.jit
def _bounds(seg_ptr, base, n_seg):
    """``(offsets[base + 1 : base + 1 + _SB], mask)``: the next _SB inner boundaries (those of
    ``offsets[1:n_seg]``), masked past the last."""
    j = base + 1 + tl.arange(0, _SB)
    inner = j < n_seg
    return tl.load(seg_ptr + j, mask=inner, other=0), inner


@triton.jit
def _segment_of_row(row, seg_ptr, n_seg):
    """Segment index of one row (a scalar): ``offsets[e] <= row < offsets[e + 1]`` (the last of
    several equal offsets: empty segments are skipped)."""
    eid = tl.zeros_like(row)
    for base in range(0, n_seg, _SB):
        bound, inner = _bounds(seg_ptr, base, n_seg)
        eid += tl.sum(((row >= bound) & inner).to(row.dtype), axis=0)
    return eid


@triton.jit
def _segment_of(rows, seg_ptr, n_seg):
    """Segment index of each row of ``rows [T]`` (as ``_segment_of_row``)."""
    eid = tl.zeros_like(rows)
    for base in range(0, n_seg, _SB):
        bound, inner = _bounds(seg_ptr, base, n_seg)
        eid += tl.sum(((rows[:, None] >= bound[None, :]) & inner[None, :]).to(rows.dtype), axis=1)
    return eid


@triton.jit
def _load_transposed(x_ptr, rows64, offs_m, offs_k, M, K):
    """The tile ``x[offs_m, offs_k]`` as ``[T(k), T(m)]`` FP32 (the columnwise copy's layout)."""
    return tl.load(x_ptr + rows64[None, :] * K + offs_k[:, None],
                   mask=(offs_k[:, None] < K) & (offs_m[None, :] < M), other=0.0).to(tl.float32)


@functools.cache
def _fp8_consts(dtype: torch.dtype) -> tuple[float, int, int, tl.dtype]:
    fmax = fp8_max(dtype)
    mant, exp = torch.frexp(torch.tensor(fmax, dtype=torch.float32))  # fmax = mant * 2**exp
    bits = int((mant * 2).view(torch.int32)) & 0x7FFFFF
    out = tl.float8e4nv if dtype == torch.float8_e4m3fn else tl.float8e5
    return fmax, int(exp) - 1, bits, out


def cast_warps(mode: str, rowwise: bool, columnwise: bool, transposed_load: bool = True) -> int:
    """Warps per cast tile: 8, but 4 for the column-only casts (the flagged backward's cast of
    the saved input): 1x128 ran 278 vs 326 us with 4 in two sweeps on an H200 (docs), and with
    the transposed load 63 vs 73 us (1x128) and 54 vs 58 us (tensor) at 16384x4096; the other
    casts were as fast or faster with 8, or not consistently faster with 4. ``transposed_load``
    False: a tensor cast whose segments are not 128-row aligned, which transposes the FP8 tile
    (untimed with 4 warps, so 8)."""
    if CAST_WARPS:
        return CAST_WARPS
    column_only = columnwise and not rowwise
    return 4 if column_only and (mode == "1x128" or (mode == "tensor" and transposed_load)) else 8


def fp8_copies(x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool, segmented: bool
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The FP8 copies a cast of ``x [M, K]`` writes (``fp8_buffers``)."""
    return fp8_buffers(x.shape[0], x.shape[1], x.device, fp8_dtype, rowwise, columnwise, segmented)


def fp8_buffers(m: int, k: int, device: torch.device, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool,
                segmented: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The FP8 copies a cast of an ``[m, k]`` tensor writes (None where not asked for): rowwise
    ``[m, k]``; columnwise ``[k, m]``, or with segments flat ``[k * m]`` (segment e's ``[k, m_e]``
    at ``k * start_e``)."""
    row = torch.empty((m, k), dtype=fp8_dtype, device=device) if rowwise else None
    col = torch.empty((k * m,) if segmented else (k, m), dtype=fp8_dtype, device=device) if columnwise else None
    return row, col
