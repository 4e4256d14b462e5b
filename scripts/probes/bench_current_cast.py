"""Current-scaling casts (GPU): the two-launch cast (amax pass, then cast) against the one-launch
persistent cast (``quant/triton_persistent.py``) at 1 and 2 programs per SM, on the tensors of the
grouped benchmark (8 experts x 2048 tokens) and of the Linear benchmark. Checks that both
give the same bits, then prints a table: median us (CUDA events, L2 flushed between runs by
``do_bench``) and the bandwidth over the fewest bytes a cast must move (input read once, each
FP8 copy written once).

    python scripts/bench_current_cast.py
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib
from benchlib import markdown_table, median_ms

from megatron_fp8.kernels import triton_cast, triton_persistent
from megatron_fp8.quant import kernels
from megatron_fp8.testing import same_bits

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2

# name, rows, cols, splits (None: one tensor), fp8 format, rowwise, columnwise
CASES = [
    ("experts x (or w), 8x2048x4096", 16384, 4096, [2048] * 8, E4, True, True),
    ("experts dy, N=2048", 16384, 2048, [2048] * 8, E5, True, True),
    ("experts x, K=2048", 16384, 2048, [2048] * 8, E4, True, True),
    ("experts w, 8x7168x2048", 57344, 2048, [7168] * 8, E4, True, True),
    ("experts dy, N=7168", 16384, 7168, [2048] * 8, E5, True, True),
    ("experts x rowwise only (flag on)", 16384, 4096, [2048] * 8, E4, True, False),
    # column-only with its own amax: dy where no dgrad runs (a flagged layer's backward casts x
    # column-only with the forward's scale, one pass: not a current cast); run T timed it at
    # 96.3 us in two launches, 102.5 in one
    ("experts columnwise only", 16384, 4096, [2048] * 8, E4, False, True),
    ("Linear columnwise only", 16384, 4096, None, E4, False, True),
    ("32 experts x 512, K=4096", 16384, 4096, [512] * 32, E4, True, True),
    ("Linear x 16384x4096", 16384, 4096, None, E4, True, True),
    ("Linear w 14336x4096", 14336, 4096, None, E4, True, True),
    ("Linear dy 16384x14336", 16384, 14336, None, E5, True, True),
    ("small 1024x1024", 1024, 1024, None, E4, True, True),
]


def _cast(x: torch.Tensor, splits: list[int] | None, off: torch.Tensor | None, dtype: torch.dtype, row: bool,
          col: bool, one: bool) -> tuple[object, ...]:
    return triton_cast.cast_current(x, dtype, row, col, splits=splits, offsets=off, one_launch=one)


def main() -> None:
    rows = []
    for name, m, k, splits, dtype, row, col in CASES:
        x = (torch.randn(m, k, device="cuda") * 3).bfloat16()
        off = kernels.segment_offsets(splits, x.device) if splits else None
        two = _cast(x, splits, off, dtype, row, col, False)
        times = {"two launches": median_ms(functools.partial(_cast, x, splits, off, dtype, row, col, False))}
        for per_sm in (1, 2):
            triton_persistent.PROGRAMS_PER_SM = per_sm
            one = _cast(x, splits, off, dtype, row, col, True)
            if not same_bits(one, two):
                raise SystemExit(f"{name}: one-launch cast differs from the two-launch cast ({per_sm}/SM)")
            times[f"one launch, {per_sm}/SM"] = median_ms(functools.partial(_cast, x, splits, off, dtype, row, col,
                                                                            True))
        triton_persistent.PROGRAMS_PER_SM = 2
        least = m * k * (2 + int(row) + int(col))
        best = min(times.values())
        rows.append([name, f"{least / 1e6:.0f}", *(f"{v * 1e3:.1f}" for v in times.values()),
                     f"{times['two launches'] / best:.2f}", f"{least / best / 1e6:.0f}"])
        print(rows[-1], flush=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(markdown_table(["tensor", "least MB", "two launches us", "one launch 1/SM us", "one launch 2/SM us",
                          "two / best", "best GB/s over least bytes"], rows))


if __name__ == "__main__":
    main()
