"""Grouped FP8 GEMMs of all experts in one Triton launch (wired into ``gemm_grouped.grouped_gemm_cat``
and ``gemm_grouped.grouped_wgrad``; ``MEGATRON_FP8_GROUPED_GEMM=auto|triton|torch|loop`` picks the path).
They exist for the host: per-expert cuBLAS calls cost 25-60 us of host time each, 16 of them per
backward step, and ``torch._scaled_grouped_mm`` needs ~10 scale set-up launches and refuses E5M2
gradients and block scales on SM90. Measured on an H200 (2026-12-02, 8 x 2048 tokens;
``scripts/probes/bench_triton_grouped.py``): fprop ~1100 TFLOP/s (cuBLAS per expert ~1150), dgrad and
wgrad with FP32 promotion ~760-820 (cuBLAS ~950-1050), 1x128 x 128x128 blocks ~620-720. Tiles
are 128x128x128, 8 warps, 3 stages (the best of a small sweep); no TMA, no warp specialization.
A graph replays without the host, so while one is captured ``gemm`` takes cuBLAS per expert
instead. Writing the FP32 promotion out one K step behind its MMA (same bits) ran slower
(dgrad 686 vs 760 TFLOP/s, block wgrad 576 vs 634; sixth session): not kept.

Two problem shapes, both with every expert's operands back to back in one buffer (as the
one-launch expert casts leave them) and every token count a multiple of 128:

==========  ======================================  =======================================
kernel      computes                                operands
==========  ======================================  =======================================
``rows``    ``y[rows of e] = a_e @ b_e.T``          a ``[M, K]`` (experts' rows back to
            (fprop, dgrad)                          back), b ``[G, N, K]``
``kgroup``  ``dw_e = a_e @ b_e.T`` over e's tokens  a_e ``[N, m_e]``, b_e ``[K, m_e]`` at
            (wgrad)                                 ``N * start_e`` / ``K * start_e``
==========  ======================================  =======================================

Scales: ``tensor`` (one per expert and operand, 16 bytes apart), or ``block``: in ``rows``, a in
1x128 tiles along K (per segment ``[K/128, m_e]``, M-major, as ``triton_cast`` writes them) and
b in 128x128 blocks (per expert ``[N/128, K/128]``, back to back); in ``kgroup``, both in 1x128
tiles along the tokens (``[M/128, N]`` and ``[M/128, K]``). Block-scaled products are summed in
FP32 per 128-deep K step after scaling (DeepSeek-V3's promotion), so results are close to, not
bitwise, cuBLAS's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..quant.tensor import SCALE_STRIDE
from .triton_launch import Launcher, cdiv

BLOCK = 128
BLOCK_C = tl.constexpr(BLOCK)  # scaling-block edge
STRIDE = tl.constexpr(SCALE_STRIDE)  # per-expert scales 16 bytes apart


@triton.jit
def _expert_of(row, off_ptr, n_exp):
    e = row * 0
    for j in range(1, n_exp):
        e += (row >= tl.load(off_ptr + j)).to(e.dtype)
    return e


@triton.jit
def _rows_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, off_ptr, dst_ptr, N, K, n_exp, n_tm, n_tn,
                 DST: tl.constexpr, BLOCKED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, IMPRECISE: tl.constexpr, OUT: tl.constexpr):
    pid = tl.program_id(0)
    per_group = GROUP_M * n_tn  # tiles ordered in bands of GROUP_M row tiles (L2 reuse of b)
    first_m = pid // per_group * GROUP_M
    band = tl.minimum(n_tm - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % band
    pid_n = (pid % per_group) // band
    row0 = pid_m.to(tl.int64) * BM
    e = _expert_of(row0, off_ptr, n_exp)
    start = tl.multiple_of(tl.load(off_ptr + e), BLOCK_C)  # offsets are multiples of 128 (callers check)
    m_e = tl.multiple_of(tl.load(off_ptr + e + 1) - start, BLOCK_C)
    rm = row0 + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    n_kb = tl.cdiv(K, BK)
    n_nb = tl.cdiv(N, BLOCK_C)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(0, n_kb):
        kk = kb * BK + rk
        a = tl.load(a_ptr + rm[:, None] * K + kk[None, :], mask=kk[None, :] < K, other=0.0)
        b = tl.load(b_ptr + e * N * K + rn[:, None].to(tl.int64) * K + kk[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        if BLOCKED:  # BK == 128: one 1x128 scale per row of a, one 128x128 scale per 128 columns of b
            part = tl.dot(a, tl.trans(b), max_num_imprecise_acc=IMPRECISE, out_dtype=tl.float32)
            s_a = tl.load(sa_ptr + start * n_kb + kb * m_e + (rm - start))  # [BM]
            if BN == BLOCK_C:
                acc += part * (s_a * tl.load(sb_ptr + (e * n_nb + pid_n) * n_kb + kb))[:, None]
            else:
                s_b = tl.load(sb_ptr + (e * n_nb + rn // BLOCK_C) * n_kb + kb, mask=rn < N, other=0.0)  # [BN]
                acc += part * s_a[:, None] * s_b[None, :]
        else:
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=IMPRECISE, out_dtype=tl.float32)
    if not BLOCKED:
        acc = acc * (tl.load(sa_ptr + e * STRIDE) * tl.load(sb_ptr + e * STRIDE))
    if DST:  # only each expert's first rows, at its row of the unpadded output (dst_ptr: their offsets)
        d0 = tl.load(dst_ptr + e)
        local = rm - start
        keep = local < tl.load(dst_ptr + e + 1) - d0
        tl.store(c_ptr + (d0 + local)[:, None] * N + rn[None, :], acc.to(OUT), mask=keep[:, None] & (rn[None, :] < N))
    else:
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(OUT), mask=rn[None, :] < N)


@triton.jit
def _kgroup_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, off_ptr, N, K, n_tn, n_tk, G,
                   BLOCKED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                   IMPRECISE: tl.constexpr, OUT: tl.constexpr, ADD: tl.constexpr, REVERSED: tl.constexpr,
                   PTX_ADD: tl.constexpr):
    pid = tl.program_id(0)
    per_e = n_tn * n_tk
    e = pid // per_e
    pid_n, pid_k = (pid % per_e) // n_tk, (pid % per_e) % n_tk
    start = tl.multiple_of(tl.load(off_ptr + e), BLOCK_C)  # multiples of 128: aligned, vector loads
    m_e = tl.multiple_of(tl.load(off_ptr + e + 1) - start, BLOCK_C)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * BK + tl.arange(0, BK)
    rt = tl.arange(0, BT)
    a_base = a_ptr + N * start
    b_base = b_ptr + K * start
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for t0 in range(0, m_e, BT):
        tt = t0 + rt
        a = tl.load(a_base + rn[:, None].to(tl.int64) * m_e + tt[None, :], mask=rn[:, None] < N, other=0.0)
        b = tl.load(b_base + rk[:, None].to(tl.int64) * m_e + tt[None, :], mask=rk[:, None] < K, other=0.0)
        if BLOCKED:  # BT == 128: one scale per 128 tokens of each row of a and of b
            part = tl.dot(a, tl.trans(b), max_num_imprecise_acc=IMPRECISE, out_dtype=tl.float32)
            tb = start // BT + t0 // BT
            s_a = tl.load(sa_ptr + tb * N + rn, mask=rn < N, other=0.0)
            s_b = tl.load(sb_ptr + tb * K + rk, mask=rk < K, other=0.0)
            acc += part * s_a[:, None] * s_b[None, :]
        else:
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=IMPRECISE, out_dtype=tl.float32)
    if not BLOCKED:
        acc = acc * (tl.load(sa_ptr + e * STRIDE) * tl.load(sb_ptr + e * STRIDE))
    slot = (G - 1 - e) if REVERSED else e  # where expert e's [N, K] lies in c
    dst = c_ptr + slot.to(tl.int64) * N * K + rn[:, None].to(tl.int64) * K + rk[None, :]
    inside = (rn[:, None] < N) & (rk[None, :] < K)
    if ADD:  # c += dw (an FP32 main_grad), rounded as dw's own store and a separate add would be
        old = tl.load(dst, mask=inside, other=0.0)
        if PTX_ADD:  # an add with an explicit rounding mode is never contracted with the scaling
            acc = tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [old, acc],
                                            dtype=tl.float32, is_pure=True, pack=1)
        else:  # (Triton's interpreter: NumPy adds, no contraction)
            acc = old + acc
    tl.store(dst, acc.to(OUT), mask=inside)


def _imprecise(fast_accum: bool) -> int | None:
    """``max_num_imprecise_acc`` of the FP8 dots on SM90: Triton's default (None: the tensor cores'
    reduced-precision accumulator throughout, like cuBLAS's fast accumulation) or 128 (sums
    promoted to FP32 after every 128-deep K step, i.e. every four MMA instructions, the promotion
    interval CUTLASS's SM90 FP8 kernels use when fast accumulation is off). Block-scaled products
    are promoted at every 128-deep scaling step either way."""
    return None if fast_accum else BLOCK


_OUT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@dataclass(frozen=True)
class Tiles:
    """Launch configuration of one grouped kernel (``scripts/probes/bench_triton_grouped.py`` sweeps
    these). ``rows``: ``bm`` x ``bn`` output tiles (``bm`` must divide every expert's row count);
    ``kgroup``: ``bm`` x ``bn`` tiles of ``[N, K]`` per expert. The contraction step is 128."""

    bm: int = 128
    bn: int = 128
    warps: int = 8
    stages: int = 3
    group_m: int = 8


ROWS, KGROUP = Tiles(), Tiles()
_PTX = os.environ.get("TRITON_INTERPRET") != "1"  # compiled for a GPU (inline PTX), not interpreted
_ROWS, _KGROUP = Launcher(_rows_kernel), Launcher(_kgroup_kernel)  # ~35 us less host time per launch


def grouped_rows(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, offsets: torch.Tensor,
                 out_dtype: torch.dtype, *, blocked: bool, fast_accum: bool = False,
                 tiles: Tiles | None = None, keep: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """``cat_e(a[rows of e] @ b[e].T)``: ``a [M, K]`` FP8, ``b [G, N, K]`` FP8, ``offsets [G+1]``
    (multiples of 128). ``sa``/``sb``: per-expert 1/scales 16 bytes apart (tensor) or the block
    scale buffers described in the module docstring. ``keep``: ``(offsets [G+1], rows)`` of an
    output without the experts' padding: only expert e's first ``keep[0][e+1] - keep[0][e]`` rows
    are written, at ``keep[0][e]`` of a ``[rows, N]`` output (the same bits as dropping the padded
    rows afterwards, without a gather over the whole output)."""
    t = tiles or ROWS
    m, k = a.shape
    g, n, _ = b.shape
    c = torch.empty((m if keep is None else keep[1], n), dtype=out_dtype, device=a.device)
    n_tm, n_tn = m // t.bm, cdiv(n, t.bn)
    if m:
        _ROWS((n_tm * n_tn,), a, b, c, sa, sb, offsets, offsets if keep is None else keep[0], n, k, g, n_tm, n_tn,
              DST=keep is not None, BLOCKED=blocked, BM=t.bm, BN=t.bn,
              BK=BLOCK, GROUP_M=t.group_m, IMPRECISE=_imprecise(fast_accum), OUT=_OUT[out_dtype],
              num_warps=t.warps, num_stages=t.stages)
    return c


def grouped_kgroup(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, offsets: torch.Tensor,
                   n: int, k: int, out_dtype: torch.dtype, *, blocked: bool, fast_accum: bool = False,
                   tiles: Tiles | None = None, into: tuple[torch.Tensor, bool] | None = None) -> torch.Tensor:
    """``[a_e @ b_e.T for e]`` as ``[G, N, K]``: ``a`` the flat ``[N, m_e]`` blocks, ``b`` the flat
    ``[K, m_e]`` blocks of every expert (``offsets [G+1]``, multiples of 128); zero for an expert
    without tokens.

    ``into``: ``(c, reversed)``, a contiguous FP32 ``[G, N, K]`` buffer (the experts' ``main_grad``)
    that each expert's product is added into in the epilogue, expert e at ``c[e]`` (or at
    ``c[G - 1 - e]``, reversed); returns ``c``. The same bits as ``c += grouped_kgroup(...)``
    with an FP32 output: the scaled product is rounded to FP32 first and the add is one rounded
    FP32 add (tests/test_triton_grouped.py), while it reads and writes ``c`` once instead of also
    writing and reading the product."""
    t = tiles or KGROUP
    g = offsets.numel() - 1
    if into is None:
        c, reversed_ = torch.empty((g, n, k), dtype=out_dtype, device=a.device), False
    else:
        c, reversed_ = into
        if c.dtype != torch.float32 or c.shape != (g, n, k) or not c.is_contiguous() or out_dtype != torch.float32:
            raise ValueError(f"grouped_kgroup: into must be a contiguous FP32 [{g}, {n}, {k}] buffer and the "
                             f"output FP32, not {c.dtype} {tuple(c.shape)} (output {out_dtype})")
    n_tn, n_tk = cdiv(n, t.bm), cdiv(k, t.bn)
    _KGROUP((g * n_tn * n_tk,), a, b, c, sa, sb, offsets, n, k, n_tn, n_tk, g, BLOCKED=blocked, BN=t.bm, BK=t.bn,
            BT=BLOCK, IMPRECISE=_imprecise(fast_accum), OUT=_OUT[out_dtype], ADD=into is not None,
            REVERSED=reversed_, PTX_ADD=into is not None and _PTX, num_warps=t.warps, num_stages=t.stages)
    return c
