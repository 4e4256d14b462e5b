"""Host cost per layer, eager (the eager-host-cost issue's table): host microseconds per
forward + backward of each layer at a token count where the GPU idles, with the BF16 references
(``nn.Linear``, ``torch._grouped_mm``) measured in the same process, and the ratio to them.
Each step enters ``fp8_autocast`` anew and so casts the weight again; the rows "weight cast
reused" pass ``is_first_microbatch=False``, as Megatron's loop does after an iteration's first
micro-batch (a diagnostic beside the issue's rows).

On CUDA, host time is the wall time of issuing back-to-back steps (the GPU is not waited on;
device time is given beside it: host >= device means the step is launch-bound). On a CPU there
is no asynchronous device: the wall time per step is printed (a proxy for Python and dispatch
cost at these small shapes, not the GPU's numbers). Each row has a layer of its own, and a
process times every row in ``--rounds`` rounds (5) of ``--calls / --rounds`` steps (100 in all),
in an order rotated each round: a row's ratio to its reference is the median of the two's
ratios within a round, so a drift of the host's speed during the process (run AN's single-pass
table spread 2.3-7.1x for one row over three processes) reaches both alike. The CUDA-graph rows
have rounds of their own after the others, beside the reference timed again. ``--processes N``
runs the measurement in N fresh processes and prints the median of each host time, and of each
row's ratio (with the range over the processes: the host's speed moves between rounds and
machines, docs/benchmarks.md run AL). The rows marked "general
path" run our ``Linear`` and ``GroupedLinear`` with ``MEGATRON_FP8_LEAN=0`` (without the lean eager paths), for the
comparison in the same processes; on CUDA the rows "CUDA graphs" run it with ``MEGATRON_FP8_GRAPHS=1``
(ops/graphed.py: each step replays the layer's captured forward and backward). Each step runs
one layer's backward, so by default each step hands its backward to autograd's CUDA device thread
and back: on the lent H100s that handoff slowed every row (ours by up to ~300 us, ``nn.Linear``
by 30-60), which Megatron-LM's loop pays once per micro-batch, not per layer (run AM);
``--backward-thread caller`` keeps the backward on the calling thread, references included.

    python scripts/profile_host.py [--tokens 256] [--k 2048] [--n 2048] [--experts 8] [--processes 3]
                                   [--calls 100] [--rounds 5] [--backward-thread engine|caller]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch
from benchlib import environment, host_and_device_ms, markdown_table, wall_us, write_outputs

import megatron_fp8 as mf
from megatron_fp8.modules.grouped import GroupedLinear
from megatron_fp8.recipe import PRESETS, Float8BlockScaling, Format
from megatron_fp8.testing import router_splits

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _host_device_us(step: Callable[[], None], calls: int) -> tuple[float, float]:
    """(host us, device us) per step: back to back on CUDA; on a CPU both are the wall time."""
    for _ in range(3):
        step()
    if CUDA:
        host_ms, device_ms = host_and_device_ms(step, n=calls)
        return host_ms * 1e3, device_ms * 1e3
    us = wall_us(step, calls)
    return us, us


def _fwd_bwd(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, recipe: object | None,
             *args: object) -> Callable[[], None]:
    def step() -> None:
        if recipe is None:
            y = layer(x, *args)
        else:
            with mf.fp8_autocast(fp8_recipe=recipe):
                y = layer(x, *args)
        y.backward(dy)
    return step


def _with_env(step: Callable[[], None], var: str, value: str) -> Callable[[], None]:
    """``step`` with the setting ``var=value`` (read per call), restored after (the two
    environment writes are inside the timed step)."""
    def run() -> None:
        before = os.environ.get(var)
        os.environ[var] = value
        try:
            step()
        finally:
            if before is None:
                del os.environ[var]
            else:
                os.environ[var] = before
    return run


def _general(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with ``MEGATRON_FP8_LEAN=0``: the general path."""
    return _with_env(step, "MEGATRON_FP8_LEAN", "0")


def _grouped_mm_step(x: torch.Tensor, w: torch.Tensor, splits: list[int], dy: torch.Tensor) -> Callable[[], None]:
    offs = torch.tensor(splits, device=x.device).cumsum(0).to(torch.int32)

    def step() -> None:
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        y.backward(dy)
    return step


def _routed(tokens: int, experts: int, steps: int = 16) -> list[list[int]]:
    """``steps`` different splits of ``tokens * experts`` rows as a top-2 router hands them out
    (uneven, mostly not multiples of 16 or 128); the step takes the next one each call, as a
    training step gets new splits, so nothing keyed by the splits is reused between steps."""
    return [router_splits(tokens * experts, experts, 2, seed=s) for s in range(steps)]


def _routed_step(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, recipe: object,
                 splits: list[list[int]]) -> Callable[[], None]:
    turn = itertools.cycle(splits)

    def step() -> None:
        with mf.fp8_autocast(fp8_recipe=recipe):
            y = layer(x, next(turn))
        y.backward(dy)
    return step


Row = tuple[str, float, float, float | None]  # label, host us, device us, ratio to its reference (None: not taken)


def _steps(args: argparse.Namespace) -> list[tuple[str, Callable[[], None]]]:
    """(row label, step) for every row of the table, each row with a layer of its own (so that
    rows measured in turn never switch a layer's recipe or settings between rounds)."""
    dt, t, k, n, e = torch.bfloat16, args.tokens, args.k, args.n, args.experts
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(t, k, device=DEVICE, dtype=dt, generator=g, requires_grad=True)
    dy = torch.randn(t, n, device=DEVICE, dtype=dt, generator=g)
    steps: list[tuple[str, Callable[[], None]]] = []

    def linear() -> mf.Linear:
        return mf.Linear(k, n, bias=False, params_dtype=dt, device=DEVICE)

    steps.append(("BF16 nn.Linear", _fwd_bwd(torch.nn.Linear(k, n, bias=False, device=DEVICE, dtype=dt), x, dy, None)))
    steps.append(("our Linear, FP8 off", _fwd_bwd(linear(), x, dy, None)))
    for name in ("current", "blockwise", "delayed"):
        steps.append((f"our Linear, {name}", _fwd_bwd(linear(), x, dy, PRESETS[name])))
    for name in ("current", "blockwise", "delayed"):  # the same without the lean eager path (ops/lean.py)
        steps.append((f"our Linear, {name}, general path", _general(_fwd_bwd(linear(), x, dy, PRESETS[name]))))
    for name in ("current", "blockwise", "delayed"):  # Megatron's later micro-batches: the weight's cast kept
        steps.append((f"our Linear, {name}, weight cast reused", _fwd_bwd(linear(), x, dy, PRESETS[name], False)))
    if CUDA:  # the other GEMM caller: cuBLASLt's bound calls (kernels/cublaslt.py) for per-tensor scales
        # (torch's _scaled_mm by default), torch's scaled_mm for E4M3 blocks (cuBLASLt's by default)
        for name, var, value in (("current", "MEGATRON_FP8_TENSOR_GEMM", "cublaslt"),
                                 ("delayed", "MEGATRON_FP8_TENSOR_GEMM", "cublaslt"),
                                 ("blockwise", "MEGATRON_FP8_BLOCK_GEMM", "torch")):
            steps.append((f"our Linear, {name}, {var}={value}",
                          _with_env(_fwd_bwd(linear(), x, dy, PRESETS[name]), var, value)))
    # Megatron's --fp8-format hybrid: E5M2 gradients, whose block GEMMs torch refuses (cuBLASLt direct)
    steps.append(("our Linear, blockwise HYBRID",
                  _fwd_bwd(linear(), x, dy, Float8BlockScaling(fp8_format=Format.HYBRID))))
    xe = torch.randn(t * e, k, device=DEVICE, dtype=dt, generator=g, requires_grad=True)
    dye = torch.randn(t * e, n, device=DEVICE, dtype=dt, generator=g)
    even = [t] * e

    def grouped() -> GroupedLinear:
        return GroupedLinear(e, k, n, bias=False, params_dtype=dt, device=DEVICE)

    if hasattr(torch, "_grouped_mm") and CUDA:
        w = torch.randn(e, n, k, device=DEVICE, dtype=dt, generator=g, requires_grad=True)
        steps.append((f"BF16 torch._grouped_mm ({e} experts)", _grouped_mm_step(xe, w, even, dye)))
    steps.append(("our GroupedLinear, FP8 off, even splits", _fwd_bwd(grouped(), xe, dye, None, even)))
    for name in ("current", "blockwise"):
        steps.append((f"our GroupedLinear, {name}, even splits", _fwd_bwd(grouped(), xe, dye, PRESETS[name], even)))
    for name in ("current", "blockwise"):
        steps.append((f"our GroupedLinear, {name}, router splits",
                      _routed_step(grouped(), xe, dye, PRESETS[name], _routed(t, e))))
    for name in ("current", "blockwise"):  # the same without the lean grouped path (ops/lean_grouped.py)
        steps.append((f"our GroupedLinear, {name}, even splits, general path",
                      _general(_fwd_bwd(grouped(), xe, dye, PRESETS[name], even))))
    for name in ("current", "blockwise"):
        steps.append((f"our GroupedLinear, {name}, router splits, general path",
                      _general(_routed_step(grouped(), xe, dye, PRESETS[name], _routed(t, e)))))
    if CUDA:  # the experimental per-layer CUDA graphs (ops/graphed.py), timed after every other row
        for name in ("current", "blockwise"):
            for label, first in ((f"our Linear, {name}, CUDA graphs (MEGATRON_FP8_GRAPHS=1)", None),
                                 (f"our Linear, {name}, CUDA graphs, weight cast reused", False)):
                steps.append((label, _with_env(_fwd_bwd(linear(), x, dy, PRESETS[name], first),
                                               "MEGATRON_FP8_GRAPHS", "1")))
    return steps


def _graphed(label: str) -> bool:
    return "CUDA graphs" in label


def _order(labels: list[str], turn: int, rounds: int) -> list[str]:
    """Round ``turn``'s order of ``rounds``: the rows rotated by ``turn / rounds`` of their number,
    so that a drift of the host's speed within the process is spread over every row."""
    r = turn * len(labels) // rounds if labels else 0
    return labels[r:] + labels[:r]


def round_ratios(host: dict[str, list[float]]) -> dict[str, float | None]:
    """Each row's ratio to its BF16 reference: the median over rounds of the two measured in the
    same round (rounds where either was not measured are skipped); None without a reference."""
    labels = list(host)
    out: dict[str, float | None] = {}
    for lab in labels:
        ref = _reference(lab, labels)
        pairs = [(a, b) for a, b in zip(host[lab], host[ref])] if ref is not None else []
        ratios = [a / b for a, b in pairs if a == a and b == b and b > 0]  # (nan: a round without it)
        out[lab] = statistics.median(ratios) if ratios else None
    return out


def measure(args: argparse.Namespace) -> list[Row]:
    """(row label, host us, device us, ratio to its reference) for every row: ``--rounds`` rounds,
    each timing every row for ``--calls // --rounds`` steps in a rotated order (``_order``); host
    and device us are medians over the rounds, the ratio the median of the per-round ratios. The
    CUDA-graph rows come after every other row's rounds, in rounds of their own with the
    reference timed again in each: a failed capture may leave the process's CUDA state unusable
    (ops/graphed.py), so it ends the graph rounds (the rows not timed read nan) and nothing else."""
    steps = dict(_steps(args))
    if getattr(args, "rows", None):  # a subset, with the BF16 references
        steps = {lab: st for lab, st in steps.items() if lab.startswith("BF16") or re.search(args.rows, lab)}
    labels = list(steps)
    plain = [lab for lab in labels if not _graphed(lab)]
    calls = max(1, args.calls // args.rounds)
    host: dict[str, list[float]] = {lab: [] for lab in labels}
    dev: dict[str, list[float]] = {lab: [] for lab in labels}
    for turn in range(args.rounds):
        for lab in _order(plain, turn, args.rounds):
            h, d = _host_device_us(steps[lab], calls)
            host[lab].append(h)
            dev[lab].append(d)
    ratios = round_ratios({lab: host[lab] for lab in plain})
    graph_ratios: dict[str, list[float]] = {lab: [] for lab in labels if _graphed(lab)}
    reference = "BF16 nn.Linear"
    for _ in range(args.rounds if graph_ratios else 0):
        ref_us, _ = _host_device_us(steps[reference], calls)
        try:
            for lab in graph_ratios:
                h, d = _host_device_us(steps[lab], calls)
                host[lab].append(h)
                dev[lab].append(d)
                graph_ratios[lab].append(h / ref_us)
        except RuntimeError as exc:  # its capture failed: nan where not timed, and said here
            print(f"{lab}: {type(exc).__name__}: {exc}", file=sys.stderr)
            break
    for lab, got in graph_ratios.items():
        ratios[lab] = statistics.median(got) if got else None

    def median(v: list[float]) -> float:
        return statistics.median(v) if v else float("nan")
    return [(lab, median(host[lab]), median(dev[lab]), ratios[lab]) for lab in labels]


def _reference(label: str, labels: list[str]) -> str | None:
    """The BF16 row a row is compared with: ``torch._grouped_mm`` for the grouped rows, else
    ``nn.Linear``; None where that row was not measured (no ``_grouped_mm`` on CPU)."""
    if "Grouped" in label or "_grouped_mm" in label:
        return next((lab for lab in labels if lab.startswith("BF16 torch._grouped_mm")), None)
    return "BF16 nn.Linear"


def _table(runs: list[list[Row]] | list[list[tuple[str, float, float]]]) -> str:
    """Host us (median over the processes) and the ratio to the row's BF16 reference: each
    process's own ratio (the host's speed moved up to 2x between machines and ~30% between
    rounds on one, docs/benchmarks.md run AL, so a row is compared with the reference measured in
    its own process: in its own rounds where the process gives them, ``measure``), the median over
    the processes, and their range where there are several."""
    labels = [r[0] for r in runs[0]]
    host = {lab: statistics.median(run[i][1] for run in runs) for i, lab in enumerate(labels)}
    dev = {lab: statistics.median(run[i][2] for run in runs) for i, lab in enumerate(labels)}
    per_run = [{r[0]: r[1] for r in run} for run in runs]  # each process's host us by label
    given = [{r[0]: r[3] for r in run if len(r) > 3} for run in runs]  # each process's own ratios
    out = []
    for lab in labels:
        ref = _reference(lab, labels)
        if ref is None:
            ratio = "n/a"
        else:
            ratios = [g[lab] if g.get(lab) is not None else vals[lab] / vals[ref] for g, vals in zip(given, per_run)]
            ratio = f"{statistics.median(ratios):.2f}x"
            if len(ratios) > 1:
                ratio += f" ({min(ratios):.2f}-{max(ratios):.2f})"
        out.append([lab, f"{host[lab]:.0f}", f"{dev[lab]:.0f}" if CUDA else "-", ratio])
    what = "host us per fwd+bwd" if CUDA else "wall us per fwd+bwd (CPU)"
    return markdown_table(["layer", what, "device us", "vs its BF16 reference (per process: median, range)"], out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--calls", type=int, default=100, help="steps timed per row, over all rounds")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds per process: every row timed in each, in a rotated order; a row's ratio is the "
                        "median of its per-round ratios to its reference")
    p.add_argument("--processes", type=int, default=1, help="fresh processes; the table gives medians")
    p.add_argument("--rows", default=None, help="only the rows whose label matches this regular expression "
                   "(and the BF16 references)")
    p.add_argument("--out", default=None, help="also write the table to DIR/profile_host.md (scripts/probes/ab_env.py)")
    p.add_argument("--backward-thread", choices=("engine", "caller"), default="engine",
                   help="engine: backward on autograd's CUDA device thread (PyTorch's default); caller: on the "
                        "thread that calls it (autograd multithreading off, references included; run AM)")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one process's rows, for the parent
    args = p.parse_args()
    if args.backward_thread == "caller":
        torch.autograd.set_multithreading_enabled(False)  # this (main) thread's backward calls
    for v, name in ((args.tokens, "--tokens"), (args.k, "--k")):
        if v <= 0 or v % 128:
            p.error(f"{name}={v}: must be a positive multiple of 128 (the block recipes' in features, and the "
                    f"tokens of the experts' one-launch casts)")
    if args.n <= 0:
        p.error(f"--n={args.n}: must be positive")
    if args.rounds < 1 or args.calls < args.rounds:
        p.error(f"--rounds={args.rounds} with --calls={args.calls}: need 1 <= rounds <= calls")
    if args.json:
        print(json.dumps(measure(args)))
        return
    if args.processes > 1:
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--json"]
        runs = [json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
                for _ in range(args.processes)]
    else:
        runs = [measure(args)]
    where = "the calling thread" if args.backward_thread == "caller" else "autograd's CUDA device thread"
    title = (f"Host cost per layer (T={args.tokens}, K={args.k}, N={args.n}; grouped: {args.experts} experts x "
             f"{args.tokens} tokens), median of {len(runs)} process(es) of {args.rounds} rounds, backward on {where}")
    table = _table(runs)
    print(f"# {title}\n\n{environment()}\n\n{table}")
    if args.out:
        write_outputs("profile_host", title, table, args.out)


if __name__ == "__main__":
    main()
