"""Fused FP8 cast kernels (Triton, CUDA only): one read of the input writes the rowwise copy,
the transposed columnwise copy and their scales.

One program owns a 128x128 tile of ``x [M, K]``:

=============  =====================================  ======================================
mode           rowwise copy ``[M, K]``                columnwise copy ``[K, M]`` (transposed)
=============  =====================================  ======================================
``1x128``      scale per row of the tile (1x128)      scale per column of the tile (128x1)
``128x128``    one scale for the tile                 the same scale (the tile transposed)
``tensor``     the given per-tensor scale             the same scale
=============  =====================================  ======================================

The arithmetic is the reference's (``reference.py``), bit for bit: power-of-two scales come from
the exponent and mantissa bits of the amax (no division), values are multiplied by the scale,
clamped to +-FP8_MAX with NaN kept, and rounded to nearest-even by the FP8 conversion. The GPU
tests compare every output with the CPU reference with ``torch.equal``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import fp8_max

TILE = 128
_MODES = {"1x128": 0, "128x128": 1, "tensor": 2}


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


@triton.jit
def _quantize(v, scale, FMAX: tl.constexpr, OUT: tl.constexpr):
    v = v * scale
    v = tl.minimum(tl.maximum(v, -FMAX, propagate_nan=tl.PropagateNan.ALL), FMAX,
                   propagate_nan=tl.PropagateNan.ALL)
    return v.to(OUT)


@triton.jit
def _cast_tile_kernel(
    x_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, tensor_scale_ptr,
    M, K, n_kb, n_mb,
    MODE: tl.constexpr, DO_ROW: tl.constexpr, DO_COL: tl.constexpr,
    FMAX: tl.constexpr, F_EXP: tl.constexpr, F_MANT: tl.constexpr, OUT: tl.constexpr,
    T: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * T + tl.arange(0, T)
    offs_k = pid_k * T + tl.arange(0, T)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    a = tl.abs(x)
    if MODE == 2:
        s_all = tl.load(tensor_scale_ptr)
    elif MODE == 1:
        s_all, inv_all = _pow2_scale(tl.max(tl.max(a, axis=1), axis=0), F_EXP, F_MANT)
        tl.store(row_s_ptr + pid_m * n_kb + pid_k, inv_all)
    if DO_ROW:
        if MODE == 0:
            s_r, inv_r = _pow2_scale(tl.max(a, axis=1), F_EXP, F_MANT)  # [T]: one per row
            tl.store(row_s_ptr + offs_m.to(tl.int64) * n_kb + pid_k, inv_r, mask=offs_m < M)
            q = _quantize(x, s_r[:, None], FMAX, OUT)
        else:
            q = _quantize(x, s_all, FMAX, OUT)
        tl.store(row_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], q, mask=mask)
    if DO_COL:
        if MODE == 0:
            s_c, inv_c = _pow2_scale(tl.max(a, axis=0), F_EXP, F_MANT)  # [T]: one per column
            tl.store(col_s_ptr + offs_k.to(tl.int64) * n_mb + pid_m, inv_c, mask=offs_k < K)
            q = _quantize(x, s_c[None, :], FMAX, OUT)
        else:
            q = _quantize(x, s_all, FMAX, OUT)
        tl.store(col_ptr + offs_k[None, :].to(tl.int64) * M + offs_m[:, None], q, mask=mask)


def _fp8_consts(dtype: torch.dtype) -> tuple[float, int, int, tl.dtype]:
    fmax = fp8_max(dtype)
    mant, exp = torch.frexp(torch.tensor(fmax, dtype=torch.float32))  # fmax = mant * 2**exp
    bits = int((mant * 2).view(torch.int32)) & 0x7FFFFF
    out = tl.float8e4nv if dtype == torch.float8_e4m3fn else tl.float8e5
    return fmax, int(exp) - 1, bits, out


def cast_tiles(
    x: torch.Tensor, fp8_dtype: torch.dtype, mode: str, rowwise: bool, columnwise: bool,
    tensor_scale: torch.Tensor | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor | None] | None, tuple[torch.Tensor, torch.Tensor | None] | None]:
    """Cast ``x [M, K]`` (contiguous, CUDA). Returns ``(row, col)``, each ``(data, scale_inv)``
    or None; ``scale_inv`` is None in ``tensor`` mode (the caller holds the scale)."""
    m, k = x.shape
    x = x.contiguous()
    rowwise = rowwise or mode == "128x128"  # the 2-D block scales come with the rowwise pass
    n_mb, n_kb = triton.cdiv(m, TILE), triton.cdiv(k, TILE)
    row = torch.empty((m, k), dtype=fp8_dtype, device=x.device) if rowwise else None
    col = torch.empty((k, m), dtype=fp8_dtype, device=x.device) if columnwise else None
    row_s = col_s = None
    if mode == "1x128":
        row_s = torch.empty((m, n_kb), dtype=torch.float32, device=x.device) if rowwise else None
        col_s = torch.empty((k, n_mb), dtype=torch.float32, device=x.device) if columnwise else None
    elif mode == "128x128":
        row_s = torch.empty((n_mb, n_kb), dtype=torch.float32, device=x.device)
    fmax, f_exp, f_mant, out = _fp8_consts(fp8_dtype)
    dummy = x  # placeholder pointer for absent outputs
    _cast_tile_kernel[(n_mb, n_kb)](
        x, row if row is not None else dummy, row_s if row_s is not None else dummy,
        col if col is not None else dummy, col_s if col_s is not None else dummy,
        tensor_scale if tensor_scale is not None else dummy,
        m, k, n_kb, n_mb,
        MODE=_MODES[mode], DO_ROW=rowwise, DO_COL=columnwise,
        FMAX=fmax, F_EXP=f_exp, F_MANT=f_mant, OUT=out, T=TILE, num_warps=8,
    )
    if mode == "128x128":
        return (row, row_s), ((col, row_s.t().contiguous()) if columnwise else None)
    return ((row, row_s) if rowwise else None), ((col, col_s) if columnwise else None)
