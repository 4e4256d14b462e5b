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
def _round(v, dtype: tl.constexpr, BF16: tl.constexpr):
    """FP32 ``v`` rounded to ``dtype`` to nearest, ties to even. BF16 by its bits (the FP32 value
    it keeps, then an exact conversion): Triton's interpreter truncates where the GPU rounds, so
    this way CI's interpreter runs round as the GPU does (its BF16 loads of subnormals are wrong
    too: the interpreter's runs are checked with normal numbers, the GPU's with subnormals)."""
    if BF16:
        b = v.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        v = tl.where(v != v, v, b.to(tl.float32, bitcast=True))  # NaN stays NaN
    return v.to(dtype)


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
    x = tl.load(t_ptr + src[:, None] + cols[None, :], mask=m_all, other=0.0)
    xp = tl.load(t_ptr + src[:, None] + partner[None, :], mask=m_rot, other=0.0)
    c = tl.load(cos_ptr + frow[:, None] + cols[None, :], mask=m_rot, other=0.0)
    if BACKWARD:  # dx = g cos + (rotate_half's transpose of g sin): the partner's product, signed
        sp = tl.load(sin_ptr + frow[:, None] + partner[None, :], mask=m_rot, other=0.0)
        a = _round(x.to(tl.float32) * c.to(tl.float32), x.dtype, BF16)
        bp = _round(xp.to(tl.float32) * sp.to(tl.float32), x.dtype, BF16)
        bp = bp.to(tl.float32)  # negated in FP32 (exact; the interpreter's BF16 negation is not)
        b = tl.where(first[None, :], bp, -bp)
    else:  # y = x cos + rotate_half(x) sin
        s = tl.load(sin_ptr + frow[:, None] + cols[None, :], mask=m_rot, other=0.0)
        a = _round(x.to(tl.float32) * c.to(tl.float32), x.dtype, BF16)
        xp = xp.to(tl.float32)  # negated in FP32 (exact; the interpreter's BF16 negation is not)
        r = tl.where(first[None, :], -xp, xp)
        b = _round(r * s.to(tl.float32), x.dtype, BF16)
    y = _round(a.to(tl.float32) + b.to(tl.float32), x.dtype, BF16)
    y = tl.where(rot[None, :], y, x)
    if BACKWARD:  # autograd adds the two slices' zero-padded gradients: -0 comes out +0
        y = _round(y.to(tl.float32) + 0.0, x.dtype, BF16)
    dst = rows.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(out_ptr + dst, y, mask=m_all)


_rope = Launcher(_rope_kernel)


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, backward: bool) -> torch.Tensor:
    """RoPE of ``t`` (or, ``backward``, its gradient's transpose applied to ``t``), a new
    contiguous tensor. The caller checks the shapes (``megatron/rope.py``): ``t`` 4-D BF16 or FP16
with unit stride along the last dim, ``cos`` and ``sin`` ``[s, 1 or b, rot]`` contiguous in its
dtype on its device, ``rot`` even and at most ``d``."""
    s, b, h, d = t.shape
    out = torch.empty((s, b, h, d), dtype=t.dtype, device=t.device)
    rot = cos.shape[2]
    n = s * b * h
    bd = triton.next_power_of_2(d)
    br = max(1, _ELEMENTS // bd)
    _rope((cdiv(n, br),), t, cos, sin, out, n, b, h, t.stride(0), t.stride(1), t.stride(2),
          cos.stride(0), cos.stride(1) if cos.shape[1] > 1 else 0, d, rot, rot // 2,
          BACKWARD=backward, INTERLEAVED=interleaved, BF16=t.dtype == torch.bfloat16, BR=br, BD=bd)
    return out
