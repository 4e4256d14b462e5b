"""Each expert's rows padded with zero rows in one pass (Triton, CUDA): ``out[rows[i]] = x[i]``
for every real row ``i``, zeros in every other row of ``out``.

The torch way, ``x.new_zeros(total, K).index_copy_(0, rows, x)``, writes ``out`` twice and
``index_copy_``'s kernel computes an index per element: on the H100 it took 42 + 212 us for a
router step's ``[~16.4k, 4096]`` BF16 input, and this kernel 99 us (docs/benchmarks.md run AI).
Here each program copies a block of real rows and zeroes the padding
that follows each of them: the rows between ``rows[i] + 1`` and the next real row's (or
``total``). Padding always follows an expert's real rows (``ops.padding.expert_rows``: an
expert's padded rows start at its first real row, and an expert without rows has none), so every
zero row has such a real row before it. A pure copy: the result is bitwise the torch way's.

``expert_index`` builds that index (``ops.padding.expert_rows``) in one launch from the experts'
real and padded prefix sums, where torch's ``arange + repeat_interleave`` took five launches and
~200 us of host time a router step (``scripts/probes/host_breakdown.py``, run AN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_launch import Launcher, cdiv

_BLOCK_R, _BLOCK_K = 16, 256  # rows and columns a program moves


@triton.jit
def _pad_rows_kernel(x_ptr, rows_ptr, out_ptr, M, K, TOTAL, BR: tl.constexpr, BK: tl.constexpr):
    pid_r, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = pid_r * BR + tl.arange(0, BR)
    offs_k = pid_k * BK + tl.arange(0, BK)
    in_m, in_k = offs_m < M, offs_k < K
    dest = tl.load(rows_ptr + offs_m, mask=in_m, other=0)
    nxt = tl.load(rows_ptr + offs_m + 1, mask=offs_m + 1 < M, other=TOTAL)
    nxt = tl.where(offs_m + 1 < M, nxt, TOTAL)
    mask = in_m[:, None] & in_k[None, :]
    v = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], mask=mask)
    tl.store(out_ptr + dest[:, None] * K + offs_k[None, :], v, mask=mask)
    gap = tl.where(in_m, nxt - dest - 1, 0)  # the zero rows after each real row
    zero = tl.zeros([BR, BK], dtype=v.dtype)
    for j in range(0, tl.max(gap, axis=0)):
        z = (gap > j)[:, None] & in_k[None, :]
        tl.store(out_ptr + (dest + 1 + j)[:, None] * K + offs_k[None, :], zero, mask=z)


@triton.jit
def _index_kernel(real_ptr, pad_ptr, out_ptr, M, E, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    shift = tl.zeros([BLOCK], dtype=tl.int64)
    for e in range(0, E):  # starts ascend: the last expert starting at or before a row holds it
        start = tl.load(real_ptr + e)
        shift = tl.where(offs >= start, tl.load(pad_ptr + e) - start, shift)
    tl.store(out_ptr + offs, offs.to(tl.int64) + shift, mask=offs < M)


_pad, _index = Launcher(_pad_rows_kernel), Launcher(_index_kernel)
_BLOCK_I = 1024  # index entries a program writes


def serves(x: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether ``pad_rows`` takes ``x``: a contiguous 2-D tensor with rows and columns, and a 1-D
    int64 index of one entry per row on its device (the caller checks that the kernels run on
    that device)."""
    return (x.dim() == 2 and x.is_contiguous() and x.shape[0] > 0 and x.shape[1] > 0
            and rows.dtype == torch.int64 and rows.dim() == 1 and rows.numel() == x.shape[0]
            and rows.is_contiguous() and rows.device == x.device)


def pad_rows(x: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:
    """``x [M, K]``'s row ``i`` at row ``rows[i]`` of a new ``[total, K]`` tensor, zeros elsewhere.
    ``rows`` must start at 0, increase strictly and stay below ``total`` (``ops.padding.expert_rows``'s
    index does; not checked here: that would need the index on the host); ``serves`` checked by
    the caller."""
    m, k = x.shape
    out = torch.empty((total, k), dtype=x.dtype, device=x.device)
    _pad((cdiv(m, _BLOCK_R), cdiv(k, _BLOCK_K)), x, rows, out, m, k, total, BR=_BLOCK_R, BK=_BLOCK_K)
    return out


def expert_index(real_offsets: torch.Tensor, padded_offsets: torch.Tensor, m: int) -> torch.Tensor:
    """The padded row of each of ``m`` real rows: row ``i`` of expert ``e`` goes to
    ``i - real_offsets[e] + padded_offsets[e]``. Both offsets are the experts' int64 prefix sums
    ``[E + 1]`` on one device (``quant.kernels.segment_offsets``), ``m`` the real total."""
    out = torch.empty(m, dtype=torch.int64, device=real_offsets.device)
    if m:
        _index((cdiv(m, _BLOCK_I),), real_offsets, padded_offsets, out, m, real_offsets.numel() - 1, BLOCK=_BLOCK_I)
    return out
