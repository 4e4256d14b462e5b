"""save_original_input, shown: an attention core whose output feeds a projection Linear.

For each recipe, run the projection with the flag off and on, and print the saved-activation
bytes of each module (from ``megatron_fp8.memory``), the difference, and the max |difference| of
the output and of every gradient between the two runs (RECIPES.md requires exactly 0).

    python examples/save_original_input.py [--tokens 2048] [--hidden 1024]
"""

from __future__ import annotations

import argparse

import torch

import megatron_fp8 as mf
from megatron_fp8.recipe import PRESETS
from megatron_fp8.testing import AttentionCore


def run(recipe_name: str, flag: bool, x: torch.Tensor, hidden: int) -> tuple[dict[str, int], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "attn": AttentionCore(),
        "proj": mf.Linear(hidden, hidden, params_dtype=torch.bfloat16, save_original_input=flag),
    })
    x = x.detach().requires_grad_()
    with mf.memory.track_saved_tensors(model) as saved, mf.fp8_autocast(fp8_recipe=PRESETS[recipe_name]):
        y = model["proj"](model["attn"](x))
    by_module = saved.by_module(activations_only=True)
    y.float().square().mean().backward()
    return by_module, [y, x.grad, model["proj"].weight.grad, model["proj"].bias.grad]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()
    x = torch.randn(args.tokens, args.hidden, dtype=torch.bfloat16)
    print(f"attention core -> proj Linear({args.hidden}, {args.hidden}), x [{args.tokens}, {args.hidden}] bf16, "
          f"saved activation bytes (FP8 weight copies excluded)\n")
    head = f"{'recipe':10s} {'attn':>10s} {'proj off':>10s} {'proj on':>8s} {'saved':>10s}  max|diff| out, dx, dw, db"
    print(head)
    print("-" * len(head))
    worst = 0.0
    for name in ("delayed", "current", "blockwise", "mxfp8"):
        off, res_off = run(name, False, x, args.hidden)
        on, res_on = run(name, True, x, args.hidden)
        diffs = [float((a.detach().float() - b.detach().float()).abs().max()) for a, b in zip(res_off, res_on)]
        worst = max(worst, *diffs)
        p_on = on.get("proj", 0)
        print(f"{name:10s} {off['attn']:10d} {off['proj']:10d} {p_on:8d} {off['proj'] - p_on:10d}  "
              + ", ".join(f"{d:g}" for d in diffs))
    print("\nThe flagged projection saves only the attention output the attention core already keeps "
          "(plus a 4-byte scale for per-tensor recipes);\nthe flag-off projection keeps a columnwise FP8 copy of it.")
    if worst != 0.0:
        raise SystemExit(f"save_original_input changed the numbers (max |diff| {worst})")


if __name__ == "__main__":
    main()
