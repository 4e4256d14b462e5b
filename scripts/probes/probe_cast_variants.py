"""Block-cast kernel variants against the package's cast (GPU only): each variant's outputs are
checked bit for bit against ``triton_cast.cast_tiles``, then timed; prints one table.

    python scripts/probe_cast_variants.py

Variants of the row + column cast of one 128x128 tile per program (``_cast_tile_kernel``):

- ``package``: the package's kernel (one program writes both copies; the column copy re-reads
  the tile transposed, an L2 hit);
- ``split``: two programs per tile, adjacent in launch order (so they run together and the
  second read is an L2 hit): one writes the rowwise copy, the other the columnwise copy. Half
  the work and registers per program, twice the programs.
- ``fp8t`` (1x128 only): one program, one load; the column scales from the loaded tile's column
  maxima, the tile quantized with them and the FP8 result transposed (as the 128x128 cast does
  with its one scale), instead of re-reading the tile transposed.

Both were slower than the package on an H200 (docs/benchmarks.md runs S and T: x 16384x4096,
split 119.7 and fp8t 118.2 us at best, package 112.6-113.2).

Yardsticks: ``torch.clone`` of the input (DRAM copy rate: the same bytes read and written as a
row + column cast), and the package's row-only and column-only casts (3 bytes per element).

``--segments``: the experts' casts (``cast_segments``, 8 segments of 2048 rows) against one
plain cast of the same tensor, with the package's segment lookup (32 boundaries per vector
load), or with ``--lookup old`` the one it replaced (one scalar load per boundary, a loop step
each), swapped in first (run each in its own process: the kernel compiles with the lookup it
first sees). H200, 2026-12-03: 124 us for the weights' 128x128 cast with the old lookup, 85 with
the vector one (then swapped into the package by this script; docs/benchmarks.md run S).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib
from benchlib import environment, markdown_table, median_ms

from megatron_fp8.kernels import triton_cast as tc
from megatron_fp8.kernels.triton_cast import _load_transposed, _pow2_scale, _quantize  # noqa: F401 (jit globals)
from megatron_fp8.quant.kernels import segment_offsets
from megatron_fp8.testing import bits, same_bits


@triton.jit
def _split_kernel(x_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, M, K, n_kb,
                  MODE: tl.constexpr, FMAX: tl.constexpr, F_EXP: tl.constexpr, F_MANT: tl.constexpr,
                  OUT: tl.constexpr, T: tl.constexpr):
    which, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * T + tl.arange(0, T)
    offs_k = pid_k * T + tl.arange(0, T)
    rows64 = offs_m.to(tl.int64)
    if which == 0:
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        x = tl.load(x_ptr + rows64[:, None] * K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        a = tl.abs(x)
        if MODE == 0:
            s_r, inv_r = _pow2_scale(tl.max(a, axis=1), F_EXP, F_MANT)
            tl.store(row_s_ptr + pid_k * M + rows64, inv_r, mask=offs_m < M)
            q = _quantize(x, s_r[:, None], FMAX, OUT)
        else:
            s_all, inv_all = _pow2_scale(tl.max(tl.max(a, axis=1), axis=0), F_EXP, F_MANT)
            tl.store(row_s_ptr + pid_m * n_kb + pid_k, inv_all)
            q = _quantize(x, s_all, FMAX, OUT)
        tl.store(row_ptr + rows64[:, None] * K + offs_k[None, :], q, mask=mask)
    else:
        xt = _load_transposed(x_ptr, rows64, offs_m, offs_k, M, K)  # [T(k), T(m)]
        at = tl.abs(xt)
        if MODE == 0:
            s_c, inv_c = _pow2_scale(tl.max(at, axis=1), F_EXP, F_MANT)
            tl.store(col_s_ptr + pid_m.to(tl.int64) * K + offs_k, inv_c, mask=offs_k < K)
            q = _quantize(xt, s_c[:, None], FMAX, OUT)
        else:
            s_all, _ = _pow2_scale(tl.max(tl.max(at, axis=1), axis=0), F_EXP, F_MANT)
            q = _quantize(xt, s_all, FMAX, OUT)
        tl.store(col_ptr + offs_k[:, None].to(tl.int64) * M + rows64[None, :], q,
                 mask=(offs_k[:, None] < K) & (offs_m[None, :] < M))


@triton.jit
def _fp8t_kernel(x_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, M, K, n_kb, FMAX: tl.constexpr,
                 F_EXP: tl.constexpr, F_MANT: tl.constexpr, OUT: tl.constexpr, T: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * T + tl.arange(0, T)
    offs_k = pid_k * T + tl.arange(0, T)
    rows64 = offs_m.to(tl.int64)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + rows64[:, None] * K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.abs(x)
    s_r, inv_r = _pow2_scale(tl.max(a, axis=1), F_EXP, F_MANT)
    tl.store(row_s_ptr + pid_k * M + rows64, inv_r, mask=offs_m < M)
    tl.store(row_ptr + rows64[:, None] * K + offs_k[None, :], _quantize(x, s_r[:, None], FMAX, OUT), mask=mask)
    s_c, inv_c = _pow2_scale(tl.max(a, axis=0), F_EXP, F_MANT)
    tl.store(col_s_ptr + pid_m.to(tl.int64) * K + offs_k, inv_c, mask=offs_k < K)
    q = tl.trans(_quantize(x, s_c[None, :], FMAX, OUT))  # [T(k), T(m)]
    tl.store(col_ptr + offs_k[:, None].to(tl.int64) * M + rows64[None, :], q,
             mask=(offs_k[:, None] < K) & (offs_m[None, :] < M))


def _run(kernel: object, lead: tuple[int, ...], x: torch.Tensor, mode: str, warps: int, **const: object) -> tuple:
    """A variant kernel over ``x``'s 128x128 tiles (grid ``(*lead, tiles down, tiles across)``),
    its outputs laid out as ``triton_cast.cast_tiles`` returns them."""
    m, k = x.shape
    n_mb, n_kb = triton.cdiv(m, 128), triton.cdiv(k, 128)
    row, col = tc.fp8_copies(x, torch.float8_e4m3fn, True, True, False)
    row_s = torch.empty((n_kb * m,) if mode == "1x128" else (n_mb, n_kb), dtype=torch.float32, device=x.device)
    col_s = torch.empty((n_mb, k), dtype=torch.float32, device=x.device)
    fmax, f_exp, f_mant, out = tc._fp8_consts(torch.float8_e4m3fn)
    kernel[(*lead, n_mb, n_kb)](x, row, row_s, col, col_s, m, k, n_kb, FMAX=fmax, F_EXP=f_exp, F_MANT=f_mant,
                                OUT=out, T=128, num_warps=warps, **const)
    if mode == "1x128":
        return (row, row_s.view(n_kb, m).t()), (col, col_s.t())
    return (row, row_s), (col, row_s.t().contiguous())


def _fp8t(x: torch.Tensor, warps: int) -> tuple:
    return _run(_fp8t_kernel, (), x, "1x128", warps)


def _split(x: torch.Tensor, mode: str, warps: int) -> tuple:
    return _run(_split_kernel, (2,), x, mode, warps, MODE=tc._MODES[mode])


def _same(a: tuple, b: tuple) -> bool:
    """Two casts' ``((row, row_s), (col, col_s))`` bit for bit."""
    return same_bits([*a[0], *a[1]], [*b[0], *b[1]])


@triton.jit
def _segment_of_row_old(row, seg_ptr, n_seg):
    """The lookup ``triton_cast._segment_of_row`` replaced: one boundary per loop step."""
    eid = tl.zeros_like(row)
    for j in range(1, n_seg):
        eid += (row >= tl.load(seg_ptr + j)).to(row.dtype)
    return eid


def segments(lookup: str) -> None:
    if lookup == "old":
        tc._segment_of_row = _segment_of_row_old
    rows = []
    splits = [2048] * 8
    offsets = segment_offsets(splits, torch.device("cuda"))
    for label, k, mode in (("w 8x2048x4096", 4096, "128x128"), ("x 8x2048x4096", 4096, "1x128"),
                           ("dy 8x2048x2048", 2048, "1x128")):
        x = torch.randn(sum(splits), k, device="cuda", dtype=torch.bfloat16)
        if lookup == "old":  # the swapped lookup must give the same bits
            ref = tc.cast_tiles(x, torch.float8_e4m3fn, mode, True, True)
            got = tc.cast_segments(x, offsets, splits, torch.float8_e4m3fn, mode, True, True)
            assert got[0].shape == ref[0][0].shape and torch.equal(bits(got[0]), bits(ref[0][0])), label
        plain = median_ms(lambda x=x, mode=mode: tc.cast_tiles(x, torch.float8_e4m3fn, mode, True, True))
        seg = median_ms(lambda x=x, mode=mode: tc.cast_segments(x, offsets, splits, torch.float8_e4m3fn, mode,
                                                                True, True))
        rows.append([label, mode, lookup, f"{plain * 1e3:.1f}", f"{seg * 1e3:.1f}", f"{plain / seg:.2f}x"])
    print(markdown_table(["tensor", "mode", "segment lookup", "plain us", "8 segments us", "plain/segments"], rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="*", choices=("split", "fp8t"), default=["split", "fp8t"])
    p.add_argument("--segments", action="store_true")
    p.add_argument("--lookup", choices=("package", "old"), default="package")
    args = p.parse_args()
    print(environment())
    if args.segments:
        segments(args.lookup)
        return
    variants(set(args.variants))


def variants(kinds: set[str]) -> None:
    """The row + column cast variants ``kinds`` against the package's cast and the yardsticks."""
    rows = []
    cases = [("x 16384x4096", 16384, 4096, "1x128"), ("dy 16384x2048", 16384, 2048, "1x128"),
             ("w 16384x4096", 16384, 4096, "128x128")]
    for label, m, k, mode in cases:
        tried = [(f"split, {w} warps", lambda x, mode=mode, w=w: _split(x, mode, w))
                 for w in (4, 8, 16) if "split" in kinds]
        tried += [(f"fp8t, {w} warps", lambda x, w=w: _fp8t(x, w))
                  for w in (4, 8, 16) if "fp8t" in kinds and mode == "1x128"]
        if not tried:
            continue
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        elems = x.numel() / 1e9
        ref = tc.cast_tiles(x, torch.float8_e4m3fn, mode, True, True)
        timings = {"clone (DRAM copy)": median_ms(lambda x=x: x.clone())}
        gb = dict.fromkeys(("package row only", "package col only"), 3 * elems)  # GB moved: 2 read, 1 written
        for name, row, col in (("package row only", True, False), ("package col only", False, True),
                               ("package", True, True)):
            timings[name] = median_ms(lambda x=x, mode=mode, r=row, c=col: tc.cast_tiles(x, torch.float8_e4m3fn,
                                                                                         mode, r, c))
        for name, fn in tried:
            if not _same(fn(x), ref):
                rows.append([label, mode, name, "MISMATCH", "", ""])
                continue
            timings[name] = median_ms(lambda x=x, fn=fn: fn(x))
        base = timings["package"]
        for name, ms in timings.items():
            rows.append([label, mode, name, f"{ms * 1e3:.1f}", f"{gb.get(name, 4 * elems) / ms:.2f}",
                         f"{base / ms:.2f}x"])
    print(markdown_table(["tensor", "mode", "variant", "us", "TB/s", "vs package"], rows))

if __name__ == "__main__":
    main()
