"""Where a training process's wall time goes, from py-spy's raw samples (``py-spy record --format
raw --idle --threads``): per thread, the share of samples in each phase of Megatron-LM's
iteration (forward, backward, optimizer, gradient finalisation, the rest of ``train_step``,
outside it), the share with one of our frames on the stack, and the Python lines most often on
top (a line that waits on the GPU shows up there). Idle samples are kept, so the shares are of
wall time. ``bench_megatron.py --pyspy`` writes such files after the warm-up iterations.

    python scripts/pyspy_summary.py pyspy_dense-1b_ours-tensorwise.txt
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass, field

# the first of these (in this order) with a frame on the stack names the phase (Megatron-LM's schedule and loop)
PHASES: list[tuple[str, str]] = [
    ("forward_step (", "forward"),
    ("backward_step (", "backward"),
    ("megatron/core/optimizer/", "optimizer"),
    ("finalize_model_grads", "grad finalize"),
    ("train_step (", "train_step, other"),
]
OUTSIDE = "outside train_step"
OURS = "megatron_fp8/"
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


def phase_of(frames: list[str]) -> str:
    """The first phase in ``PHASES`` order with a frame on the stack (forward before train_step)."""
    stack = ";".join(frames)
    return next((phase for needle, phase in PHASES if needle in stack), OUTSIDE)


def parse(text: str) -> dict[str, dict[str, ThreadSamples]]:
    """``{process command: {thread: ThreadSamples}}`` from py-spy's raw (collapsed-stack) output."""
    procs: dict[str, dict[str, ThreadSamples]] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        parts = m.group("stack").split(";")
        count = int(m.group("count"))
        proc = "process"
        while parts and (p := _PROCESS.match(parts[0])):  # a child's samples name its parents first
            proc, parts = p.group("cmd"), parts[1:]
        t = _THREAD.match(parts[0]) if parts else None
        if not t:
            continue
        frames = parts[1:]
        threads = procs.setdefault(proc, {})
        key = t.group("name") or f"thread {t.group('tid')}"
        s = threads.setdefault(key, ThreadSamples(key))
        phase = phase_of(frames)
        s.total += count
        s.phases[phase] += count
        if any(OURS in f for f in frames):
            s.ours[phase] += count
        if frames:
            s.tops[frames[-1]] += count
    return procs


def training_process(procs: dict[str, dict[str, ThreadSamples]]) -> str | None:
    """The process with the most samples inside ``train_step`` (torchrun's agent and torch.compile's
    workers have none)."""
    def inside(cmd: str) -> int:
        return sum(s.total - s.phases[OUTSIDE] for s in procs[cmd].values())
    best = max(procs, key=inside, default=None)
    return best if best is not None and inside(best) else None


def table(threads: dict[str, ThreadSamples], rate: float | None = None, top: int = 12) -> str:
    """The busiest threads' phases (share of each thread's samples; with ``rate``, seconds too)
    and their most frequent top lines."""
    rows = []
    busiest = sorted(threads.values(), key=lambda s: -s.total)[:3]
    for s in busiest:
        secs = f", {s.total / rate:.1f} s sampled" if rate else ""
        rows.append(f"\n{s.name}: {s.total} samples{secs}\n")
        rows.append("| phase | share | with our frames |\n|---|---|---|")
        for phase in [p for _, p in PHASES] + [OUTSIDE]:
            n = s.phases[phase]
            if n:
                rows.append(f"| {phase} | {n / s.total:.1%} | {s.ours[phase] / s.total:.1%} |")
        rows.append(f"\nmost frequent top lines ({s.name}):\n")
        rows.append("| share | line |\n|---|---|")
        for frame, n in s.tops.most_common(top):
            rows.append(f"| {n / s.total:.1%} | `{frame}` |")
    return "\n".join(rows)


def summarize(path: str, rate: float | None = None) -> str:
    with open(path) as f:
        procs = parse(f.read())
    proc = training_process(procs)
    if proc is None:
        return f"{path}: no samples inside Megatron-LM's train_step"
    return f"{path} ({proc[:100]})\n{table(procs[proc], rate)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--rate", type=float, default=None, help="py-spy's sampling rate (Hz), to print seconds too")
    args = ap.parse_args()
    for path in args.paths:
        print(summarize(path, args.rate))


if __name__ == "__main__":
    main()
