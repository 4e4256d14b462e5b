"""Host cost of one eager GroupedLinear (or, ``--layer linear``, Linear) training step under two
checkouts of the package, in one process (GPU): each checkout is imported under its own copy of
the module tree, and their steps alternate round by round, so a drift of the machine's host
speed (measured at up to ~35% between processes on the device) hits both alike. Prints host and
device ms per step (median over rounds, and the spread) and the ratio new / old per round.

    python scripts/probes/ab_host.py --old _ab/old --new . [--experts 8] [--tokens 2048] [--rounds 15] [--router]
    python scripts/probes/ab_host.py --old _ab/old --new . --layer linear --tokens 256 --k 2048 --n 2048
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib
from benchlib import host_and_device_ms, markdown_table, train_step


def _ours() -> dict[str, Any]:
    return {m: mod for m, mod in sys.modules.items() if m == "megatron_fp8" or m.startswith("megatron_fp8.")}


def _load(root: str) -> dict[str, Any]:
    """The package at ``root`` imported fresh (its own module objects, every submodule imported
    now: the package imports some lazily, by name, and ``_use`` puts this tree back in
    ``sys.modules`` before its steps run)."""
    for name in _ours():
        del sys.modules[name]
    sys.path.insert(0, root)
    try:
        import megatron_fp8
        from megatron_fp8 import Linear, fp8_autocast
        from megatron_fp8.modules.grouped import GroupedLinear
        from megatron_fp8.recipe import PRESETS

        for info in pkgutil.walk_packages(megatron_fp8.__path__, "megatron_fp8."):
            try:
                importlib.import_module(info.name)
            except ImportError:  # optional dependencies (megatron-core)
                pass
    finally:
        sys.path.remove(root)
    return {"GroupedLinear": GroupedLinear, "Linear": Linear, "PRESETS": PRESETS, "fp8_autocast": fp8_autocast,
            "modules": _ours()}


def _use(mod: dict[str, Any]) -> None:
    sys.modules.update(mod["modules"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True)
    p.add_argument("--new", required=True)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--recipes", nargs="*", default=["current", "blockwise"])
    p.add_argument("--layer", choices=("grouped", "linear"), default="grouped",
                   help="linear: a Linear(k, n) on --tokens tokens (--experts and --ragged unused)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--flag", action="store_true", help="save_original_input=True on both layers")
    p.add_argument("--ragged", type=int, default=0, metavar="MULTIPLE",
                   help="uneven token counts, each a multiple of MULTIPLE (seeded; the same total)")
    p.add_argument("--router", action="store_true",
                   help="a new top-2 router split of the same total each step (16 in turn), as profile_host.py's "
                        "router rows")
    args = p.parse_args()
    splits: list[int] | None = [args.tokens] * args.experts
    if args.ragged:
        g = torch.Generator().manual_seed(0)
        units = args.experts * args.tokens // args.ragged
        cuts = sorted(torch.randint(0, units + 1, (args.experts - 1,), generator=g).tolist())
        splits = [(b - a) * args.ragged for a, b in zip([0, *cuts], [*cuts, units])]
    routed = None
    if args.router:
        from megatron_fp8.testing import router_splits

        routed = [router_splits(sum(splits), args.experts, 2, seed=s) for s in range(16)]  # (--ragged's total too)
    if args.layer == "linear":
        splits = routed = None
    rows = args.tokens if splits is None else sum(splits)
    x = torch.randn(rows, args.k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, args.n, device="cuda", dtype=torch.bfloat16) * 1e-3
    steps, trees = {}, {}
    for tag, root in (("old", args.old), ("new", args.new)):
        mod = trees[tag] = _load(root)
        for rname in args.recipes:
            torch.manual_seed(0)
            if splits is None:
                layer = mod["Linear"](args.k, args.n, bias=False, params_dtype=torch.bfloat16, device="cuda",
                                      save_original_input=args.flag)
            else:
                layer = mod["GroupedLinear"](args.experts, args.k, args.n, bias=False, params_dtype=torch.bfloat16,
                                             device="cuda", save_original_input=args.flag)
            steps[(rname, tag)] = train_step(layer, x, dy, mod["PRESETS"][rname], splits,  # type: ignore[index]
                                             autocast=mod["fp8_autocast"], routed=routed)
    got: dict[tuple[str, str], list[tuple[float, float]]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for key, step in steps.items():
            _use(trees[key[1]])
            got[key].append(host_and_device_ms(step, 20))
    rows = []
    for rname in args.recipes:
        for tag in ("old", "new"):
            host = [h for h, _ in got[(rname, tag)]]
            dev = [d for _, d in got[(rname, tag)]]
            rows.append([rname, tag, statistics.median(host), (max(host) - min(host)) / statistics.median(host),
                         statistics.median(dev)])
        ratios = [n[0] / o[0] for n, o in zip(got[(rname, "new")], got[(rname, "old")])]
        rows.append([rname, "new / old host, median of rounds", statistics.median(ratios),
                     (max(ratios) - min(ratios)), "-"])
    what = (f"Linear, {args.tokens} tokens" if splits is None else
            f"{args.experts} experts, {len(routed)} router splits of {sum(splits)} rows in turn" if routed else
            f"{args.experts} experts, splits {splits}")
    print(f"{what}, K={args.k}, N={args.n}, save_original_input={args.flag}, "
          f"{args.rounds} rounds of 20 steps")
    print(markdown_table(["recipe", "checkout", "host ms/step", "spread", "device ms/step"], rows))


if __name__ == "__main__":
    main()
