"""Probe (GPU): a current-scaling cast that reads its input once, the tiles held in registers
across the grid barrier.

    python scripts/probe_resident_cast.py [--check]

The package's one-launch cast (``triton_persistent``) reads ``x`` twice: an amax pass, the
barrier, then the cast (its second read mostly misses L2: 8 experts of 16 MB). Here each program
loads its (at most ``R``) 128x128 tiles of one expert once, keeps them in registers, adds its
amax, waits at the barrier, and casts what it holds: one launch per expert, each expert at most
``programs * R`` tiles. Least bytes: read 2 B and write 2 x 1 B per element, where the two-pass
cast reads 4 B.

Times (CUDA graph of the experts' launches, median replay) against the package's one-launch
segmented cast of the same experts, whose bits every variant must equal. ``--check`` runs the
kernel under Triton's interpreter on CPU (one program, no barrier) against ``cast_current``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from megatron_fp8.kernels.triton_cast import TILE, _fp8_consts, _quantize, cast_current, fp8_copies
from megatron_fp8.kernels.triton_scale import _tensor_scale
from megatron_fp8.quant.kernels import segment_offsets
from megatron_fp8.quant.tensor import aligned_scalars
from megatron_fp8.testing import same_bits

F8 = torch.float8_e4m3fn


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib


@triton.jit
def _resident_kernel(x_ptr, row_ptr, col_ptr, scale_ptr, inv_ptr, sync_ptr, M, K, n_kb,
                     R: tl.constexpr, T: tl.constexpr, FMAX: tl.constexpr, OUT: tl.constexpr,
                     EPS: tl.constexpr, POW2: tl.constexpr, BARRIER: tl.constexpr):
    """One expert ``x [M, K]``: rowwise ``[M, K]`` and columnwise ``[K, M]`` copies, one scale.
    Program p holds tiles ``[lo, hi)`` (row-major, k fastest; at most R) as one ``[R*T, T]`` block.
    Sync words: arrivals, departures, amax bits (zero before the launch; the last to leave clears)."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_tiles = tl.cdiv(M, T) * n_kb
    lo = pid * n_tiles // n_prog
    hi = (pid + 1) * n_tiles // n_prog
    slot = tl.arange(0, R * T)
    t = lo + slot // T  # the tile of each block row
    rows = (t // n_kb) * T + slot % T
    kb = (t % n_kb) * T
    j = tl.arange(0, T)
    cols = kb[:, None] + j[None, :]
    ok = (t < hi) & (rows < M)
    mask = ok[:, None] & (cols < K)
    src = rows[:, None].to(tl.int64) * K + cols
    v = tl.load(x_ptr + src, mask=mask, other=0.0)
    # |x| from BF16 bits (FP32 bits are the BF16 bits << 16): no FP32 copy lives across the barrier
    a = tl.max(tl.max(v.to(tl.int16, bitcast=True) & 0x7FFF, axis=1), axis=0).to(tl.int32) << 16
    if BARRIER:
        tl.atomic_max(sync_ptr + 2, a, sem="relaxed")
        tl.atomic_add(sync_ptr, 1, sem="release")
        while tl.atomic_add(sync_ptr, 0, sem="acquire") < n_prog:
            pass
        a = tl.load(sync_ptr + 2, volatile=True)
    s, inv = _tensor_scale(a.to(tl.float32, bitcast=True), FMAX, EPS, 1.0, POW2)
    q = _quantize(v.to(tl.float32), s, FMAX, OUT)
    tl.store(row_ptr + src, q, mask=mask)
    dst = (kb[None, :] + j[:, None]).to(tl.int64) * M + rows[None, :]  # col[k, m]
    tl.store(col_ptr + dst, tl.trans(q), mask=ok[None, :] & ((kb[None, :] + j[:, None]) < K))
    if pid == 0:
        tl.store(scale_ptr, s)
        tl.store(inv_ptr, inv)
    if BARRIER:
        tl.debug_barrier()
        if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel") == n_prog - 1:
            tl.atomic_xchg(sync_ptr + 2, 0, sem="relaxed")
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed")


def resident_cast(x: torch.Tensor, splits: list[int], programs: int, r: int, warps: int,
                  sync: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The package's segmented layout (row ``[M, K]``, flat col, per-expert scales 16 B apart),
    one launch per expert."""
    k = x.shape[1]
    row, col = fp8_copies(x, F8, True, True, segmented=True)
    scale, inv = aligned_scalars(len(splits), x.device), aligned_scalars(len(splits), x.device)
    fmax, _, _, out = _fp8_consts(F8)
    n_kb = triton.cdiv(k, TILE)
    cuda = x.is_cuda
    start = 0
    for e, m in enumerate(splits):
        n_tiles = triton.cdiv(m, TILE) * n_kb
        grid = min(programs, n_tiles)
        if n_tiles > grid * r:
            raise ValueError(f"expert {e}: {n_tiles} tiles > {grid} programs x {r}")
        kw = dict(R=r, T=TILE, FMAX=fmax, OUT=out, EPS=0.0, POW2=False, BARRIER=cuda and grid > 1, num_warps=warps)
        if cuda:
            kw["launch_cooperative_grid"] = True
        _resident_kernel[(grid,)](x[start:start + m], row[start:start + m], col[k * start:k * (start + m)],
                                  scale[e:e + 1], inv[e:e + 1], sync[4 * e:4 * e + 4], m, k, n_kb, **kw)
        start += m
    return row, col, scale, inv


def reference(x: torch.Tensor, splits: list[int], offs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    row, col, scale, inv = cast_current(x, F8, True, True, splits=splits, offsets=offs, one_launch=x.is_cuda)
    return row, col, scale, inv


def check_cpu() -> None:
    torch.manual_seed(0)
    for splits, k in (([256, 128], 384), ([128], 200), ([384, 128, 256], 128)):
        x = torch.randn(sum(splits), k, dtype=torch.bfloat16) * 3
        x[5, 7] = -41.0
        got = resident_cast(x, splits, programs=1, r=8, warps=4, sync=torch.zeros(4 * len(splits), dtype=torch.int32))
        ref = reference(x, splits, segment_offsets(splits, x.device))
        print(splits, k, "equal" if same_bits(got, ref) else "DIFFER")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    a = p.parse_args()
    if a.check:
        return check_cpu()
    from benchlib import markdown_table, median_ms

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cases = {"x/w 8x2048x4096": (8, 2048, 4096), "dy 8x2048x2048": (8, 2048, 2048),
             "w 8x7168x2048": (8, 7168, 2048), "x 8x2048x2048": (8, 2048, 2048)}
    variants = [(1, 4, 16), (1, 4, 8), (1, 2, 8), (1, 2, 16), (1, 8, 16)]  # (per SM, R, warps)
    rows = []
    sync = torch.zeros(4 * 64, dtype=torch.int32, device=dev)
    for name, (e, m, k) in cases.items():
        torch.manual_seed(0)
        x = torch.randn(e * m, k, device=dev, dtype=torch.bfloat16)
        splits = [m] * e
        offs = segment_offsets(splits, dev)
        ref = reference(x, splits, offs)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            reference(x, splits, offs)
        base = median_ms(g.replay) * 1e3
        least = x.numel() * 4 / 1e6
        rows.append([name, "package one-launch", f"{base:.1f}", f"{least * 1e3 / base:.0f}", "ref", "1.00"])
        for per_sm, r, warps in variants:
            label = f"resident {per_sm}/SM R={r} {warps}w"
            n_tiles = m // TILE * triton.cdiv(k, TILE)
            if n_tiles > per_sm * sms * r:
                rows.append([name, label, "does not fit", "", "", ""])
                continue
            try:
                got = resident_cast(x, splits, per_sm * sms, r, warps, sync)
                torch.cuda.synchronize()
                same = same_bits(got, ref)
                g2 = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g2):
                    resident_cast(x, splits, per_sm * sms, r, warps, sync)
                us = median_ms(g2.replay) * 1e3
                rows.append([name, label, f"{us:.1f}", f"{least * 1e3 / us:.0f}", "equal" if same else "DIFFER",
                             f"{base / us:.2f}"])
            except Exception as exc:  # a probe: report and go on
                rows.append([name, label, "failed", str(exc)[:80].replace("|", "/"), "", ""])
            print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}\n")
    print(markdown_table(["tensor", "cast", "us", "GB/s over least bytes", "bits", "speedup"], rows))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1" and "--check" in sys.argv:
        raise SystemExit("--check runs under TRITON_INTERPRET=1")
    main()
