"""Device timeline of one training step (GPU): every kernel of the step in order, with its start,
duration and the idle gap before it, from a ``torch.profiler`` trace. Answers "the kernels add
0.1 ms but the step grows 0.5 ms: where does the GPU wait?".

    python scripts/trace_step.py [--cases linear-k14336 linear-k2048 grouped grouped-graphed] [--out DIR]

``grouped-graphed`` profiles one replay of the step captured in a CUDA graph (as
``bench_grouped.py``'s graphed rows run it): the gaps there are the device's own, not the host's.

Writes one Chrome trace per case under ``--out`` (open in Perfetto) and prints, per case, the
kernel sequence of one profiled step (after three warm-up steps) and totals (span, busy, idle).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from unittest import mock

import torch
from benchlib import markdown_table, train_step
from torch.profiler import ProfilerActivity, profile

from megatron_fp8 import Linear
from megatron_fp8.modules.grouped import GroupedLinear
from megatron_fp8.recipe import PRESETS
from megatron_fp8.testing import capture_step


def _linear_step(m: int, n: int, k: int, recipe: str, flag: bool) -> Callable[[], None]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    lin = Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda", save_original_input=flag)
    return train_step(lin, x, dy, PRESETS[recipe])


def _grouped_step(recipe: str, k: int = 4096, n: int = 2048) -> Callable[[], None]:
    splits = [2048] * 8
    x = torch.randn(sum(splits), k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(sum(splits), n, device="cuda", dtype=torch.bfloat16) * 1e-3
    layer = GroupedLinear(8, k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    return train_step(layer, x, dy, PRESETS[recipe], splits)


def _graphed(step: Callable[[], None], grouped_gemm: str | None = None) -> Callable[[], None]:
    """``step`` captured in a CUDA graph (``MEGATRON_FP8_GROUPED_GEMM=grouped_gemm`` while
    capturing, where given); returns its replay."""
    pin = {"MEGATRON_FP8_GROUPED_GEMM": grouped_gemm} if grouped_gemm is not None else {}
    with mock.patch.dict(os.environ, pin):  # restored afterwards
        graph, _ = capture_step(step)
    keep = (graph, step)  # the graph reads the step's tensors (its layer, x, dy): they live as long as it
    return lambda: keep[0].replay()


def _device_events(path: str) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of the kernels, copies and memsets in a Chrome trace."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    return [(e["name"], float(e["ts"]), float(e["dur"])) for e in gpu]


def trace(name: str, fn: Callable[[], None], out: str) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = os.path.join(out, f"trace_{name}.json")
    prof.export_chrome_trace(path)
    kernels = _device_events(path)
    if not kernels:
        print(f"## {name}: no kernels found in the trace")
        return
    t0, rows, prev_end, busy = kernels[0][1], [], kernels[0][1], 0.0
    for kname, ts, dur in kernels:
        rows.append([kname[:70], round(ts - t0, 1), round(dur, 1), round(max(ts - prev_end, 0.0), 1)])
        prev_end, busy = max(prev_end, ts + dur), busy + dur
    span = prev_end - t0
    print(f"## {name}: span {span:.1f} us, busy {busy:.1f} us, idle {span - busy:.1f} us, "
          f"{len(kernels)} kernels")
    print(markdown_table(["kernel", "start us", "dur us", "gap before us"], rows), flush=True)


CASES = {
    "linear-k14336": lambda: {f"current_{f}": _linear_step(16384, 4096, 14336, "current", f == "on")
                              for f in ("off", "on")},
    "linear-k2048": lambda: {f"current_k2048_{f}": _linear_step(16384, 7168, 2048, "current", f == "on")
                             for f in ("off", "on")},
    "grouped": lambda: {f"grouped_{r}": _grouped_step(r) for r in ("current", "blockwise")},
    "grouped-n7168": lambda: {f"grouped_k2048_n7168_{r}": _grouped_step(r, 2048, 7168)
                              for r in ("current", "blockwise")},
    "grouped-graphed": lambda: {
        "grouped_current_graphed": _graphed(_grouped_step("current"), "auto"),
        "grouped_current_graphed_torch": _graphed(_grouped_step("current"), "torch"),
        "grouped_blockwise_graphed": _graphed(_grouped_step("blockwise"), "auto"),
        "grouped_k2048_n7168_current_graphed": _graphed(_grouped_step("current", 2048, 7168), "auto"),
    },
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("trace_step.py needs CUDA (run it on the device machine)")
    os.makedirs(args.out, exist_ok=True)
    for case in args.cases:
        for name, fn in CASES[case]().items():
            trace(name, fn, args.out)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
