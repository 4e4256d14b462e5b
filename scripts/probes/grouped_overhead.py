"""Probe: a ``GroupedLinear`` fwd+bwd's own Python and autograd-engine time, on any machine: under
``TRITON_INTERPRET=1`` the casts and GEMMs take the Triton routes an eager CUDA step takes (less
the CUDA-only casts: the one-launch current cast, the CUDA tile cast), and every Triton launch
is a no-op, so what is timed is everything around the kernels. Run it with Triton importable
(CI's interpreter environment: ``PYTHONPATH=.ci/.triton``).

Found on the CPU (2026-12-05, 8 experts x 128 tokens, K=N=256, BF16, weights cached, grads
reset each step): 472 us per fwd+bwd for current scaling, 373 for blockwise, 714 for delayed
(readings move ~20% between runs). Under cProfile (current) the autograd engine's own time is
~8%, ``torch.empty`` (13 calls a step) ~6%, no Python function more than ~3% of its own; 21
environment reads and 16 quantizer-config comparisons a step. A lean path for the grouped layer
would have to remove most of these small costs; there is no one hot spot.

With the lean grouped path (``ops/lean_grouped.py``; ``MEGATRON_FP8_LEAN=1`` lets it run on CPU
under the interpreter; same day, same machine, two processes each): current 301 / 295 us against
469 / 440 without it, blockwise 238 / 331 against 357 / 360; delayed (once it served delayed
scaling too; one process each) 494 against 653. What is left under cProfile
(current): the autograd engine ~12%, the cast's own dispatch (``_current_launches``) and Triton
wrapper ~25%, ``torch.empty`` (13 calls) ~9%.

    [MEGATRON_FP8_LEAN=1] PYTHONPATH=.ci/.triton python scripts/probes/grouped_overhead.py \
        [current|blockwise|delayed] [--profile]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before the package reads it
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib

import torch  # noqa: E402
from benchlib import own_time_profile, train_step, wall_us  # noqa: E402

from megatron_fp8.kernels import triton_launch  # noqa: E402

triton_launch.Launcher.__call__ = lambda self, grid, *a, **k: None  # type: ignore[method-assign]

from megatron_fp8.modules.grouped import GroupedLinear  # noqa: E402
from megatron_fp8.recipe import PRESETS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", nargs="?", default="current", choices=["current", "blockwise", "delayed"])
    ap.add_argument("--profile", action="store_true", help="cProfile of 200 steps, by own time")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    e, t, k, n = 8, 128, 256, 256
    recipe = PRESETS[args.recipe]
    layer = GroupedLinear(e, k, n, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(e * t, k, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(e * t, n, dtype=torch.bfloat16)
    layer.is_first_microbatch = True  # the first step casts the weights, later ones reuse them
    step = train_step(layer, x, dy, recipe, splits=[t] * e)
    print(f"GroupedLinear, {args.recipe}: {wall_us(step, args.steps, warmup=20):.0f} us per fwd+bwd "
          f"(Triton launches stubbed)")
    if args.profile:
        print(own_time_profile(step, 200, 35))


if __name__ == "__main__":
    main()
