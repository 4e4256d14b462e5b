"""Host cost of one GroupedLinear training step (GPU): host vs device milliseconds per step for
each grouped-GEMM path (``MEGATRON_FP8_GROUPED_GEMM``) and recipe, and where the host's time goes
(cProfile, own time) for the default path. A step whose host time matches its device time is
launch/Python-bound: the GPU waits on us. ``--breakdown``: host microseconds per step in the
step's parts (forward, backward, the casts, GEMMs, launches, ``torch.empty``), each part timed
by a wrapper (about a microsecond a call) instead of a profiler, whose per-call cost distorts.
``--alternate VAR=a,b``: host and device ms a step with the setting ``VAR`` at each value, the
values alternated round by round in this one process (a setting the package reads per call).

    python scripts/profile_grouped_host.py [--experts 8] [--tokens 2048] [--k 4096] [--n 2048] [--breakdown]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from benchlib import host_and_device_ms, markdown_table, train_step
from profile_steps import _host_profile, _syncs, _top_kernels

from megatron_fp8.modules.grouped import GroupedLinear
from megatron_fp8.recipe import PRESETS


def _parts() -> list[tuple[Any, str, str]]:
    """(owner, attribute, label) of the step's parts ``--breakdown`` times; each owner is where
    the callers look the attribute up at call time."""
    from megatron_fp8.kernels import cuda_cast, triton_launch
    from megatron_fp8.modules import grouped as mod
    from megatron_fp8.ops import grouped_linear as ops

    return [(mod.ExpertParams, "fp8_operands", "weights: quantizers + cast (fp8_operands)"),
            (ops, "check_m_splits", "m_splits checks"), (ops, "_forward_fp8", "forward (autograd function)"),
            (ops, "_backward_fp8", "backward (autograd function)"), (ops, "_cast_split", "x / dy casts (_cast_split)"),
            (ops, "grouped_gemm_cat", "fprop + dgrad GEMMs"), (ops, "grouped_wgrad", "wgrad GEMMs"),
            (ops, "_stash", "saving (_stash)"), (ops, "_unstash", "loading (_unstash)"),
            (triton_launch.Launcher, "__call__", "Triton launches"), (cuda_cast, "_launch", "CUDA cast launches"),
            (torch, "empty", "torch.empty")]


@contextlib.contextmanager
def _timed(parts: list[tuple[Any, str, str]], acc: dict[str, list[float]]) -> Iterator[None]:
    """Wrap each part to add its host seconds and calls to ``acc[label]``; unwrapped on exit."""
    saved = []
    for owner, attr, label in parts:
        fn = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)

        def wrap(*a: Any, _fn: Callable[..., Any] = fn, _label: str = label, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                rec = acc[_label]
                rec[0] += time.perf_counter() - t0
                rec[1] += 1

        saved.append((owner, attr, fn))
        setattr(owner, attr, wrap)
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def breakdown(layer: Any, x: torch.Tensor, dy: torch.Tensor, recipe: Any, splits: list[int], steps: int = 30
              ) -> list[list[object]]:
    """Host us per step: the whole step, its forward and backward calls, and ``_parts``."""
    from megatron_fp8 import fp8_autocast

    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    params = list(layer.parameters())
    with _timed(_parts(), acc):
        for i in range(steps + 3):
            if i == 3:
                torch.cuda.synchronize()
                acc.clear()
            x.grad = None
            for p in params:
                p.grad = None
            t0 = time.perf_counter()
            with fp8_autocast(fp8_recipe=recipe):
                y = layer(x, splits)
            t1 = time.perf_counter()
            y.backward(dy)
            t2 = time.perf_counter()
            whole = (("step", t2 - t0), ("forward (module call)", t1 - t0), ("backward (y.backward)", t2 - t1))
            for label, dt in whole:
                acc[label][0] += dt
                acc[label][1] += 1
    torch.cuda.synchronize()
    return [[label, 1e6 * t / steps, n / steps] for label, (t, n) in acc.items()]


def alternate(step: Callable[[], None], var: str, values: list[str], rounds: int = 8) -> list[list[object]]:
    """``[value, host ms, device ms, new / first host ratio]`` per value of ``var``: medians over
    ``rounds`` rounds of 20 steps, the values' order rotated each round; the ratio is the median
    of the per-round ratios to the first value."""
    import statistics

    old = os.environ.get(var)
    got: dict[str, list[tuple[float, float]]] = {v: [] for v in values}
    try:
        for r in range(rounds):
            for v in values[r % len(values):] + values[:r % len(values)]:
                os.environ[var] = v
                got[v].append(host_and_device_ms(step, 20))
    finally:
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old
    first = got[values[0]]
    return [[f"{var}={v}", statistics.median(h for h, _ in got[v]), statistics.median(d for _, d in got[v]),
             statistics.median(h / h0 for (h, _), (h0, _) in zip(got[v], first))] for v in values]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--paths", nargs="*", default=["auto", "triton", "torch", "loop"])
    p.add_argument("--recipes", nargs="*", default=["current", "blockwise"])
    p.add_argument("--detail", action="store_true",
                   help="also cumulative Python time, host time per aten op and the step's syncs")
    p.add_argument("--breakdown", action="store_true", help="host us per step in the step's parts (no profiler)")
    p.add_argument("--alternate", metavar="VAR=a,b",
                   help="host/device ms a step with the setting VAR at each value, alternated in this process")
    args = p.parse_args()
    splits = [args.tokens] * args.experts
    x = torch.randn(sum(splits), args.k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(sum(splits), args.n, device="cuda", dtype=torch.bfloat16) * 1e-3
    layer = GroupedLinear(args.experts, args.k, args.n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    if args.breakdown:
        for rname in args.recipes:
            rows_b = breakdown(layer, x, dy, PRESETS[rname], splits)
            print(f"## {rname} ({os.environ.get('MEGATRON_FP8_GROUPED_GEMM', 'auto')}), host us per step\n"
                  + markdown_table(["part", "host us/step", "calls/step"], rows_b), flush=True)
        return
    if args.alternate:
        var, _, vals = args.alternate.partition("=")
        for rname in args.recipes:
            got = alternate(train_step(layer, x, dy, PRESETS[rname], splits), var, vals.split(","))
            print(f"## {rname}, {len(got)} settings alternated\n"
                  + markdown_table(["setting", "host ms/step", "device ms/step", "host / first, per round"], got),
                  flush=True)
        return
    rows = []
    for path in args.paths:
        os.environ["MEGATRON_FP8_GROUPED_GEMM"] = path
        for rname in args.recipes:
            host, dev = host_and_device_ms(train_step(layer, x, dy, PRESETS[rname], splits))
            rows.append([path, rname, host, dev])
            print(rows[-1], flush=True)
    print(markdown_table(["grouped GEMM path", "recipe", "host ms/step", "device ms/step"], rows))
    os.environ["MEGATRON_FP8_GROUPED_GEMM"] = "auto"
    for rname in args.recipes:
        step = train_step(layer, x, dy, PRESETS[rname], splits)
        print(f"## {rname} (auto), Python own time over 10 steps\n{_host_profile(step, 30)}", flush=True)
        if args.detail:
            print(f"## {rname} (auto), cumulative over 10 steps\n{_host_profile(step, 45, 'cumulative')}")
            print(f"## {rname} (auto), host time by op over 3 steps\n"
                  f"{_top_kernels(step, 30, 'self_cpu_time_total')}")
            print(f"syncs in a {rname} step: {_syncs(step)}", flush=True)


if __name__ == "__main__":
    main()
