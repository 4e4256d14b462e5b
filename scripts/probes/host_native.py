"""Probe: where an eager ``Linear`` step's host time goes in native code, by library and by ATen op.

Issue 32's open question (run AL): a current-scaling step costs ~2x the sum of its routes and
its glue, and only on a GPU with real kernels. This probe loops one case's fwd+bwd steps in this
process while ``py-spy record --native`` samples it (``--rate`` Hz for ``--seconds``), then says,
per busy thread (the training thread; autograd's CUDA device thread runs the backward), what
share of the samples each shared library holds at the top of the stack (its own time:
``libcuda`` the driver, ``libcublasLt`` cuBLAS, ``libtorch_cpu`` ATen's dispatcher and the
autograd engine, Python's interpreter, Triton's launcher module...), which libraries and ATen ops
(``at::_ops::<op>::call``) are anywhere on the stack (inclusive), and the most frequent top frames.
Cases: ``bf16`` (``nn.Linear``), ``current``, ``current-reused`` (the FP8 weight kept, as in
Megatron's later micro-batches), ``blockwise``; ``grouped-bf16`` (``torch._grouped_mm``),
``grouped-off``, ``grouped-current``, ``grouped-blockwise``, ``grouped-current-router``.
Shapes as issue 32's table on a GPU (T=256, K=N=2048, BF16; 8 experts for the grouped ones);
on a CPU a small one, only to exercise the probe. py-spy pauses the process for each native
sample, so the step time printed (under sampling) is above the unsampled one;
compare shares, not times.

    python scripts/probes/host_native.py [--cases bf16,current] [--seconds 8] [--rate 100] \
        [--pyspy-bin /tmp/site/bin/py-spy] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib

_NATIVE = re.compile(r"\((?P<lib>[^()]*\.so[.\d]*)\)$")  # "func (libfoo.so)"
_PYTHON = re.compile(r"\((?P<file>[^()]*\.py):\d+\)$")  # "func (path/file.py:123)"
_ATEN_OP = re.compile(r"at::_ops::(?P<op>\w+)::(?:call|redispatch)")
_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
# top frames of a thread that waits (``--idle`` samples every thread each tick): not busy
_WAITS = ("futex", "pthread_cond", "sem_wait", "epoll_wait", "poll (", "select (", "nanosleep", "__GI___poll",
          "do_futex_wait", "__lll_lock_wait")


def frame_kind(frame: str) -> str:
    """The library a py-spy frame is in (``libcuda.so.1`` -> ``libcuda``), ``python`` for a Python
    frame, ``other`` for an unnamed address."""
    m = _NATIVE.search(frame)
    if m:
        lib = os.path.basename(m.group("lib"))
        return re.sub(r"(\.cpython[^.]*)?\.so[.\d]*$", "", lib)
    return "python" if _PYTHON.search(frame) else "other"


@dataclass
class Thread:
    name: str
    total: int = 0
    busy: int = 0  # samples whose top frame is not a wait (``_WAITS``)
    own: Counter[str] = field(default_factory=Counter)  # the top frame's library
    inclusive: Counter[str] = field(default_factory=Counter)  # libraries anywhere on the stack
    ops: Counter[str] = field(default_factory=Counter)  # ATen ops anywhere on the stack
    tops: Counter[str] = field(default_factory=Counter)
    # forward / backward-busy / backward-waiting / waiting: the step's phases on this thread
    phases: Counter[str] = field(default_factory=Counter)


def _waiting(frames: list[str]) -> bool:
    """Whether a sample waits: its nearest frame with a symbol (an unnamed libc address on top is
    the syscall under ``pthread_cond_wait``) is a wait (``_WAITS``)."""
    named = [f for f in frames if not f.startswith("0x")]
    return bool(named) and any(w in named[-1] for w in _WAITS)


def parse(text: str) -> dict[str, Thread]:
    """Per thread, from py-spy's raw output with ``--threads`` (``thread (tid): name;frame;... count``)."""
    threads: dict[str, Thread] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        thread, *frames = m.group("stack").split(";")
        count = int(m.group("count"))
        t = threads.setdefault(thread, Thread(thread))
        t.total += count
        waiting = _waiting(frames)
        frames = [f for f in frames if frame_kind(f) != "libc" or f is frames[-1]]  # libc's trampolines
        kinds = [frame_kind(f) for f in frames]
        if frames:
            t.own[kinds[-1]] += count
            t.tops[frames[-1][:160]] += count
            t.busy += 0 if waiting else count
            backward = any("run_backward" in f or "Engine::thread_main" in f for f in frames)
            t.phases[("backward, " if backward else "") + ("waiting" if waiting else "busy")] += count
        for kind in set(kinds):
            t.inclusive[kind] += count
        for op in {m.group("op") for f in frames if (m := _ATEN_OP.search(f))}:
            t.ops[op] += count
    return threads


def table(threads: dict[str, Thread], top: int = 10) -> str:
    """The two busiest threads (most samples not waiting): own and inclusive shares per library,
    ATen ops, top frames, as shares of all the thread's samples."""
    out = []
    for t in sorted(threads.values(), key=lambda t: -t.busy)[:2]:
        phases = ", ".join(f"{k} {n / t.total:.1%}" for k, n in sorted(t.phases.items()))
        out.append(f"\n{t.name}: {t.total} samples, {t.busy} not waiting ({phases})\n\n"
                   "| library | own share | on the stack |\n|---|---|---|")
        for kind, n in t.inclusive.most_common():
            out.append(f"| {kind} | {t.own[kind] / t.total:.1%} | {n / t.total:.1%} |")
        if t.ops:
            out.append("\n| ATen op on the stack | share |\n|---|---|")
            out += [f"| {op} | {n / t.total:.1%} |" for op, n in t.ops.most_common(top)]
        out.append("\n| top frame | share |\n|---|---|")
        out += [f"| `{frame}` | {n / t.total:.1%} |" for frame, n in t.tops.most_common(top)]
    return "\n".join(out)


def _case(name: str, cuda: bool):  # noqa: ANN202 - (step closure, description)
    import torch
    from benchlib import train_step

    import megatron_fp8 as mf
    from megatron_fp8.recipe import PRESETS

    t, k, n = (256, 2048, 2048) if cuda else (16, 128, 128)
    dev, dt = ("cuda" if cuda else "cpu"), torch.bfloat16
    if name.startswith("grouped-"):
        return _grouped_case(name.removeprefix("grouped-"), t, k, n, dev, dt)
    x = torch.randn(t, k, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(t, n, device=dev, dtype=dt)
    if name == "bf16":
        return train_step(torch.nn.Linear(k, n, bias=False, device=dev, dtype=dt), x, dy), f"nn.Linear {t}x{k}x{n}"
    recipe = name.removesuffix("-reused")
    layer = mf.Linear(k, n, bias=False, params_dtype=dt, device=dev)
    if name.endswith("-reused"):  # the first step casts the weight, later ones reuse it
        layer.is_first_microbatch = True
    return train_step(layer, x, dy, PRESETS[recipe]), f"our Linear, {name}, {t}x{k}x{n}"


def _grouped_case(what: str, t: int, k: int, n: int, dev: str, dt: object):  # noqa: ANN202
    """8 experts x ``t`` tokens (issue 32's grouped rows): ``bf16`` (``torch._grouped_mm`` on one
    stacked weight), ``off`` (our GroupedLinear, FP8 off), ``current`` / ``blockwise`` (even
    splits), ``current-router`` (a new top-2 router split each step)."""
    import torch
    from benchlib import train_step

    import megatron_fp8 as mf
    from megatron_fp8.recipe import PRESETS
    from megatron_fp8.testing import router_splits

    e = 8
    x = torch.randn(t * e, k, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(t * e, n, device=dev, dtype=dt)
    if what == "bf16":
        w = torch.randn(e, n, k, device=dev, dtype=dt, requires_grad=True)
        offs = torch.tensor([t] * e, device=dev).cumsum(0).to(torch.int32)

        def step() -> None:
            x.grad = w.grad = None
            torch._grouped_mm(x, w.transpose(-2, -1), offs=offs).backward(dy)
        return step, f"torch._grouped_mm, {e} x {t}x{k}x{n}"
    layer = mf.GroupedLinear(e, k, n, bias=False, params_dtype=dt, device=dev)
    recipe = None if what == "off" else PRESETS[what.removesuffix("-router")]
    if what.endswith("-router"):
        routed = [router_splits(t * e, e, 2, seed=s) for s in range(16)]
        return train_step(layer, x, dy, recipe, routed=routed), f"our GroupedLinear, {what}, {e} x ~{t}x{k}x{n}"
    return train_step(layer, x, dy, recipe, [t] * e), f"our GroupedLinear, {what}, {e} x {t}x{k}x{n}"


def record(step, pyspy: str, seconds: int, rate: int, raw: str) -> tuple[int, float, str]:  # noqa: ANN001
    """Steps looped while py-spy samples this process; (steps, seconds, py-spy's stderr)."""
    with open(raw + ".log", "w+") as log:  # (a file, not a pipe: nothing reads it while the steps run)
        spy = subprocess.Popen([pyspy, "record", "--pid", str(os.getpid()), "--native", "--threads", "--idle",
                                "--rate", str(rate), "--duration", str(seconds), "--format", "raw", "-o", raw],
                               stdout=log, stderr=subprocess.STDOUT)
        steps, t0 = 0, time.perf_counter()
        while spy.poll() is None:
            step()
            steps += 1
        elapsed = time.perf_counter() - t0
        log.seek(0)
        return steps, elapsed, log.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="bf16,current,current-reused,blockwise")
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--rate", type=int, default=100)
    ap.add_argument("--pyspy-bin", default=shutil.which("py-spy") or "/tmp/site/bin/py-spy")
    ap.add_argument("--out", default="/tmp/host_native")
    ap.add_argument("--backward-thread", choices=("engine", "caller"), default="engine",
                    help="engine: backward on autograd's CUDA device thread (PyTorch's default); caller: on the "
                         "calling thread (torch.autograd.set_multithreading_enabled(False)), where py-spy sees it")
    args = ap.parse_args()
    import torch

    if args.backward_thread == "caller":
        torch.autograd.set_multithreading_enabled(False)  # (thread-local: this thread's backward calls)

    if not (os.path.isfile(args.pyspy_bin) and os.access(args.pyspy_bin, os.X_OK)):
        raise SystemExit(f"host_native.py: no py-spy at {args.pyspy_bin}; pip install py-spy, or pass --pyspy-bin")
    cuda = torch.cuda.is_available()
    os.makedirs(args.out, exist_ok=True)
    print(f"# {torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}; py-spy --native at "
          f"{args.rate} Hz for {args.seconds:g} s a case")
    for name in args.cases.split(","):
        step, what = _case(name, cuda)
        for _ in range(50):  # warm-up: plans, compilations, the allocator's blocks
            step()
        if cuda:
            torch.cuda.synchronize()
        raw = os.path.join(args.out, f"{name}.txt")
        steps, secs, err = record(step, args.pyspy_bin, args.seconds, args.rate, raw)
        if cuda:
            torch.cuda.synchronize()
        if not os.path.exists(raw):
            print(f"\n## {what}: py-spy wrote nothing ({err.strip()[-300:]})")
            continue
        with open(raw) as f:
            threads = parse(f.read())
        step_us = secs / max(steps, 1) * 1e6
        print(f"\n## {what}: {steps} steps, {step_us:.0f} us a step under sampling (backward on the "
              f"{args.backward_thread} thread)")
        main_thread = next((t for t in threads.values() if "MainThread" in t.name), None)
        if main_thread is not None and main_thread.total:  # the step's time on this thread, by phase
            print("main thread, us a step: " + ", ".join(
                f"{k} {n / main_thread.total * step_us:.0f}" for k, n in sorted(main_thread.phases.items())))
        print(table(threads))


if __name__ == "__main__":
    main()
