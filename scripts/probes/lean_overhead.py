"""Probe: the lean path's own Python per eager ``Linear`` fwd+bwd, on any machine: every cast and
GEMM route replaced by a stub that hands back preallocated outputs (no kernel, no matmul), beside
BF16 ``nn.Linear``'s fwd+bwd (real matmuls) at the same small shape. What is left is the module
call, the plan lookup, the autograd function and the engine: the part of a step's host time
that no kernel or launch change touches. Found on the CPU (2026-12-05, 16x128x128, BF16, grads
reset each step): 88-117 us against 122-130 for ``nn.Linear`` with its CPU matmuls (two runs),
73 with the FP8 weight reused; not a GPU number.

    python scripts/probes/lean_overhead.py [--recipe current] [--cached] [--profile]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib

import torch  # noqa: E402
from benchlib import own_time_profile, train_step, wall_us  # noqa: E402

import megatron_fp8 as mf  # noqa: E402
from megatron_fp8.ops import routes  # noqa: E402
from megatron_fp8.recipe import PRESETS  # noqa: E402


def stub_routes() -> None:
    """Every cast and GEMM route a no-op that returns buffers made once (per signature), on the
    operands' device (also used by ``host_floor.py`` on a GPU)."""
    def cast(q: Any, x: torch.Tensor, rowwise: bool, columnwise: bool) -> Any:
        m, k = x.shape
        row = torch.empty(m, k, dtype=q.fp8_dtype, device=x.device)
        col = torch.empty(k, m, dtype=q.fp8_dtype, device=x.device)
        s = torch.ones((), device=x.device)
        return lambda x: (row, s, col, s, s)

    def gemm(name: str, a: Any, b: Any, out_dtype: torch.dtype, fast_accum: bool) -> Any:
        out = torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=a.data.device)
        return lambda a, sa, b, sb: out

    routes._fast_cast = cast  # type: ignore[assignment]
    routes.gemm_route = gemm  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="current", choices=["current", "blockwise", "delayed"])
    ap.add_argument("--cached", action="store_true", help="reuse the FP8 weight (later micro-batches)")
    ap.add_argument("--profile", action="store_true", help="cProfile of 1000 steps, by own time")
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args()
    os.environ.setdefault("MEGATRON_FP8_LEAN", "1")  # plans on this device too (read at each call)
    stub_routes()
    t, k, n = 16, 128, 128
    layer = mf.Linear(k, n, bias=False, params_dtype=torch.bfloat16)
    ref = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    x = torch.randn(t, k, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, n, dtype=torch.bfloat16)
    recipe = PRESETS[args.recipe]
    if args.cached:  # the first step casts the weight, later ones reuse it (Megatron's attribute)
        layer.is_first_microbatch = True
    ours, bf16 = train_step(layer, x, dy, recipe), train_step(ref, x, dy)
    print(f"nn.Linear fwd+bwd {wall_us(bf16, args.steps, warmup=50):.1f} us; our Linear, {args.recipe}, routes "
          f"stubbed {wall_us(ours, args.steps, warmup=50):.1f} us")
    if args.profile:
        print(own_time_profile(ours, 1000, 25))


if __name__ == "__main__":
    main()
