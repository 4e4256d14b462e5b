"""Rotary position embedding in one pass (Triton, CUDA), bit for bit megatron-core's unfused RoPE.

megatron-core without Transformer Engine applies RoPE to q and k as a chain of elementwise ops
(``rope_utils._apply_rotary_pos_emb_bshd``: the cosine and sine cast to the input's dtype, two
products, ``_rotate_half``'s negation and concatenation, a sum, and a concatenation with the
unrotated tail): about a dozen launches forward and more backward per tensor, each reading and
writing the whole tensor. This kernel reads the tensor once and writes it once, in each
direction, and rounds where those ops round: ``a = dtype(x * cos)``, ``b = dtype(r * sin)`` with
``r`` the rotated-half partner (``-x2, x1``, or pairwise for interleaved RoPE), then
``dtype(a + b)``. BF16 and FP16 products of two such values are exact in FP32 and the sum is
rounded to FP32 and then to the dtype, as torch's ops do, so the result equals the unfused
chain's bitwise (tests/test_rope.py; NaN payloads aside). Backward is the transpose: ``dtype(dtype(g * cos) +
s * dtype(g' * sin'))`` with ``g'`` and ``sin'`` at the partner column and ``s`` the partner's
sign, which is how autograd sums the two paths into ``x`` (and, as autograd's sum of the two
slices' zero-padded gradients does, a negative zero comes out positive). FP32 inputs are not served (the
compiler could contract the products into fused multiply-adds and round differently).

``t``: ``[s, b, h, d]`` with unit stride along ``d`` (any strides for the other dims: q and k
are views of the QKV projection's output); ``cos`` and ``sin``: ``[s, fb, rot]`` contiguous in
``t``'s dtype with ``fb`` 1 or ``b``; columns ``rot..d`` are copied (their gradient passes
through). The output is a new contiguous ``[s, b, h, d]`` tensor, as the unfused chain's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_launch import Launcher, cdiv

_ELEMENTS = 2048  # what a program handles: 2048 // (the head dim, to a power of 2) rows


@triton.jit
def _widen(raw, BF16: tl.constexpr):
    """A loaded element as FP32: BF16 from its bits (passed as int16), FP16 converted."""
    if BF16:
        return (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return raw.to(tl.float32)


@triton.jit
def _narrow(v, BF16: tl.constexpr):
    """FP32 ``v`` rounded to the dtype's precision (to nearest, ties to even), kept in FP32 (exact).
    BF16 by its bits: Triton's interpreter truncates where the GPU rounds, and loads BF16
    subnormals wrong, so BF16 moves as int16 bits and CI's interpreter computes the GPU's bits."""
    if BF16:
        b = v.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return tl.where(v != v, v, b.to(tl.float32, bitcast=True))  # NaN stays NaN
    return v.to(tl.float16).to(tl.float32)


@triton.jit
def _rope_kernel(t_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, B, H, st0, st1, st2, cs0, cs1, D, ROT, HALF,
                 BACKWARD: tl.constexpr, INTERLEAVED: tl.constexpr, BF16: tl.constexpr, BR: tl.constexpr,
                 BD: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    in_r = rows < n_rows
    hi = rows % H
    bi = (rows // H) % B
    si = rows // (H * B)
    src = si.to(tl.int64) * st0 + bi.to(tl.int64) * st1 + hi.to(tl.int64) * st2
    frow = si.to(tl.int64) * cs0 + bi.to(tl.int64) * cs1
    rot = cols < ROT
    if INTERLEAVED:
        partner = cols ^ 1
        first = (cols % 2) == 0  # r[2i] = -x[2i + 1], r[2i + 1] = x[2i]
    else:
        partner = tl.where(cols < HALF, cols + HALF, cols - HALF)
        first = cols < HALF  # r[i] = -x[i + half], r[i + half] = x[i]
    m_all = in_r[:, None] & (cols < D)[None, :]
    m_rot = in_r[:, None] & rot[None, :]
    x = _widen(tl.load(t_ptr + src[:, None] + cols[None, :], mask=m_all, other=0), BF16)
    xp = _widen(tl.load(t_ptr + src[:, None] + partner[None, :], mask=m_rot, other=0), BF16)
    c = _widen(tl.load(cos_ptr + frow[:, None] + cols[None, :], mask=m_rot, other=0), BF16)
    a = _narrow(x * c, BF16)  # every product of two such values is exact in FP32: one rounding
    if BACKWARD:  # dx = g cos + (rotate_half's transpose of g sin): the partner's product, signed
        sp = _widen(tl.load(sin_ptr + frow[:, None] + partner[None, :], mask=m_rot, other=0), BF16)
        bp = _narrow(xp * sp, BF16)
        b = tl.where(first[None, :], bp, -bp)
    else:  # y = x cos + rotate_half(x) sin
        s = _widen(tl.load(sin_ptr + frow[:, None] + cols[None, :], mask=m_rot, other=0), BF16)
        b = _narrow(tl.where(first[None, :], -xp, xp) * s, BF16)
    y = tl.where(rot[None, :], _narrow(a + b, BF16), x)
    if BACKWARD:  # autograd adds the two slices' zero-padded gradients: -0 comes out +0
        y = y + 0.0
    dst = rows.to(tl.int64)[:, None] * D + cols[None, :]
    if BF16:  # exact: y has the dtype's precision; NaN made quiet so the top half stays NaN
        hi16 = y.to(tl.uint32, bitcast=True) >> 16
        hi16 = tl.where(y != y, hi16 | 0x40, hi16)
        tl.store(out_ptr + dst, hi16.to(tl.uint16).to(tl.int16, bitcast=True), mask=m_all)
    else:
        tl.store(out_ptr + dst, y.to(tl.float16), mask=m_all)


_rope = Launcher(_rope_kernel)


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, backward: bool) -> torch.Tensor:
    """RoPE of ``t`` (or, ``backward``, its gradient's transpose applied to ``t``), a new
    contiguous tensor. The caller checks the shapes (``megatron/rope.py``): ``t`` 4-D BF16 or FP16
    with unit stride along the last dim, ``cos`` and ``sin`` ``[s, 1 or b, rot]`` contiguous in its
    dtype on its device, ``rot`` even and at most ``d``."""
    s, b, h, d = t.shape
    bf16 = t.dtype == torch.bfloat16
    out = torch.empty((s, b, h, d), dtype=torch.int16 if bf16 else t.dtype, device=t.device)
    rot = cos.shape[2]
    n = s * b * h
    bd = triton.next_power_of_2(d)
    br = max(1, _ELEMENTS // bd)
    if bf16:  # as bits (``_narrow``)
        t, cos, sin = t.view(torch.int16), cos.view(torch.int16), sin.view(torch.int16)
    _rope((cdiv(n, br),), t, cos, sin, out, n, b, h, t.stride(0), t.stride(1), t.stride(2),
          cos.stride(0), cos.stride(1) if cos.shape[1] > 1 else 0, d, rot, rot // 2,
          BACKWARD=backward, INTERLEAVED=interleaved, BF16=bf16, BR=br, BD=bd,
          enable_fp_fusion=False)  # no FMA: the unfused chain rounds each product (FP16 failed on an H100)
    if bf16:
        return out.view(torch.bfloat16)
    return out
