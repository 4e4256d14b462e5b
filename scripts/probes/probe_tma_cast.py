"""Probe (GPU): the 1x128 row + column cast with TMA (Hopper's tensor memory accelerator).

    python scripts/probe_tma_cast.py [--check]

The package's 1x128 cast of x (rowwise 1x128 blocks along K, columnwise 1x128 blocks along the
tokens, both copies in one pass) runs at ~2.4 TB/s where a copy runs at ~3.9: it costs about
what its row-only and column-only halves cost together. Its column half re-reads the tile
transposed through pointers and stores the FP8 tile through registers. Here the tile comes in
through a TMA load (``TensorDescriptor``) and either copy goes out through a TMA store (the
transposed FP8 tile written to shared memory, the bulk copy doing the rest), in variants:

- ``tma all``: TMA load, both stores TMA;
- ``ptr load``: pointer load (as the package), both stores TMA;
- ``tma load``: TMA load, pointer stores (the column tile transposed in registers).

The weights' 128x128 cast (one scale per tile, the column copy the FP8 tile transposed) is timed
the same way. Plain tensors and 8 experts (the package's segmented layout: each expert's column
copy through a descriptor made on the device). Every variant must equal the package's cast
(``triton_cast._launch``, as ``cast_tiles`` / ``cast_segments`` run it) bit for bit; prints
microseconds (median) and bandwidth over the least bytes (2 + 1 + 1 per element).
``--check`` runs the kernel under Triton's interpreter on CPU instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megatron_fp8.kernels.triton_cast import TILE, _fp8_consts, _pow2_scale, _quantize, _segment_of_row, fp8_copies
from megatron_fp8.quant.kernels import segment_offsets
from megatron_fp8.testing import same_bits

F8 = torch.float8_e4m3fn


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib


@triton.jit
def _tma_block_kernel(x_ptr, x_desc, row_desc, col_desc, row_ptr, col_ptr, row_s_ptr, col_s_ptr, seg_ptr, M, K,
                      n_seg, FMAX: tl.constexpr, F_EXP: tl.constexpr, F_MANT: tl.constexpr, OUT: tl.constexpr,
                      T: tl.constexpr, LOAD_TMA: tl.constexpr, STORE_TMA: tl.constexpr, SEG: tl.constexpr,
                      BLOCK2D: tl.constexpr):
    """One 128x128 tile of ``x [M, K]`` (M, K multiples of 128): rowwise copy and scales
    ``[K/128, M]``, columnwise copy ``[K, M]`` and scales ``[M/128, K]`` (the package's layout);
    with ``SEG`` (segments of multiples of 128 rows) the package's segmented layout: segment e's
    column copy ``[K, m_e]`` at ``K * start_e`` (a descriptor made on the device), its row scales
    ``[K/128, m_e]`` at ``start_e * K/128``."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    m0, k0 = pid_m * T, pid_k * T
    offs_m = m0 + tl.arange(0, T)
    offs_k = k0 + tl.arange(0, T)
    n_kb = K // T
    start = 0
    length = M
    if SEG:
        eid = _segment_of_row(pid_m.to(tl.int64) * T, seg_ptr, n_seg)
        start = tl.multiple_of(tl.load(seg_ptr + eid), T)
        length = tl.multiple_of(tl.load(seg_ptr + eid + 1) - start, T)
    if LOAD_TMA:
        x = x_desc.load([m0, k0]).to(tl.float32)
    else:
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]).to(tl.float32)
    a = tl.abs(x)
    if BLOCK2D:  # 128x128: one scale per tile, [M/128, K/128]; the column copy is the FP8 tile transposed
        s_b, inv_b = _pow2_scale(tl.max(tl.max(a, axis=1), axis=0), F_EXP, F_MANT)
        tl.store(row_s_ptr + pid_m * n_kb + pid_k, inv_b)
        q = _quantize(x, s_b, FMAX, OUT)
        qc = tl.trans(q)
    else:
        s_r, inv_r = _pow2_scale(tl.max(a, axis=1), F_EXP, F_MANT)  # one per row
        tl.store(row_s_ptr + start * n_kb + pid_k * length + (offs_m - start), inv_r)
        q = _quantize(x, s_r[:, None], FMAX, OUT)
        s_c, inv_c = _pow2_scale(tl.max(a, axis=0), F_EXP, F_MANT)  # one per column (over the 128 tokens)
        tl.store(col_s_ptr + pid_m * K + offs_k, inv_c)
        qc = tl.trans(_quantize(x, s_c[None, :], FMAX, OUT))  # [T(k), T(m)]
    if STORE_TMA:
        row_desc.store([m0, k0], q)
        if SEG:
            n32 = length.to(tl.int32)
            seg_desc = tl.make_tensor_descriptor(col_ptr + start * K, shape=[K, n32], strides=[n32, 1],
                                                 block_shape=[T, T])
            seg_desc.store([k0, (m0 - start).to(tl.int32)], qc)
        else:
            col_desc.store([k0, m0], qc)
    else:
        tl.store(row_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], q)
        tl.store(col_ptr + start * K + offs_k[:, None].to(tl.int64) * length + (offs_m[None, :] - start), qc)


def tma_cast(x: torch.Tensor, load_tma: bool, store_tma: bool, warps: int, offsets: torch.Tensor | None = None,
             mode: str = "1x128") -> tuple[torch.Tensor | None, ...]:
    m, k = x.shape
    if m % TILE or k % TILE:
        raise ValueError("probe: M and K multiples of 128")
    row, col = fp8_copies(x, F8, True, True, segmented=False)  # col [K, M]; flat [K * M] when segmented
    block2d = mode == "128x128"
    row_s = torch.empty((m // TILE, k // TILE) if block2d else (k // TILE * m,), dtype=torch.float32, device=x.device)
    col_s = None if block2d else torch.empty((m // TILE, k), dtype=torch.float32, device=x.device)
    fmax, f_exp, f_mant, out = _fp8_consts(F8)
    descs = [TensorDescriptor.from_tensor(t, [TILE, TILE]) for t in (x, row, col)]
    seg = offsets is not None
    _tma_block_kernel[(m // TILE, k // TILE)](x, *descs, row, col, row_s, col_s if col_s is not None else row_s,
                                              offsets if seg else x, m, k, offsets.numel() - 1 if seg else 1,
                                              FMAX=fmax, F_EXP=f_exp, F_MANT=f_mant, OUT=out, T=TILE,
                                              LOAD_TMA=load_tma, STORE_TMA=store_tma, SEG=seg, BLOCK2D=block2d,
                                              num_warps=warps)
    return row, row_s, col.view(-1) if seg else col, col_s


def _scratch(size: int, alignment: int, stream: object) -> torch.Tensor:
    """Global memory for descriptors made on the device (``tl.make_tensor_descriptor``)."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


triton.set_allocator(_scratch)


def package(x: torch.Tensor, offsets: torch.Tensor | None = None, mode: str = "1x128"
            ) -> tuple[torch.Tensor | None, ...]:
    from megatron_fp8.kernels.triton_cast import _launch

    n_seg = offsets.numel() - 1 if offsets is not None else 1
    row, row_s, col, col_s = _launch(x, F8, mode, True, True, None, offsets, n_seg, aligned=offsets is not None)
    return row, row_s, col, col_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    if a.check:
        x = (torch.randn(256, 384) * 3).bfloat16()
        x[3, 5], x[130, 200] = 1e4, 0.0
        ref = package(x)
        offs = segment_offsets([128, 128], torch.device("cpu"))
        ref_seg = package(x, offs)
        ref_2d, ref_2d_seg = package(x, None, "128x128"), package(x, offs, "128x128")
        for load_tma, store_tma in ((True, True), (False, True), (True, False)):
            print(load_tma, store_tma, "equal" if same_bits(tma_cast(x, load_tma, store_tma, 4), ref) else "DIFFER",
                  "segments", "equal" if same_bits(tma_cast(x, load_tma, store_tma, 4, offs), ref_seg) else "DIFFER",
                  "128x128", "equal" if same_bits(tma_cast(x, load_tma, store_tma, 4, None, "128x128"), ref_2d)
                  else "DIFFER", "segments", "equal" if same_bits(tma_cast(x, load_tma, store_tma, 4, offs, "128x128"),
                                                                  ref_2d_seg) else "DIFFER")
        return
    from benchlib import markdown_table, median_ms

    rows = []
    for name, (m, k, seg, mode) in {
            "x 16384x4096": (16384, 4096, False, "1x128"), "x 8 experts x 2048, K=4096": (16384, 4096, True, "1x128"),
            "dy 8 experts x 2048, N=2048": (16384, 2048, True, "1x128"),
            "dy 8 experts x 2048, N=7168": (16384, 7168, True, "1x128"),
            "w 8 experts x 2048 x 4096, 128x128": (16384, 4096, True, "128x128"),
            "w 8 experts x 7168 x 2048, 128x128": (57344, 2048, True, "128x128")}.items():
        x = (torch.randn(m, k, device="cuda") * 3).bfloat16()
        offs = segment_offsets([m // 8] * 8, torch.device("cuda")) if seg else None
        least = m * k * 4
        ref = package(x, offs, mode)
        us = median_ms(lambda: package(x, offs, mode)) * 1e3  # noqa: B023
        rows.append([name, "package", f"{us:.1f}", f"{least / us / 1e3:.0f}", "ref"])
        print(rows[-1], flush=True)
        for label, load_tma, store_tma in (("tma all", True, True), ("ptr load", False, True),
                                           ("tma load", True, False)):
            for warps in (4, 8):
                try:
                    same = same_bits(tma_cast(x, load_tma, store_tma, warps, offs, mode), ref)
                    us = median_ms(lambda: tma_cast(x, load_tma, store_tma, warps, offs, mode)) * 1e3  # noqa: B023
                    rows.append([name, f"{label}, {warps} warps", f"{us:.1f}", f"{least / us / 1e3:.0f}",
                                 "equal" if same else "DIFFER"])
                except Exception as exc:  # a probe: report and go on
                    rows.append([name, f"{label}, {warps} warps", "failed", str(exc)[:80].replace("|", "/"), ""])
                print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}\n")
    print(markdown_table(["tensor", "cast", "us", "GB/s over least bytes", "bits"], rows))


if __name__ == "__main__":
    main()
