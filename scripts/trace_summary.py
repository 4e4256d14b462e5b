"""Where one profiled training step's time goes, from a ``torch.profiler`` Chrome trace (``.json``
or ``.json.gz``; Megatron-LM writes one with ``--profile --use-pytorch-profiler``): the step's
wall time, the GPU's busy and idle time in it (idle: the GPU waits on the host), and the GPU
time per kind of kernel: GEMMs, our FP8 casts and scale kernels, attention, everything else.
Also the host time spent inside our layers' autograd functions (their forward and backward
ranges). Answers "how much of the gap is host, casts or GEMMs". The profiler's own host
overhead lengthens host-bound steps; the kernels' durations are the device's.

    python scripts/trace_summary.py TRACE [TRACE ...]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections.abc import Iterable

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# kernel name -> kind; first match wins (our casts before GEMMs: "cast" also appears in cuBLAS names)
KINDS: list[tuple[str, re.Pattern[str]]] = [
    ("fp8 casts", re.compile(r"^(_cast_tile|cast_tile|_current_persistent|_row_amax|_amax_of_partials|"
                             r"_scale_from_amax|_segment_scale|_delayed_state)")),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|_kgroup_kernel|_rows_kernel|wgmma|sm90_", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn", re.I)),
]
OUR_FUNCTIONS = re.compile(r"^_(Linear|GroupedLinear)(Backward)?$")


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


def summarize(events: list[dict]) -> dict[str, float]:
    """Milliseconds: ``step`` (the profiled steps' wall time, per step), ``gpu busy`` and ``gpu
    idle`` in it, per kernel kind (summed durations), and ``host in our layers`` (forward and
    backward ranges of our autograd functions), all per step; ``steps``: how many were profiled."""
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    if steps:
        t0 = min(float(e["ts"]) for e in steps)
        t1 = max(float(e["ts"]) + float(e["dur"]) for e in steps)
    else:  # no step annotations: the whole trace
        xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
        t0, t1 = min(float(e["ts"]) for e in xs), max(float(e["ts"]) + float(e["dur"]) for e in xs)
    n = max(len(steps), 1)
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS and t0 <= float(e["ts"]) < t1]
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


COLUMNS = ("step", "gpu busy", "gpu idle", "gemm", "fp8 casts", "attention", "other", "host in our layers")


def table(rows: dict[str, dict[str, float]]) -> str:
    """A markdown table: one row per trace, milliseconds per step."""
    lines = ["| run | " + " | ".join(f"{c} ms" for c in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, s in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{s[c]:.1f}" for c in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    args = ap.parse_args()
    print(table({path: summarize(load(path)) for path in args.traces}))


if __name__ == "__main__":
    main()
