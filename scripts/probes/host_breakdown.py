"""Probe: where the host time of one eager ``Linear`` fwd+bwd goes, per recipe, at the host-cost
table's shape (T=256, K=N=2048, BF16), beside BF16 ``nn.Linear`` (``bf16``).

``--tool torch`` (default): torch.profiler, CPU activity: self CPU time per aten op, per CUDA
runtime/driver call and per autograd function (its own Python). ``--tool cprofile``: the
Python functions by own time. Found on the H200 (docs/benchmarks.md run AD): our autograd
function's own Python ~490 us a step, torch's ``_scaled_mm`` ~75 us a call.

The ``grouped-*`` cases do the same for the host-cost table's grouped rows (8 experts x 256
tokens, K=N=2048): ``grouped-bf16`` is ``torch._grouped_mm`` on one ``[8, N, K]`` weight,
``grouped-off`` our ``GroupedLinear`` with FP8 off (the table's 1605 against 246 us in run AD,
with the same ``_grouped_mm`` calls: the profile says where the rest goes), ``grouped-current``
and ``grouped-blockwise`` with FP8, ``grouped-router-current`` with a new top-2 router split each
step (``profile_host.py``'s router rows: 2390 against 1526 us for even splits in run AF).
Grads are not reset between steps, as in the table.

    python scripts/probes/host_breakdown.py [bf16 current blockwise delayed grouped-bf16 grouped-off
        grouped-current grouped-blockwise grouped-router-current] [--tool torch|cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import megatron_fp8 as mf
from megatron_fp8.recipe import PRESETS
from megatron_fp8.testing import router_splits


def make_grouped_step(name: str, device: str) -> Callable[[], None]:
    """One fwd+bwd of the grouped case ``grouped-<bf16|off|recipe>`` (module docstring)."""
    from megatron_fp8.modules.grouped import GroupedLinear

    e, t, k, n, dt = 8, 256, 2048, 2048, torch.bfloat16
    x = torch.randn(e * t, k, dtype=dt, device=device, requires_grad=True)
    dy = torch.randn(e * t, n, dtype=dt, device=device)
    kind = name.removeprefix("grouped-")
    routed = kind.startswith("router-")  # grouped-router-<recipe>: a new router split each step
    kind = kind.removeprefix("router-")
    splits = [router_splits(e * t, e, 2, seed=s) for s in range(16)] if routed else [[t] * e]
    turn = itertools.cycle(splits)
    if kind == "bf16":
        w = torch.randn(e, n, k, dtype=dt, device=device, requires_grad=True)
        # made before the steps, as _grouped_mm's caller would hold them
        offs_turn = itertools.cycle([torch.tensor(sp, device=device).cumsum(0).to(torch.int32) for sp in splits])

        def ref() -> None:
            torch._grouped_mm(x, w.transpose(-2, -1), offs=next(offs_turn)).backward(dy)
        return ref
    layer = GroupedLinear(e, k, n, bias=False, params_dtype=dt, device=device)
    recipe = None if kind == "off" else PRESETS[kind]

    def step() -> None:
        if recipe is None:
            y = layer(x, next(turn))
        else:
            with mf.fp8_autocast(fp8_recipe=recipe):
                y = layer(x, next(turn))
        y.backward(dy)
    return step


def make_step(name: str, device: str) -> Callable[[], None]:
    """One fwd+bwd of a fresh layer: ``nn.Linear`` for ``bf16``, ours under preset ``name``, or
    a grouped case (``make_grouped_step``)."""
    if name.startswith("grouped-"):
        return make_grouped_step(name, device)
    if name == "bf16":
        layer: torch.nn.Module = torch.nn.Linear(2048, 2048, bias=False, dtype=torch.bfloat16, device=device)
    else:
        layer = mf.Linear(2048, 2048, bias=False, params_dtype=torch.bfloat16, device=device)
    recipe = PRESETS.get(name)
    x = torch.randn(256, 2048, dtype=torch.bfloat16, device=device, requires_grad=True)
    dy = torch.randn(256, 2048, dtype=torch.bfloat16, device=device)

    def step() -> None:
        if recipe is None:
            y = layer(x)
        else:
            with mf.fp8_autocast(fp8_recipe=recipe):
                y = layer(x)
        y.backward(dy)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipes", nargs="*", default=["bf16", "current", "blockwise", "delayed"])
    ap.add_argument("--tool", choices=("torch", "cprofile"), default="torch")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for name in args.recipes:
        step = make_step(name, device)
        for _ in range(10):
            step()
        sync()
        print(f"===== {name}: {args.steps} steps ({args.tool})")
        if args.tool == "cprofile":
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.steps):
                step()
            sync()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(args.rows)
            pstats.Stats(pr).sort_stats("cumulative").print_stats("megatron_fp8", args.rows)
            continue
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
            sync()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
