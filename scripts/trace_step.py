"""Device timeline of one training step (GPU): every kernel of the step in order, with its start,
duration and the idle gap before it, from a ``torch.profiler`` trace. Answers "the kernels add
0.1 ms but the step grows 0.5 ms: where does the GPU wait?".

    python scripts/trace_step.py [--cases CASE...] [--out DIR]   (cases: see --help)

``grouped-graphed`` profiles one replay of the step captured in a CUDA graph (as
``bench_grouped.py``'s graphed rows run it): the gaps there are the device's own, not the host's.

Writes one Chrome trace per case under ``--out`` (open in Perfetto) and prints, per case, the
kernel sequence of one profiled step (after three warm-up steps) and totals (span, busy, idle).

``--summarize TRACE...`` (no GPU needed) instead says where a profiled training step's time
went, from any ``torch.profiler`` Chrome trace (``.json`` or ``.json.gz``; Megatron-LM writes one
with ``--profile --use-pytorch-profiler``, as ``bench_megatron.py --profile`` runs it): the
step's wall time, the GPU's busy and idle time in it (idle: the GPU waits on the host), the GPU
time per kind of kernel (GEMMs, our FP8 casts and scale kernels, attention, the rest) and the
host time inside our layers' autograd functions: "how much of the gap is host, casts or GEMMs".
The profiler's own host overhead lengthens host-bound steps; kernel durations are the device's.

``--pyspy SAMPLES...`` (no GPU needed) says where a training process's wall time went from
py-spy's raw samples (``py-spy record --format raw --idle --threads``; ``bench_megatron.py
--pyspy`` writes them after the warm-up): per thread, the share of samples in each phase of
Megatron-LM's iteration (forward, backward, optimizer, gradient finalisation, the rest of
``train_step``, outside it), the share with one of our frames on the stack, and the Python lines
most often on top (a line that waits on the GPU shows up there). Idle samples are kept, so the
shares are of wall time, with no profiler inside the process.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from unittest import mock

import torch
from benchlib import markdown_table, train_step
from torch.profiler import ProfilerActivity, profile

from megatron_fp8 import Linear
from megatron_fp8.modules.grouped import GroupedLinear
from megatron_fp8.recipe import PRESETS
from megatron_fp8.testing import capture_step, router_splits


def _linear_step(m: int, n: int, k: int, recipe: str, flag: bool) -> Callable[[], None]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    lin = Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda", save_original_input=flag)
    return train_step(lin, x, dy, PRESETS[recipe])


def _grouped_step(recipe: str, k: int = 4096, n: int = 2048, router: bool = False) -> Callable[[], None]:
    """8 experts x 2048 rows, even or (``router``) split as a top-2 router hands them out."""
    splits = router_splits(8 * 2048, 8, 2) if router else [2048] * 8
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
    gpu = sorted((e for e in load(path) if e.get("ph") == "X" and e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
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
    # router splits (bench_grouped.py's uneven rows), graphed under each grouped-GEMM setting
    "grouped-router-graphed": lambda: {
        f"router_{r}_graphed_{g}": _graphed(_grouped_step(r, router=True), g)
        for r in ("current", "blockwise") for g in ("auto", "loop", "triton")
    },
}


# ---- summaries of a profiled training step (no GPU needed) ----
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# kernel name -> kind; first match wins (our casts before GEMMs: "cast" also appears in cuBLAS
# names; attention before GEMMs: cuDNN's SDPA kernels are named "..._sdpa_sm90_flash_..._wgmma_...")
KINDS: list[tuple[str, re.Pattern[str]]] = [
    ("fp8 casts", re.compile(r"^(_cast_tile|cast_tile|_current_persistent|_row_amax|_amax_of_partials|"
                             r"_scale_from_amax|_segment_scale|_delayed_state|_amax_fold)")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|_kgroup_kernel|_rows_kernel|wgmma|sm90_", re.I)),
]
OUR_FUNCTIONS = re.compile(r"^(_Linear|_GroupedLinear|LeanLinear|LeanGrouped)(Backward)?$")  # ops.linear, ops.lean*


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def kind(name: str) -> str:
    for label, pattern in KINDS:
        if pattern.search(name):
            return label
    return "other"


def _union(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _profiler_steps(events: list[dict]) -> list[dict]:
    """The trace's ``ProfilerStep#`` annotations (torch.profiler's one per ``step()``)."""
    return [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]


def _window(events: list[dict]) -> tuple[int, float, float]:
    """``(steps, start us, end us)`` of the profiled steps (no step annotations: the whole trace,
    one step). A step annotation shorter than half the longest is the stub torch.profiler leaves
    where its schedule ends (or starts) recording, not an iteration: left out, as the window's
    count of steps (Megatron's one-iteration profile read as two steps, halving every figure,
    on the H100 2026-12-05)."""
    steps = _profiler_steps(events)
    if not steps:
        steps = [e for e in events if e.get("ph") == "X" and "dur" in e]
        return 1, min(float(e["ts"]) for e in steps), max(float(e["ts"]) + float(e["dur"]) for e in steps)
    longest = max(float(e["dur"]) for e in steps)
    full = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in steps if float(e["dur"]) >= longest / 2]
    n = max(1, round(_union(full) / longest)) if longest > 0 else len(full)  # nested annotations: one step
    return n, min(a for a, _ in full), max(b for _, b in full)


def step_annotations(events: list[dict]) -> list[tuple[str, float]]:
    """``(name, ms)`` of every ``ProfilerStep#`` annotation in the trace, in time order: what
    ``_window`` counted from (a stub beside a full step shows here)."""
    steps = sorted((float(e["ts"]), str(e["name"]), float(e["dur"])) for e in _profiler_steps(events))
    return [(name, round(dur / 1e3, 2)) for _, name, dur in steps]


def _gpu_in(events: list[dict], t0: float, t1: float) -> list[dict]:
    """The kernels, copies and memsets that start in ``[t0, t1)``."""
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS and t0 <= float(e["ts"]) < t1]


def summarize(events: list[dict]) -> dict[str, float]:
    """Milliseconds: ``step`` (the profiled steps' wall time, per step), ``gpu busy`` and ``gpu
    idle`` in it, per kernel kind (summed durations), and ``host in our layers`` (forward and
    backward ranges of our autograd functions), all per step; ``steps``: how many were profiled."""
    n, t0, t1 = _window(events)
    gpu = _gpu_in(events, t0, t1)
    out: dict[str, float] = {"steps": float(n), "step": (t1 - t0) / n / 1e3}
    busy = _union((float(e["ts"]), min(float(e["ts"]) + float(e["dur"]), t1)) for e in gpu)
    out["gpu busy"] = busy / n / 1e3
    out["gpu idle"] = out["step"] - out["gpu busy"]
    for label in [k for k, _ in KINDS] + ["other"]:
        out[label] = 0.0
    for e in gpu:
        out[kind(str(e["name"])) if e.get("cat") == "kernel" else "other"] += float(e["dur"]) / n / 1e3
    ours = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"
            and OUR_FUNCTIONS.match(str(e.get("name", ""))) and t0 <= float(e["ts"]) < t1]
    out["host in our layers"] = _union((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ours) / n / 1e3
    return out


def top_kernels(events: list[dict], k: int = 15) -> list[tuple[str, str, int, float]]:
    """The ``k`` kernels (and copies, memsets) with the most GPU time in the profiled steps:
    ``(name, kind, calls per step, ms per step)``, most first: which GEMMs and casts a step's
    time goes to, beyond ``summarize``'s totals per kind."""
    n, t0, t1 = _window(events)
    calls: dict[str, int] = {}
    total: dict[str, float] = {}
    for e in _gpu_in(events, t0, t1):
        name = str(e["name"])
        calls[name] = calls.get(name, 0) + 1
        total[name] = total.get(name, 0.0) + float(e["dur"])
    ranked = sorted(total, key=total.__getitem__, reverse=True)[:k]
    return [(name, kind(name), round(calls[name] / n), total[name] / n / 1e3) for name in ranked]


def kernels_table(rows: list[tuple[str, str, int, float]]) -> str:
    """``top_kernels`` as a markdown table (names cut to 90 characters)."""
    return markdown_table(["kernel", "kind", "calls", "ms"], [[n[:90], kd, c, round(ms, 2)] for n, kd, c, ms in rows])


COLUMNS = ("step", "gpu busy", "gpu idle", "gemm", "fp8 casts", "attention", "other", "host in our layers")


def table(rows: dict[str, dict[str, float]]) -> str:
    """A markdown table: one row per trace, milliseconds per step."""
    return markdown_table(["run", *(f"{c} ms" for c in COLUMNS)],
                          [[name, *(round(s[c], 1) for c in COLUMNS)] for name, s in rows.items()])


# the first of these (in this order) with a frame on the stack names the phase (Megatron-LM's schedule and loop)
PYSPY_PHASES: list[tuple[str, str]] = [
    ("forward_step (", "forward"),
    ("backward_step (", "backward"),
    ("megatron/core/optimizer/", "optimizer"),
    ("finalize_model_grads", "grad finalize"),
    ("train_step (", "train_step, other"),
]
PYSPY_OUTSIDE = "outside train_step"
PYSPY_OURS = "megatron_fp8/"
PYSPY_LAUNCHER = "megatron_fp8/megatron/launch.py"  # at the root of every stack our launcher starts
_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
_PROCESS = re.compile(r'^process (?P<pid>\d+):"(?P<cmd>[^"]*)"$')
_THREAD = re.compile(r"^thread \((?P<tid>\d+)\)(?::\s*(?P<name>.*))?$")


@dataclass
class ThreadSamples:
    """One thread's samples: by phase, with one of our frames on the stack, and by top line."""

    name: str
    total: int = 0
    phases: Counter[str] = field(default_factory=Counter)
    ours: Counter[str] = field(default_factory=Counter)
    tops: Counter[str] = field(default_factory=Counter)


def pyspy_phase(frames: list[str]) -> str:
    """The first phase in ``PYSPY_PHASES`` order with a frame on the stack (forward before train_step)."""
    stack = ";".join(frames)
    return next((phase for needle, phase in PYSPY_PHASES if needle in stack), PYSPY_OUTSIDE)


def pyspy_parse(text: str) -> dict[str, dict[str, ThreadSamples]]:
    """``{"pid command": {thread: ThreadSamples}}`` from py-spy's raw (collapsed-stack) output."""
    procs: dict[str, dict[str, ThreadSamples]] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        parts = m.group("stack").split(";")
        count = int(m.group("count"))
        proc = "process"
        while parts and (p := _PROCESS.match(parts[0])):  # a child's samples name its parents first
            proc, parts = f"{p.group('pid')} {p.group('cmd')}", parts[1:]  # forked children share the command
        t = _THREAD.match(parts[0]) if parts else None
        if not t:
            continue
        frames = parts[1:]
        threads = procs.setdefault(proc, {})
        key = t.group("name") or f"thread {t.group('tid')}"
        s = threads.setdefault(key, ThreadSamples(key))
        phase = pyspy_phase(frames)
        s.total += count
        s.phases[phase] += count
        if any(PYSPY_OURS in f and PYSPY_LAUNCHER not in f for f in frames):
            s.ours[phase] += count
        if frames:
            s.tops[frames[-1]] += count
    return procs


def pyspy_process(procs: dict[str, dict[str, ThreadSamples]]) -> str | None:
    """The process with the most samples inside ``train_step`` (torchrun's agent and torch.compile's
    workers have none)."""
    def inside(proc: str) -> int:
        return sum(s.total - s.phases[PYSPY_OUTSIDE] for s in procs[proc].values())
    best = max(procs, key=inside, default=None)
    return best if best is not None and inside(best) else None


def pyspy_table(threads: dict[str, ThreadSamples], rate: float | None = None, top: int = 12) -> str:
    """The busiest threads' phases (share of each thread's samples; with ``rate``, seconds too)
    and their most frequent top lines."""
    rows = []
    busiest = sorted(threads.values(), key=lambda s: -s.total)[:3]
    for s in busiest:
        secs = f", {s.total / rate:.1f} s sampled" if rate else ""
        rows.append(f"\n{s.name}: {s.total} samples{secs}\n")
        rows.append("| phase | share | with our frames |\n|---|---|---|")
        for phase in [p for _, p in PYSPY_PHASES] + [PYSPY_OUTSIDE]:
            n = s.phases[phase]
            if n:
                rows.append(f"| {phase} | {n / s.total:.1%} | {s.ours[phase] / s.total:.1%} |")
        rows.append(f"\nmost frequent top lines ({s.name}):\n")
        rows.append("| share | line |\n|---|---|")
        for frame, n in s.tops.most_common(top):
            rows.append(f"| {n / s.total:.1%} | `{frame}` |")
    return "\n".join(rows)


def pyspy_summarize(path: str, rate: float | None = None) -> str:
    with open(path) as f:
        procs = pyspy_parse(f.read())
    proc = pyspy_process(procs)
    if proc is None:
        return f"{path}: no samples inside Megatron-LM's train_step"
    return f"{path} ({proc[:100]})\n{pyspy_table(procs[proc], rate)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--summarize", nargs="+", metavar="TRACE", help="summarize these traces instead (no GPU)")
    p.add_argument("--pyspy", nargs="+", metavar="SAMPLES", help="summarize py-spy raw samples instead (no GPU)")
    p.add_argument("--rate", type=float, default=None, help="with --pyspy: py-spy's rate (Hz), for seconds too")
    args = p.parse_args()
    if args.pyspy:
        for path in args.pyspy:
            print(pyspy_summarize(path, args.rate))
        return
    if args.summarize:
        print(table({path: summarize(load(path)) for path in args.summarize}))
        return
    if not torch.cuda.is_available():
        raise SystemExit("trace_step.py needs CUDA (run it on the device machine)")
    os.makedirs(args.out, exist_ok=True)
    for case in args.cases:
        for name, fn in CASES[case]().items():
            trace(name, fn, args.out)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
