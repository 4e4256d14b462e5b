"""Probe: inclusive host time per step of named functions inside one eager layer step, by
wrapping each with two clock reads (no profiler: ~0.3 us per wrapped call). For the grouped
rows of the host-cost table (``host_breakdown.make_step``'s cases, e.g. ``grouped-current``,
``grouped-router-current``, ``grouped-off``): which part of the forward, the backward's Python
and the autograd engine's own work (the step minus both) the time goes to.

    python scripts/probes/host_sections.py grouped-off grouped-current grouped-router-current \
        [--steps 200] [--caller] [--deep] [--wrap module:qualname ...]
    python scripts/probes/host_sections.py current blockwise delayed    # a Linear's step (LINEAR)
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from host_breakdown import make_step

DEFAULT = [
    "megatron_fp8.modules.grouped:ExpertParams.fp8_operands",
    "megatron_fp8.modules.grouped:ExpertParams._fp8_weights",
    "megatron_fp8.ops.grouped_linear:grouped_linear",
    "megatron_fp8.ops.grouped_linear:check_m_splits",
    "megatron_fp8.ops.padding:expert_rows",
    "megatron_fp8.ops.lean_grouped:grouped_plan_for",
    "megatron_fp8.ops.lean_grouped:lean_grouped",
    "megatron_fp8.ops.lean_grouped:LeanGrouped.forward",
    "megatron_fp8.ops.lean_grouped:LeanGrouped.backward",
    "megatron_fp8.ops.lean_grouped:_gradients",
    "megatron_fp8.ops.lean_grouped:_cast",
    "megatron_fp8.ops.lean_grouped:_rows_gemm",
    "megatron_fp8.ops.lean_grouped:save_for_gradients",
    "megatron_fp8.kernels.triton_grouped:grouped_kgroup",
    "megatron_fp8.quant.kernels:segment_offsets",
    "megatron_fp8.ops.grouped_linear:_GroupedLinear.forward",
    "megatron_fp8.ops.grouped_linear:_GroupedLinear.backward",
]
# a ``Linear`` step's (cases ``current``, ``blockwise``, ``delayed``: the host table's dense rows)
LINEAR = [
    "megatron_fp8.modules.linear:Linear.forward",
    "megatron_fp8.modules.base:FP8Module.fp8_quantizers",
    "megatron_fp8.modules.base:FP8Module.fp8_weight",
    "megatron_fp8.ops.linear:cast_weight",
    "megatron_fp8.ops.linear:linear",
    "megatron_fp8.ops.graphed:graph_for",
    "megatron_fp8.ops.lean:plan_for",
    "megatron_fp8.ops.lean:lean_linear",
    "megatron_fp8.ops.lean:LeanLinear.forward",
    "megatron_fp8.ops.lean:LeanLinear.backward",
    "megatron_fp8.ops.lean:_gradients",
    "megatron_fp8.ops.lean:save_for_gradients",
    "megatron_fp8.kernels.triton_launch:Prepared.__call__",
    "megatron_fp8.kernels.triton_launch:Launcher.__call__",
    "megatron_fp8.kernels.triton_persistent:_sync_words",
]
# one level down (``--deep``): the casts' and launches' own parts
DEEP = [
    "megatron_fp8.quant.kernels:_current_launches",
    "megatron_fp8.quant.kernels:cast_current_segments",
    "megatron_fp8.quant.kernels:cast_current_gathered",
    "megatron_fp8.quant.kernels:device_ints",
    "megatron_fp8.kernels.triton_persistent:cast_current_persistent",
    "megatron_fp8.kernels.triton_persistent:_sync_words",
    "megatron_fp8.kernels.triton_persistent:launch_options",
    "megatron_fp8.kernels.triton_tiles:fp8_copies",
    "megatron_fp8.quant.tensor:aligned_scalars",
    "megatron_fp8.kernels.triton_launch:Launcher.__call__",
    "megatron_fp8.kernels.triton_grouped:grouped_rows",
    "megatron_fp8.quant.tensor_scaling:CurrentScalingQuantizer.quantize_segments_packed",
    "megatron_fp8.ops.linear:mark_tensors_param_derived",
    "megatron_fp8.modules.grouped:ExpertParams._stacked_weights",
    "megatron_fp8.modules.base:FP8Module.fp8_quantizers",
    "megatron_fp8.ops.lean_grouped:_gathered",
]

TOTALS: dict[str, float] = {}
CALLS: dict[str, int] = {}


def _wrap(spec: str) -> None:
    """Replace ``module:Class.attr`` (or ``module:function``) with a timed wrapper, in its module
    and in every loaded megatron_fp8 module that imported it by name."""
    mod_name, qual = spec.split(":")
    mod = importlib.import_module(mod_name)
    owner: Any = mod
    *path, attr = qual.split(".")
    for p in path:
        owner = getattr(owner, p)
    raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    is_static = isinstance(raw, staticmethod)
    fn: Callable[..., Any] = raw.__func__ if is_static else raw
    clock = time.perf_counter

    def timed(*a: Any, **k: Any) -> Any:
        t0 = clock()
        try:
            return fn(*a, **k)
        finally:
            TOTALS[spec] = TOTALS.get(spec, 0.0) + clock() - t0
            CALLS[spec] = CALLS.get(spec, 0) + 1

    setattr(owner, attr, staticmethod(timed) if is_static else timed)
    if not path:  # a module-level function imported elsewhere by name
        import sys

        for m in list(sys.modules.values()):
            if m is not None and getattr(m, "__name__", "").startswith("megatron_fp8") and getattr(m, attr, None) is fn:
                setattr(m, attr, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--caller", action="store_true", help="backward on the calling thread (no engine handoff)")
    ap.add_argument("--wrap", nargs="*", default=None,
                    help="module:qualname to time (default: the grouped path's, or LINEAR's for Linear cases)")
    ap.add_argument("--deep", action="store_true", help="also the casts' and launches' own parts (DEEP)")
    args = ap.parse_args()
    if args.caller:
        torch.autograd.set_multithreading_enabled(False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    steps = {c: make_step(c, device) for c in args.cases}
    grouped = [c.startswith("grouped-") for c in args.cases]
    dense = not any(grouped)
    if args.wrap is None and any(grouped) and not all(grouped):
        print("(grouped and Linear cases together: the grouped sections are wrapped; run the Linear cases apart)")
    if args.deep and dense:
        print("(--deep adds the grouped casts' parts: nothing for Linear cases)")
    default = LINEAR if dense else DEFAULT
    for spec in (args.wrap if args.wrap is not None else default) + (DEEP if args.deep and not dense else []):
        try:
            _wrap(spec)
        except (AttributeError, KeyError, ImportError) as exc:
            print(f"(not wrapped: {spec}: {exc})")
    for case, step in steps.items():
        for _ in range(20):
            step()
        sync()
        per_round: dict[str, list[float]] = {}
        whole: list[float] = []
        for _ in range(args.rounds):
            TOTALS.clear()
            CALLS.clear()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            whole.append((time.perf_counter() - t0) / args.steps * 1e6)
            sync()
            for k, v in TOTALS.items():
                per_round.setdefault(k, []).append(v / args.steps * 1e6)
        print(f"\n===== {case}: {statistics.median(whole):.0f} us/step (median of {args.rounds} rounds of "
              f"{args.steps}; {'backward on the caller' if args.caller else 'default threads'})")
        print("| function | us/step (inclusive) | calls/step |\n|---|---|---|")
        for k, v in sorted(per_round.items(), key=lambda kv: -statistics.median(kv[1])):
            print(f"| {k.split(':')[1]} | {statistics.median(v):.1f} | {CALLS.get(k, 0) / args.steps:.1f} |")


if __name__ == "__main__":
    main()
