"""Probe (GPU): the tile casts as a CUDA C kernel (``megatron_fp8/kernels/cuda_cast.cu``, NVRTC).

    python scripts/probe_cuda_cast.py

One block of 256 threads owns a 128x128 tile: it loads the tile once (16-byte vectors, all
issued before use), casts the rowwise copy from registers, parks the BF16 tile in shared memory,
takes each column's amax from there, writes the FP8 tile transposed into shared memory and
stores it out 128 bytes a warp. Compiled by ``torch.cuda._compile_kernel`` for 1x128, 128x128
and tensor (given each expert's scale) in build variants: blocks an SM (``MINB`` 3 or 4: 80 or
64 registers), ``KFAST`` (a grid with the K tiles fastest, so that neighbouring blocks read
neighbouring pieces of the same rows), ``STREAM`` (evict-first FP8 stores) and ``NOCLAMP`` (no
clamp before the conversion, whose ``.satfinite`` does its work). The package builds
``(3, KFAST, STREAM, NOCLAMP)`` since 2026-12-03 (docs/benchmarks.md run W: the three switches
together took x 16384x4096 from 88 to 78 us); the first build (3 blocks, no switches) is kept
for comparison. Two more variants measured slower and are left in git history (run V):
persistent blocks fetching their next tile with ``cp.async``, and the FP8 tile in a shared
buffer of its own.

Every variant must equal the package's Triton cast (``triton_cast._launch`` with the CUDA path
off, as ``cast_tiles`` / ``cast_segments`` run it) bit for bit, with zeros, a large value, NaN
and an infinity planted in x. That reference keeps the clamp before its conversion
(``MEGATRON_FP8_CAST_CLAMP=1``, set here), the CPU reference's arithmetic, so the no-clamp
builds are checked against it. Times each cast replayed from a CUDA graph (no host launch cost
in the figure): microseconds (median, L2 flushed) and bandwidth over the least bytes (2 + 1 + 1
per element).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

os.environ["MEGATRON_FP8_CAST_CLAMP"] = "1"  # the Triton reference clamps (read when triton_cast is imported)
from megatron_fp8.kernels.cuda_cast import MODES  # noqa: E402
from megatron_fp8.kernels.triton_cast import TILE, _launch, fp8_copies  # noqa: E402
from megatron_fp8.quant.kernels import segment_offsets  # noqa: E402
from megatron_fp8.testing import capture_step, same_bits  # noqa: E402

F8 = torch.float8_e4m3fn
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib


SRC = Path(__file__).parents[1] / "megatron_fp8" / "kernels" / "cuda_cast.cu"
# (blocks an SM, KFAST, STREAM, NOCLAMP): the package's build first, then its first build and each
# switch alone
VARIANTS = ((3, 1, 1, 1), (3, 0, 0, 0), (3, 1, 0, 0), (3, 0, 1, 0), (3, 0, 0, 1), (4, 0, 0, 1))


@functools.cache
def _kernel(mode: str, minb: int, kfast: int = 0, stream: int = 0, noclamp: int = 0):
    return torch.cuda._compile_kernel(SRC.read_text(), "cast_tile",
                                      nvcc_options=[f"-DMODE={MODES[mode]}", f"-DMINB={minb}", "-DE5M2=0",
                                                    f"-DKFAST={kfast}", f"-DSTREAM={stream}", f"-DNOCLAMP={noclamp}"])


def cuda_cast(x: torch.Tensor, mode: str, offsets: torch.Tensor | None, tscale: torch.Tensor | None,
              minb: int, kfast: int = 0, stream: int = 0, noclamp: int = 0) -> tuple[torch.Tensor | None, ...]:
    m, k = x.shape
    if m % TILE or k % TILE:
        raise ValueError("probe: M and K multiples of 128")
    seg = offsets is not None
    row, col = fp8_copies(x, F8, True, True, segmented=seg)
    row_s = col_s = None
    if mode == "1x128":
        row_s = torch.empty((k // TILE * m,), dtype=torch.float32, device=x.device)
        col_s = torch.empty((m // TILE, k), dtype=torch.float32, device=x.device)
    elif mode == "128x128":  # the tile scales, and the same transposed per segment
        row_s = torch.empty((m // TILE, k // TILE), dtype=torch.float32, device=x.device)
        col_s = torch.empty((m // TILE * (k // TILE),), dtype=torch.float32, device=x.device)
    dummy = x
    args = [x, row, row_s if row_s is not None else dummy, col, col_s if col_s is not None else dummy,
            offsets if seg else dummy, tscale if tscale is not None else dummy, m, k,
            offsets.numel() - 1 if seg else 0]
    grid = (k // TILE, m // TILE, 1) if kfast else (m // TILE, k // TILE, 1)
    _kernel(mode, minb, kfast, stream, noclamp)(grid=grid, block=(256, 1, 1), args=args)
    if mode == "128x128":  # the Triton cast writes no transposed scales: check them here, return its four
        e = offsets.numel() - 1 if seg else 1
        want = row_s.view(e, m // e // TILE, k // TILE).transpose(1, 2).reshape(-1)
        if not torch.equal(col_s, want):
            raise AssertionError("probe: the transposed 128x128 scales differ from the tile scales")
        col_s = None
    return row, row_s, col, col_s


def package(x: torch.Tensor, mode: str, offsets: torch.Tensor | None, tscale: torch.Tensor | None
            ) -> tuple[torch.Tensor | None, ...]:
    """The package's Triton cast (its CUDA path turned off; with the clamp, set above)."""
    n_seg = offsets.numel() - 1 if offsets is not None else 1
    os.environ["MEGATRON_FP8_CUDA_CAST"] = "0"
    try:
        return _launch(x, F8, mode, True, True, tscale, offsets, n_seg, aligned=offsets is not None)
    finally:
        del os.environ["MEGATRON_FP8_CUDA_CAST"]


def _scales(n: int) -> torch.Tensor:
    """Per-expert tensor scales 16 bytes apart (``SCALE_STRIDE``), as the package keeps them."""
    s = torch.zeros(n * 4, dtype=torch.float32, device="cuda")
    s[::4] = torch.rand(n, device="cuda") * 4 + 0.5
    return s


def _graphed_us(fn) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph."""
    from benchlib import median_ms

    graph, _ = capture_step(fn)
    return median_ms(graph.replay) * 1e3


def main() -> None:
    from benchlib import markdown_table

    torch.manual_seed(0)
    rows = []
    cases = {
        "x 16384x4096": (16384, 4096, 1, "1x128"),
        "x 8 experts x 2048, K=4096": (16384, 4096, 8, "1x128"),
        "dy 8 experts x 2048, N=2048": (16384, 2048, 8, "1x128"),
        "dy 8 experts x 2048, N=7168": (16384, 7168, 8, "1x128"),
        "x 8 experts, K=2048": (16384, 2048, 8, "1x128"),
        "w 8 x 2048 x 4096, 128x128": (16384, 4096, 8, "128x128"),
        "w 8 x 7168 x 2048, 128x128": (57344, 2048, 8, "128x128"),
        "x 8 experts, K=4096, tensor": (16384, 4096, 8, "tensor"),
        "w 8 x 2048 x 4096, tensor": (16384, 4096, 8, "tensor"),
        "dy 8 experts, N=2048, tensor": (16384, 2048, 8, "tensor"),
        "32 experts x 512, K=4096, 1x128": (16384, 4096, 32, "1x128"),
        "6 experts, 2 empty, K=4096, 1x128": (16384, 4096, [0, 4096, 2048, 0, 8192, 2048], "1x128"),
        "6 experts, 2 empty, K=4096, tensor": (16384, 4096, [0, 4096, 2048, 0, 8192, 2048], "tensor"),
    }
    for name, (m, k, experts, mode) in cases.items():
        splits = experts if isinstance(experts, list) else [m // experts] * experts
        n_exp = len(splits)
        x = (torch.randn(m, k, device="cuda") * 3).bfloat16()
        x[5, 7], x[300, 129], x[1000, :128], x[9, 11] = float("inf"), 3e4, 0.0, float("nan")
        offs = segment_offsets(splits, torch.device("cuda")) if n_exp > 1 else None
        tscale = _scales(n_exp) if mode == "tensor" else None
        least = m * k * 4
        ref = package(x, mode, offs, tscale)
        clone_us = _graphed_us(lambda: x.clone())  # noqa: B023
        rows.append([name, "clone (same bytes moved)", f"{clone_us:.1f}", f"{least / clone_us / 1e3:.0f}", "-"])
        us = _graphed_us(lambda: package(x, mode, offs, tscale))  # noqa: B023
        rows.append([name, "package (Triton, clamp)", f"{us:.1f}", f"{least / us / 1e3:.0f}", "ref"])
        print(rows[-1], flush=True)
        for variant in VARIANTS:
            minb, kfast, stream, noclamp = variant
            label = (f"CUDA, {minb} blocks/SM" + (", K-fast grid" if kfast else "") + (", .cs stores" if stream else "")
                     + (", no clamp" if noclamp else ""))
            try:
                same = same_bits(cuda_cast(x, mode, offs, tscale, *variant), ref)
                us = _graphed_us(lambda: cuda_cast(x, mode, offs, tscale, *variant))  # noqa: B023
                rows.append([name, label, f"{us:.1f}", f"{least / us / 1e3:.0f}", "equal" if same else "DIFFER"])
            except Exception as exc:  # a probe: report and go on
                rows.append([name, label, "failed", str(exc)[:80].replace("|", "/"), ""])
            print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print(markdown_table(["tensor", "cast", "us", "GB/s over least bytes", "bits"], rows))


if __name__ == "__main__":
    main()
