"""Cast-cost breakdown (GPU): time each quantizer call of a Linear step, compiled and eager,
against the bytes it must move. Prints a table; used to find where the Linear loses time.

    python scripts/profile_casts.py [--shape M,N,K] [--warps 4 8 16]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib
from benchlib import markdown_table, median_ms

from megatron_fp8.kernels import triton_tiles
from megatron_fp8.quant import make_quantizer
from megatron_fp8.recipe import PRESETS, TensorRole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="16384,14336,4096")
    ap.add_argument("--recipes", nargs="*", default=["current", "blockwise"])
    ap.add_argument("--backends", nargs="*", default=["auto"])
    ap.add_argument("--warps", nargs="*", type=int, default=[triton_tiles.CAST_WARPS],
                    help="warps per cast tile to compare (triton_tiles.CAST_WARPS; 0: its rule)")
    args = ap.parse_args()
    m, n, k = (int(v) for v in args.shape.split(","))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    rows = []
    for backend, warps in ((b, w) for b in args.backends for w in args.warps):
        os.environ["MEGATRON_FP8_CAST_BACKEND"] = backend
        triton_tiles.CAST_WARPS = warps
        for rname in args.recipes:
            r = PRESETS[rname]
            for role, t, kw in ((TensorRole.INPUT, x, dict(rowwise=True, columnwise=True)),
                                (TensorRole.INPUT, x, dict(rowwise=True, columnwise=False)),
                                (TensorRole.INPUT, x, dict(rowwise=False, columnwise=True)),
                                (TensorRole.WEIGHT, w, dict(rowwise=True, columnwise=True)),
                                (TensorRole.GRAD_OUTPUT, dy, dict(rowwise=True, columnwise=True))):
                q = make_quantizer(r, role)
                ms = median_ms(lambda q=q, t=t, kw=kw: q.quantize(t, **kw), rep_ms=100)
                copies = int(kw["rowwise"]) + int(kw["columnwise"])
                nbytes = t.numel() * (2 + copies)
                rows.append([backend, warps or "rule", rname, role.value,
                             f"{'r' if kw['rowwise'] else ''}{'c' if kw['columnwise'] else ''}",
                             ms * 1e3, nbytes / ms / 1e6])
                print(rows[-1], flush=True)
    print(markdown_table(["casts", "warps", "recipe", "tensor", "copies", "us", "GB/s"], rows))


if __name__ == "__main__":
    main()
