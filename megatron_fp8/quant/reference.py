"""Reference FP8 casts in plain PyTorch: the CPU path and the oracle for GPU kernels.

Every function is pure, runs under ``torch.no_grad()`` and works on any device. Conventions:

* ``scale`` multiplies the high-precision value into FP8 range; ``scale_inv = 1 / scale`` is what
  a GEMM multiplies back (what ``scaled_mm`` calls the scale).
* Casts compute ``x.float() * scale``, clamp to +-FP8_MAX (saturate) and round to nearest-even.
* Non-finite values surface, never vanish (RECIPES.md, "Non-finite values"): finite values
  saturate to +-FP8_MAX, but NaN stays NaN and +-inf becomes NaN in E4M3 (which has no inf) and
  +-inf in E5M2. Their bytes are fixed here (``nonfinite_bits``), not left to a conversion, so
  every kernel writes the same ones: E4M3 0x7F for NaN and +-inf; E5M2 0x7F for NaN, 0x7C / 0xFC
  for +inf / -inf.
* A non-finite amax never becomes a scale: a per-tensor amax propagates NaN and inf, and an
  amax of zero or a non-finite amax gives scale 1.0 (delayed scaling keeps its previous scale,
  ``tensor_scaling``); a block amax is taken over the block's finite values (1.0 if none).
* Power-of-two scales are rounded *down* (exact exponent arithmetic on the FP32 bits), so that
  ``amax * scale <= FP8_MAX`` and scaling is exact.
"""

from __future__ import annotations

import torch

from .formats import E8M0_BIAS, fp8_max

_F32_EXP_MASK = 0x7F800000


@torch.no_grad()
def round_down_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Largest power of two <= ``scale`` (positive, finite FP32), via the exponent bits."""
    bits = scale.float().view(torch.int32) & _F32_EXP_MASK
    # A subnormal or zero scale would give 0: never produced (scale >= FP8_MAX / FP32_MAX).
    return bits.view(torch.float32)


@torch.no_grad()
def amax_to_scale(
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    margin: int = 0,
    power_2_scale: bool = False,
    amax_epsilon: float = 0.0,
) -> torch.Tensor:
    """FP32 scale ``FP8_MAX / max(amax, eps) / 2**margin`` (computed in FP64, then rounded).

    Zero or non-finite amax -> 1.0. A scale above the FP32 range is clamped to FP32 max.
    """
    amax64 = amax.to(torch.float64)
    if amax_epsilon > 0.0:
        amax64 = torch.clamp(amax64, min=amax_epsilon)
    good = torch.isfinite(amax64) & (amax64 > 0)
    safe = torch.where(good, amax64, torch.ones_like(amax64))
    scale64 = (fp8_max(fp8_dtype) / safe) / float(2**margin)
    scale64 = torch.clamp(scale64, max=torch.finfo(torch.float32).max)
    scale = torch.where(good, scale64, torch.ones_like(scale64)).to(torch.float32)
    if power_2_scale:
        scale = round_down_pow2(scale)
    return scale


# The bytes of non-finite inputs: E4M3 has no inf, so NaN for all three; E5M2 keeps +-inf.
FP8_NAN_BITS = 0x7F
E5M2_POS_INF_BITS, E5M2_NEG_INF_BITS = 0x7C, 0xFC


def nonfinite_bits(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 byte (uint8) each element of ``x`` casts to where it is NaN or +-inf."""
    nan = torch.full((), FP8_NAN_BITS, dtype=torch.uint8, device=x.device)
    if fp8_dtype != torch.float8_e5m2:
        return nan
    inf = torch.where(x > 0, E5M2_POS_INF_BITS, E5M2_NEG_INF_BITS).to(torch.uint8)
    return torch.where(torch.isnan(x), nan, inf)


@torch.no_grad()
def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Cast of ``x * scale`` (``scale`` broadcastable to ``x``): a finite ``x`` saturates to
    +-FP8_MAX (also where ``x * scale`` overflows FP32); NaN and +-inf give ``nonfinite_bits``."""
    m = fp8_max(fp8_dtype)
    xf = x.float()
    q = torch.clamp(xf * scale, min=-m, max=m).to(fp8_dtype).view(torch.uint8)
    return torch.where(torch.isfinite(xf), q, nonfinite_bits(xf, fp8_dtype)).view(fp8_dtype)


def check_block_shape(shape: tuple[int, ...], block: int, what: str, along: str = "", dim: int = 1) -> None:
    """Raise unless ``shape`` is 2-D with its blocked extent (dim ``dim``, the contraction: the
    last by default) divisible by ``block``. ``along``: what that extent is for the user (e.g.
    "its tokens (rows)"), named in the error."""
    if len(shape) != 2:
        raise ValueError(f"{what}: expected a 2-D tensor, got shape {tuple(shape)}")
    if shape[dim] % block:
        name = along or "the contraction (last) dim"
        raise ValueError(
            f"{what}: {name} of shape {tuple(shape)} is {shape[dim]}, which must be a multiple of the block size "
            f"{block} for 1x{block} block scales; pad it to a multiple of {block}, or use current (tensorwise) "
            f"scaling, which takes any size"
        )


def block_amax(xb: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    """FP32 max |x| over ``dim`` of the finite values, NaN and +-inf left out (a block with none
    gives 0, hence scale 1.0)."""
    a = xb.abs()
    return torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device)).amax(dim=dim).float()


def _blocked_rows(x: torch.Tensor, block: int, what: str) -> torch.Tensor:
    """View ``[rows, k]`` as ``[rows, k // block, block]``, or raise naming the requirement."""
    check_block_shape(tuple(x.shape), block, what)
    return x.reshape(x.shape[0], x.shape[1] // block, block)


@torch.no_grad()
def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an FP32 scalar (NaN if x holds NaN; 0 for an empty tensor). One pass over x
    (an infinity-norm reduction), no |x| temporary; a max is exact whatever the order."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.linalg.vector_norm(x, ord=float("inf")).float()


@torch.no_grad()
def cast_blocks_1d(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    block: int = 128,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    what: str = "tensor",
) -> tuple[torch.Tensor, torch.Tensor]:
    """1 x ``block`` tiles along the last dim of ``x [rows, k]``.

    Returns ``(data [rows, k], scale_inv [rows, k // block])`` (FP32 scale_inv).
    """
    xb = _blocked_rows(x, block, what)
    amax = block_amax(xb, -1)
    scale = amax_to_scale(amax, fp8_dtype, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon)
    data = cast_to_fp8(xb, scale.unsqueeze(-1), fp8_dtype).reshape(x.shape)
    return data, torch.reciprocal(scale)


def check_block_shape_2d(shape: tuple[int, ...], block: int, what: str) -> None:
    if len(shape) != 2 or shape[0] % block or shape[1] % block:
        raise ValueError(
            f"{what}: shape {tuple(shape)} must be 2-D with both dims multiples of {block} "
            f"for {block}x{block} block scaling (the linears pad a weight's out features to whole blocks; its "
            f"in features, with tensor parallelism this rank's shard, must be a multiple); pick in features "
            f"divisible by {block}, or use current (tensorwise) scaling"
        )


@torch.no_grad()
def cast_blocks_2d(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    block: int = 128,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    what: str = "tensor",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``block x block`` tiles of ``x [rows, k]``.

    Returns ``(data [rows, k], scale_inv [rows // block, k // block])``.
    """
    check_block_shape_2d(tuple(x.shape), block, what)
    r, k = x.shape
    xb = x.reshape(r // block, block, k // block, block)
    amax = block_amax(xb, (1, 3))
    scale = amax_to_scale(amax, fp8_dtype, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon)
    data = cast_to_fp8(xb, scale[:, None, :, None], fp8_dtype).reshape(r, k)
    return data, torch.reciprocal(scale)


@torch.no_grad()
def mx_exponent(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Biased E8M0 exponent ``e`` (uint8) with ``amax / 2**(e-127) <= FP8_MAX``, the smallest such.

    This is the round-up ("RCEIL") rule cuBLAS uses, not the OCP spec's suggested floor rule
    (which may overflow and then saturates). Exact: computed on FP32 exponent bits, with a final
    check of ``amax <= FP8_MAX * 2**e``. Zero or non-finite amax -> exponent 127 (scale 1.0).
    """
    m = fp8_max(fp8_dtype)
    amax = amax.float()
    good = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(good, amax, torch.ones_like(amax))
    descale = safe / m
    mant, exp = torch.frexp(descale)  # descale = mant * 2**exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)  # ceil(log2(descale))
    # FP32 rounding of amax / m may land just below a power of two: fix with an exact check.
    e = torch.where(safe > torch.ldexp(torch.full_like(safe, m), e.float()), e + 1, e)
    e = torch.clamp(e, min=-E8M0_BIAS, max=E8M0_BIAS)
    e = torch.where(good, e, torch.zeros_like(e))
    return (e + E8M0_BIAS).to(torch.uint8)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """2**(e - 127) as FP32 (exact)."""
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e.int() - E8M0_BIAS)


@torch.no_grad()
def cast_mx(
    x: torch.Tensor, fp8_dtype: torch.dtype, *, block: int = 32, what: str = "tensor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 cast: 1 x ``block`` tiles along the last dim of ``x [rows, k]``.

    Returns ``(data [rows, k], exponents uint8 [rows, k // block])``.
    """
    xb = _blocked_rows(x, block, what)
    e = mx_exponent(block_amax(xb, -1), fp8_dtype)
    inv = e8m0_to_float(-e.int() + 2 * E8M0_BIAS)  # 2**(127 - e): exact reciprocal of the scale
    data = cast_to_fp8(xb, inv.unsqueeze(-1), fp8_dtype).reshape(x.shape)
    return data, e
