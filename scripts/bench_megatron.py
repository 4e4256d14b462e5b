"""Megatron-LM's own training loop (``pretrain_gpt.py``, mock data, one GPU) with our layers against
Megatron's local spec in BF16: tokens/s and peak memory per variant, the benchmark that decides.

Each variant is one ``torchrun`` process running an unmodified Megatron-LM checkout: Megatron's
local spec in BF16 (the baseline: what a user has without us, run with the same core attention
as our spec, ``baseline_spec``; and ``megatron-bf16-own-attn`` with its own unfused attention),
our spec in BF16, and our spec under ``--fp8-format hybrid`` with each ``--fp8-recipe``,
``save_original_input`` flags off and on (``MEGATRON_FP8_CONFIG``, rules below), and each recipe
without the lean eager path (``ours-<recipe>-general``: ``MEGATRON_FP8_LEAN=0``), and with the
opt-in per-layer CUDA graphs (``ours-<recipe>-graphs``: ``MEGATRON_FP8_GRAPHS=1``); the
``-fullgraph`` variants (Megatron's BF16 too) run under Megatron-LM's own whole-iteration CUDA
graph (``--cuda-graph-impl full_iteration``: forward and backward of every micro-batch captured
at iteration 3 and replayed after), rated against Megatron's BF16 run the same way. Time per
iteration is Megatron's own log ("elapsed time per iteration"), the median over the log intervals
ending after iteration 10 (warm-up; in a short run, after the first two; 30 iterations by
default); an interval over 20% slower than that median is named with the mean over the intervals
(a one-off stall the median leaves out); peak memory is its ``max allocated`` report. Prints a table, writes
``bench_megatron.json`` and ``bench_megatron.png`` under ``--out``. ``--repeats N`` runs every variant in N
interleaved rounds (a process each) and adds the median of the rounds, with each variant's ratio
taken against the baseline of its own round: at dense-1b one process moves by 15-25%.

    python scripts/bench_megatron.py --megatron-lm ~/Megatron-LM --configs dense-1b,moe --layers 4

Our runs go through ``python -m megatron_fp8.megatron.launch --count-gemms``: each prints how many
FP8 GEMMs ran on which backend (the ``gemms`` column), proof that no GEMM was emulated, and how
many FP8 layer forwards the lean eager path served (``forwards``). Recording them costs ~1 us a
GEMM. ``--smoke``: four iterations per variant, no plot. ``--from-log LOG...``: the table, JSON and
plot again from the ``bench_megatron.log`` of earlier runs (also of a run cut short), no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

CONFIGS: dict[str, list[str]] = {
    "dense-8b": ["--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
                 "--group-query-attention", "--num-query-groups", "8"],
    "dense-1b": ["--hidden-size", "2048", "--ffn-hidden-size", "8192", "--num-attention-heads", "16",
                 "--group-query-attention", "--num-query-groups", "8"],
    "moe": ["--hidden-size", "2048", "--ffn-hidden-size", "8192", "--num-attention-heads", "16",
            "--group-query-attention", "--num-query-groups", "8", "--num-experts", "16", "--moe-router-topk", "4",
            "--moe-ffn-hidden-size", "1024", "--moe-shared-expert-intermediate-size", "2048", "--moe-grouped-gemm",
            "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", "1e-2"],
}
# the moe config with drop-and-pad routing (every expert gets capacity = tokens * topk / experts tokens;
# tokens over it are dropped): static shapes, so MoE runs under the whole-iteration graph too
CONFIGS["moe-capacity"] = CONFIGS["moe"] + ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
COMMON = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
          "--untie-embeddings-and-output-weights", "--bf16", "--transformer-impl", "local", "--mock-data",
          "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--eval-iters", "0", "--eval-interval",
          "1000000", "--lr", "1e-4", "--lr-decay-style", "constant", "--weight-decay", "0.0", "--clip-grad", "1.0",
          "--attention-softmax-in-fp32", "--seed", "1234"]
# Megatron's fusions that need what this machine lacks: apex (gradient-accumulation fusion, the
# persistent layer norm), Transformer Engine (RoPE fusion), Megatron's compiled softmax kernels
# (masked-softmax fusion, unused beside SDPA anyway). Off in both specs, always (the plug-in would
# take the gradient-accumulation fusion without apex for our linears: the ``-fused`` variants).
NEEDS_TE_OR_APEX = ["--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion",
                    "--no-persist-layer-norm"]
# The ones Megatron runs by default without them (torch.compile'd SwiGLU and bias-dropout-add):
# ``--fusions off`` (runs AC-AE) turns them off too, ``--fusions megatron`` keeps Megatron's default.
# ``--fusions rope``: Megatron's default and its RoPE fusion too, from our plug-in (megatron/rope.py,
# the unfused bits in one pass), in every variant that runs a spec of ours (baselines included, all
# through our launcher, which installs it before Megatron checks its config).
ROPE_FUSION_OFF = "--no-rope-fusion"
COMPILED_FUSIONS_OFF = ["--no-bias-swiglu-fusion", "--no-bias-dropout-fusion"]
SPEC = ["--spec", "megatron_fp8.megatron.plugin", "layer_spec"]
# Megatron's own linears with our core attention (SDPA on CUDA): attention for attention
BASELINE_SPEC = ["--spec", "megatron_fp8.megatron.plugin", "baseline_spec"]
BASELINES = ("megatron-bf16", "megatron-bf16-caller", "megatron-bf16-fullgraph")  # run with it; the ratios' references
# Megatron-LM's whole-iteration CUDA graph (forward_backward_func captured after its warm-up steps);
# it asks for the NaN check off (that check reads the loss on the host)
FULL_GRAPH = ["--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad"]
_PROJ = '  - match: "*.self_attention.linear_proj"\n    save_original_input: true\n'
_SHARED = '  - match: "*.shared_experts.linear_fc1"\n    save_original_input: true\n'
FLAG_RULES = {"dense": "layers:\n" + _PROJ, "moe": "layers:\n" + _PROJ + _SHARED}  # the mission's placements
RECIPES = ("tensorwise", "blockwise", "delayed")


@dataclass
class Variant:
    name: str
    ours: bool
    recipe: str | None = None
    flags: bool = False
    fmt: str = "hybrid"  # Megatron's --fp8-format (hybrid: E5M2 gradients, what Megatron users pass)
    general: bool = False  # MEGATRON_FP8_LEAN=0: our layers without the lean eager path (ops/lean.py)
    graphs: bool = False  # MEGATRON_FP8_GRAPHS=1: our FP8 linears replay per-layer CUDA graphs (ops/graphed.py)
    fused: bool = False  # MEGATRON_FP8_WGRAD_FUSION=on: our linears add their wgrad into main_grad (no apex needed)
    caller: bool = False  # backward on the training thread, not the autograd engine's CUDA device thread
    full_graph: bool = False  # Megatron-LM's --cuda-graph-impl full_iteration (FULL_GRAPH)


def variants(names: list[str] | None) -> list[Variant]:
    all_ = [Variant("megatron-bf16", False), Variant("megatron-bf16-own-attn", False), Variant("ours-bf16", True)]
    for r in RECIPES:
        all_ += [Variant(f"ours-{r}", True, r), Variant(f"ours-{r}+flags", True, r, True)]
    all_.append(Variant("ours-blockwise-e4m3", True, "blockwise", fmt="e4m3"))  # the E5M2 GEMMs' share, apart
    all_ += [Variant(f"ours-{r}-general", True, r, general=True) for r in RECIPES]  # what the lean path buys
    all_ += [Variant(f"ours-{r}-graphs", True, r, graphs=True) for r in RECIPES if r != "delayed"]  # opt-in graphs
    # gradient-accumulation fusion in our linears only (Megatron's own layers would need apex for it)
    all_ += [Variant("ours-bf16-fused", True, fused=True)]  # (the FP8-off layers fuse it the same way)
    all_ += [Variant(f"ours-{r}-fused", True, r, fused=True) for r in RECIPES if r != "delayed"]
    all_ += [Variant(f"ours-{r}-fused-graphs", True, r, graphs=True, fused=True) for r in RECIPES if r != "delayed"]
    # the autograd engine's multithreading off on the training thread (a ``sitecustomize``): backward
    # runs on the thread that calls it, not on the engine's CUDA device thread (run AM)
    all_ += [Variant("megatron-bf16-caller", False, caller=True)]
    all_ += [Variant(f"ours-{r}-caller", True, r, caller=True) for r in RECIPES if r != "delayed"]
    # Megatron-LM's whole-iteration CUDA graph, the baseline too (host cost gone on both sides)
    all_ += [Variant("megatron-bf16-fullgraph", False, full_graph=True), Variant("ours-bf16-fullgraph", True,
                                                                                full_graph=True)]
    all_ += [Variant(f"ours-{r}-fullgraph", True, r, full_graph=True) for r in RECIPES]
    # both: the wgrad GEMMs add into main_grad (no separate FP32 adds) where no host cost is left to pay for it
    all_ += [Variant(f"ours-{r}-fused-fullgraph", True, r, fused=True, full_graph=True) for r in RECIPES
             if r != "delayed"]
    return [v for v in all_ if names is None or v.name in names]


_CALLER_SITE = """import os
import sys

import torch

torch.autograd.set_multithreading_enabled(False)  # thread-local: the main thread, Megatron's loop
print("bench_megatron: autograd multithreading off on the main thread (backward on the caller)", file=sys.stderr)
_here = os.path.dirname(os.path.abspath(__file__))
for _d in sys.path:  # the sitecustomize this one shadows (a distribution's or a venv's), run as it would be
    _f = os.path.join(_d or ".", "sitecustomize.py")
    if os.path.abspath(_d or ".") != _here and os.path.isfile(_f):
        with open(_f) as _src:
            exec(compile(_src.read(), _f, "exec"), {"__name__": "sitecustomize", "__file__": _f})
        break
"""


def _caller_site(out: str) -> str:
    """A folder holding a ``sitecustomize.py`` that turns the autograd engine's multithreading
    off on the process's main thread (where Megatron-LM's loop calls backward)."""
    folder = os.path.join(os.path.abspath(out), "caller_site")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(_CALLER_SITE)
    return folder


@dataclass
class Result:
    config: str
    variant: str
    ms: float | None
    tokens_per_s: float | None
    max_alloc_mib: float | None
    gemms: str
    rc: int
    tail: str
    forwards: str = ""  # FP8 layer forwards by path (lean / general), as --count-gemms prints them
    intervals: tuple[float, ...] = ()  # the steady log intervals the median is taken over (ms/iter)
    loss: float | None = None  # the last logged lm loss: variants of one config train the same model on the same data
    round: int = 0  # with --repeats: which pass over the variants ran it (each pass runs every variant once)
    graphs_held: str = ""  # MEGATRON_FP8_GRAPHS=1: what the per-layer graphs hold, as the plug-in prints it


DRIFT = 0.10  # intervals whose first and last differ by more than this share of their median: not steady


SPIKE = 0.20  # an interval this much slower than the median is a stall the median leaves out


def spikes(intervals: tuple[float, ...]) -> list[float]:
    """The steady intervals more than ``SPIKE`` slower than their median (a one-off stall: the
    median leaves it out, the run's mean does not). In our eager runs one such stall was a full
    collection of Python's garbage collector (run AS), which Megatron-LM's ``--manual-gc`` avoids."""
    if len(intervals) < 3:
        return []
    mid = statistics.median(intervals)
    return [t for t in intervals if t > mid * (1 + SPIKE)]


def drift(intervals: tuple[float, ...]) -> float | None:
    """``(last - first) / median`` of the steady intervals where that exceeds ``DRIFT`` in size (a
    run still warming up, or slowing down: its median is not a steady state), else None."""
    if len(intervals) < 2:
        return None
    d = (intervals[-1] - intervals[0]) / statistics.median(intervals)
    return d if abs(d) > DRIFT else None


def _command(args: argparse.Namespace, config: str, v: Variant, rules: str) -> tuple[list[str], dict[str, str]]:
    script = os.path.join(args.megatron_lm, "pretrain_gpt.py")
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    rope = getattr(args, "fusions", "off") == "rope" and (v.ours or v.name in BASELINES)
    if v.ours:  # our launcher: installs the plug-in before Megatron validates its config (MoE + fp8, no TE)
        run += ["-m", "megatron_fp8.megatron.launch", "--count-gemms", script]
    elif rope:  # the baseline's config asks for the fused RoPE too: the plug-in must be in before it
        run += ["-m", "megatron_fp8.megatron.launch", script]
    else:
        run += [script]
    layers = ["--num-layers", str(args.layers), "--seq-length", str(args.seq), "--max-position-embeddings",
              str(args.seq), "--micro-batch-size", str(args.mbs), "--global-batch-size", str(args.mbs * args.micro),
              "--train-iters", str(args.iters), "--log-interval", str(args.log_interval)]
    spec = SPEC if v.ours else BASELINE_SPEC if v.name in BASELINES else []
    fusions = [f for f in NEEDS_TE_OR_APEX if not (rope and f == ROPE_FUSION_OFF)]
    fusions += COMPILED_FUSIONS_OFF if getattr(args, "fusions", "off") == "off" else []
    cmd = run + CONFIGS[config] + COMMON + fusions + layers + spec
    if getattr(args, "no_dropout", False):  # as Llama-style models train (Megatron's default is 0.1 for both)
        cmd += ["--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
    if v.full_graph:
        cmd += FULL_GRAPH
    elif getattr(args, "no_nan_check", False):  # as the whole-iteration graph needs: eager runs on equal terms
        cmd += ["--no-check-for-nan-in-loss-and-grad"]
    if v.recipe is not None:
        cmd += ["--fp8-format", v.fmt, "--fp8-recipe", v.recipe]
        if v.recipe == "delayed":
            cmd += ["--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max"]
    cmd += shlex.split(getattr(args, "megatron_args", "") or "")  # the user's own, in every variant
    if getattr(args, "profile", False):  # Megatron's own torch.profiler window: one iteration after the warm-up
        start = min(WARMUP_ITERS + 2, args.iters - 1)
        cmd += ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(start), "--profile-step-end",
                str(start + 1), "--tensorboard-dir", os.path.join(_profile_dir(args, config, v), "tb")]
    env = dict(os.environ)
    site = [_caller_site(args.out)] if v.caller else []
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(site + [args.megatron_lm, repo, env.get("PYTHONPATH", "")])
    env.pop("MEGATRON_FP8_CONFIG", None)
    env.pop("MEGATRON_FP8_LEAN", None)
    env.pop("MEGATRON_FP8_GRAPHS", None)
    env.pop("MEGATRON_FP8_WGRAD_FUSION", None)
    if v.fused:
        env["MEGATRON_FP8_WGRAD_FUSION"] = "on"
    if v.general:
        env["MEGATRON_FP8_LEAN"] = "0"
    if v.graphs:
        env["MEGATRON_FP8_GRAPHS"] = "1"
    if v.flags:
        env["MEGATRON_FP8_CONFIG"] = rules
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return cmd, env


def _profile_dir(args: argparse.Namespace, config: str, v: Variant) -> str:
    return os.path.join(os.path.abspath(args.out), "profiles", f"{config}-{v.name}")


def profile_of(args: argparse.Namespace, config: str, v: Variant) -> dict[str, Any] | None:
    """``trace_step.summarize`` of the variant's profiled iteration (Megatron writes the trace
    next to its TensorBoard folder), with its ``top_kernels`` under ``"kernels"`` and its step
    annotations under ``"annotations"``, or None without one."""
    path = os.path.join(_profile_dir(args, config, v), "torch_profile", "rank-0.json.gz")
    if not os.path.isfile(path):
        return None
    import trace_step  # scripts/: torch and the package, needed only here

    events = trace_step.load(path)
    return {**trace_step.summarize(events), "kernels": trace_step.top_kernels(events, getattr(args, "top_kernels", 15)),
            "annotations": trace_step.step_annotations(events)}


def _pyspy_path(args: argparse.Namespace, config: str, v: Variant) -> str:
    return os.path.join(os.path.abspath(args.out), f"pyspy_{config}_{v.name}.txt")


def run_sampled(cmd: list[str], env: dict[str, str], args: argparse.Namespace, path: str) -> tuple[str, int]:
    """Run ``cmd`` as ``subprocess.run`` would (output and return code; ``TIMEOUT`` after
    ``args.timeout``), and once Megatron logs the first iteration past the warm-up, sample it
    and its children with py-spy (wall time: idle threads too, ``--nonblocking``) until it exits,
    raw stacks to ``path``."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(args.timeout, proc.kill)
    timer.start()
    lines, spy = [], None
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        m = _ITER.search(line)
        if spy is None and m and int(m.group(1)) >= WARMUP_ITERS:
            spy = subprocess.Popen([args.pyspy_bin, "record", "--pid", str(proc.pid), "--subprocesses", "--idle",
                                    "--threads", "--nonblocking", "--rate", f"{args.pyspy:g}", "--format", "raw",
                                    "-o", path], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rc = proc.wait()
    timed_out = not timer.is_alive()
    timer.cancel()
    if spy is not None:
        try:
            _, err = spy.communicate(timeout=60)
            if spy.returncode:
                lines.append(f"py-spy failed (rc={spy.returncode}): {err.strip()[-500:]}\n")
        except subprocess.TimeoutExpired:
            spy.kill()
    elif args.pyspy:
        lines.append(f"py-spy: never started (no iteration past {WARMUP_ITERS} logged)\n")
    return "".join(lines) + ("\nTIMEOUT" if timed_out else ""), -1 if timed_out else rc


def _text(b: bytes | str | None) -> str:
    return "" if b is None else b.decode(errors="replace") if isinstance(b, bytes) else b


_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
WARMUP_ITERS = 10  # intervals ending here or before are warm-up (compiles, allocator, router, clocks)
_MEM = re.compile(r"max allocated: ([\d.]+)")
_LOSS = re.compile(r"lm loss: ([\d.E+-]+)")
_GEMMS = re.compile(r"megatron_fp8 \[rank 0\]: (\d+ FP8 GEMMs \([^)]*\))")
_FORWARDS = re.compile(r"megatron_fp8 \[rank 0\]: \d+ FP8 layer forwards \(([^)]*)\)")
_HELD = re.compile(r"the CUDA graphs of (\d+) FP8 linears(?: \((\d+) graph pairs[^)]*\))? hold ([\d,]+) MiB")


def parse(config: str, v: Variant, out: str, rc: int, tokens_per_iter: int) -> Result:
    logged = [(int(i), float(t)) for i, t in _ITER.findall(out)]  # iteration 1, then every log interval
    steady = [t for i, t in logged if i > WARMUP_ITERS]
    if len(steady) < 2:  # a short run (--smoke): all but the first two intervals
        steady = [t for _, t in logged][2:] or [t for _, t in logged][-1:]
    ms = statistics.median(steady) if steady else None
    mem = [float(m) for m in _MEM.findall(out)]
    gemms, forwards = _GEMMS.findall(out), _FORWARDS.findall(out)
    tail = "\n".join(out.strip().splitlines()[-25:]) if rc else ""
    losses = _LOSS.findall(out)
    return Result(config, v.name, ms, tokens_per_iter / ms * 1e3 if ms else None, max(mem) if mem else None,
                  gemms[-1] if gemms else "", rc, tail, forwards[-1] if forwards else "", tuple(steady),
                  float(losses[-1]) if losses else None, graphs_held=_graphs_held(out))


def _graphs_held(out: str) -> str:
    """The plug-in's last line on what the per-layer graphs hold, shortened for the table ("" if none)."""
    found = _HELD.findall(out)
    if not found:
        return ""
    layers, pairs, mib = found[-1]
    return f"graphs hold {mib} MiB ({layers} linears{f', {pairs} graph pairs' if pairs else ''})"


_SECTION = re.compile(r"^===== (\S+) (\S+) rc=(-?\d+)(?: round=(\d+))?\n\$ (.*)$", re.M)


def from_logs(paths: list[str]) -> list[Result]:
    """The results recorded in earlier ``bench_megatron.log`` files (one section per run)."""
    results: list[Result] = []
    for path in paths:
        with open(path) as f:
            text = f.read()
        marks = list(_SECTION.finditer(text))
        found = []
        for i, m in enumerate(marks):
            body = text[m.end():marks[i + 1].start() if i + 1 < len(marks) else len(text)]
            cmd = m.group(5).split()
            seq = int(cmd[cmd.index("--seq-length") + 1])
            gbs = int(cmd[cmd.index("--global-batch-size") + 1])
            v = next((v for v in variants(None) if v.name == m.group(2)), Variant(m.group(2), True))
            r = parse(m.group(1), v, body, int(m.group(3)), seq * gbs)
            found.append(replace(r, round=int(m.group(4) or 0)))
        seen = {(r.config, r.variant, r.round) for r in results}
        if any((r.config, r.variant, r.round) in seen for r in found):  # another call's runs: rounds of their own
            shift = 1 + max(r.round for r in results)
            found = [replace(r, round=r.round + shift) for r in found]
        results += found  # (a log that only adds variants, e.g. a rerun of a cut-short call, joins its rounds)
    return results


def _baseline(variant: str) -> str:
    """The run a variant's ratio is taken against: Megatron's BF16, with its backward on the
    calling thread too for a ``-caller`` variant, under the whole-iteration graph too for a
    ``-fullgraph`` one."""
    return next((b for b in BASELINES[1:] if variant.endswith(b.rpartition("-")[2])), BASELINES[0])


def table(results: list[Result]) -> str:
    rows = [f"{'config':9} {'variant':24} {'ms/iter':>8} {'tokens/s':>10} {'vs megatron':>11} {'max alloc MiB':>13}"
            f"  gemms"]
    base = {(r.config, r.variant): r.tokens_per_s for r in results
            if r.variant in BASELINES and r.tokens_per_s}
    for r in results:
        key = (r.config, _baseline(r.variant))
        rel = f"{r.tokens_per_s / base[key]:.3f}x" if r.tokens_per_s and key in base else "-"
        ms = f"{r.ms:.1f}" if r.ms else f"rc={r.rc}"
        tps = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-"
        mem = f"{r.max_alloc_mib:,.0f}" if r.max_alloc_mib else "-"
        notes = [r.gemms] if r.gemms else []
        eager = base.get((r.config, BASELINES[0]))
        if key[1] != BASELINES[0] and r.tokens_per_s and eager:  # also against the eager baseline
            notes.append(f"{r.tokens_per_s / eager:.3f}x {BASELINES[0]}")
        if r.forwards:
            notes.append(f"forwards: {r.forwards}")
        if r.graphs_held:
            notes.append(r.graphs_held)
        if r.loss is not None:
            notes.append(f"last lm loss {r.loss:.4f}")
        slow = spikes(r.intervals)
        if slow:  # the mean over the same intervals, and the ratio of means where the baseline has one
            mean = statistics.fmean(r.intervals)
            ref = next((b for b in results if (b.config, b.variant) == key and b.intervals), None)
            by_means = f", {statistics.fmean(ref.intervals) / mean:.3f}x by means" if ref is not None else ""
            notes.append(f"SLOW INTERVAL {' / '.join(f'{t:.0f}' for t in slow)} ms: mean {mean:.1f} ms/iter{by_means}")
        d = drift(r.intervals)
        if d is not None:
            notes.append(f"NOT STEADY, intervals {' / '.join(f'{t:.0f}' for t in r.intervals)} ms ({d:+.0%} first "
                         f"to last)")
        rows.append(f"{r.config:9} {r.variant:24} {ms:>8} {tps:>10} {rel:>11} {mem:>13}  {'; '.join(notes)}")
    return "\n".join(rows)


def plot(results: list[Result], path: str) -> None:
    """Bars of each variant's tokens/s over its baseline's: the median of the per-round ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = {key: statistics.median(v) for key, v in paired_ratios(results).items()}
    rounds = len({r.round for r in results})
    configs = list(dict.fromkeys(r.config for r in results))
    fig, axes = plt.subplots(1, len(configs), figsize=(5 * len(configs), 4), squeeze=False)
    for ax, cfg in zip(axes[0], configs):
        names = [v for c, v in dict.fromkeys((r.config, r.variant) for r in results) if c == cfg and (c, v) in ratios]
        if not names:
            continue
        ax.barh(names, [ratios[(cfg, v)] for v in names], color="tab:blue")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_title(f"{cfg}: tokens/s vs Megatron BF16" + (f", median of {rounds} rounds" if rounds > 1 else ""))
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron-lm", help="a Megatron-LM checkout (holds pretrain_gpt.py)")
    ap.add_argument("--from-log", nargs="+", help="rebuild the table/JSON/plot from these bench_megatron.log files")
    ap.add_argument("--configs", default="dense-1b,dense-8b,moe")
    ap.add_argument("--variants", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per iteration")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--log-interval", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="four iterations per variant, no plot")
    ap.add_argument("--profile", action="store_true",
                    help="profile iteration 12 (Megatron's --use-pytorch-profiler) and print where its time goes "
                         "(trace_step.py --summarize): GPU busy/idle, GEMMs, FP8 casts, attention, host in our layers; "
                         "the profiler slows host-bound steps, so take ms/iter from a run without it")
    ap.add_argument("--no-dropout", action="store_true",
                    help="every run with --attention-dropout 0.0 --hidden-dropout 0.0 (Megatron's defaults are 0.1; "
                         "Llama-style models train without dropout)")
    ap.add_argument("--top-kernels", type=int, default=15, metavar="N",
                    help="with --profile: how many kernels to list per variant, most GPU time first")
    ap.add_argument("--no-nan-check", action="store_true",
                    help="every run with --no-check-for-nan-in-loss-and-grad, as the -fullgraph variants need "
                         "(Megatron's check reads the loss on the host each micro-batch)")
    ap.add_argument("--pyspy", type=float, default=0, metavar="HZ",
                    help="sample each run with py-spy at this rate once the warm-up is over, and print where its "
                         "wall time goes per thread (trace_step.py --pyspy); samples in pyspy_<config>_<variant>.txt")
    ap.add_argument("--pyspy-bin", default=shutil.which("py-spy") or "/tmp/site/bin/py-spy")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--fusions", choices=("off", "megatron", "rope"), default="off",
                    help="off: Megatron's SwiGLU and bias-dropout-add fusions off too (runs AC-AE); megatron: "
                         "on, as Megatron runs by default (torch.compile'd); those needing apex or TE stay off; "
                         "rope: megatron's and its RoPE fusion, from our plug-in, in every variant with a spec "
                         "of ours (the baselines too)")
    ap.add_argument("--megatron-args", default="", metavar="ARGS",
                    help="more Megatron-LM arguments for every variant, one string (e.g. \"--recompute-granularity "
                         "full --recompute-method uniform --recompute-num-layers 1\")")
    ap.add_argument("--repeats", type=int, default=1, metavar="N",
                    help="run every variant N times, one process each, in N interleaved rounds (all variants, then "
                         "all again): a table per round, then the median of the rounds with its range and the median "
                         "of each round's ratio to the baseline of the same round; at dense-1b a single process moves "
                         "by 15-25%%, more than the gaps measured")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: at least 1")
    if args.repeats > 1 and (args.profile or args.pyspy):
        ap.error("--profile and --pyspy write one trace per variant: run them with --repeats 1")
    if args.from_log:
        os.makedirs(args.out, exist_ok=True)
        return report(from_logs(args.from_log), args, plot_too=True)
    if not args.megatron_lm or not os.path.isfile(os.path.join(args.megatron_lm, "pretrain_gpt.py")):
        ap.error(f"--megatron-lm {args.megatron_lm}: no pretrain_gpt.py there")
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        ap.error(f"--configs: unknown {sorted(unknown)}; choose from {sorted(CONFIGS)}")
    if args.smoke:
        args.iters, args.log_interval = min(args.iters, 4), 2
    os.makedirs(args.out, exist_ok=True)
    rules = {}
    for kind, text in FLAG_RULES.items():
        with tempfile.NamedTemporaryFile("w", suffix=f"-{kind}.yaml", delete=False) as f:
            f.write(text)
        rules[kind] = f.name
    results: list[Result] = []
    profiles: dict[str, dict[str, Any]] = {}
    chosen = variants(args.variants.split(",") if args.variants else None)
    log = open(os.path.join(args.out, "bench_megatron.log"), "w")
    for config, v, k in ((c, v, k) for k in range(args.repeats) for c in args.configs.split(",") for v in chosen):
        cmd, env = _command(args, config, v, rules["moe" if config.startswith("moe") else "dense"])
        t0 = time.time()
        samples = _pyspy_path(args, config, v)
        if args.pyspy:
            out, rc = run_sampled(cmd, env, args, samples)
        else:
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                out, rc = p.stdout + p.stderr, p.returncode
            except subprocess.TimeoutExpired as e:
                out, rc = f"{_text(e.stdout)}{_text(e.stderr)}\nTIMEOUT", -1
        r = replace(parse(config, v, out, rc, args.seq * args.mbs * args.micro), round=k)
        if args.profile:
            profiles[f"{config} {v.name}"] = profile_of(args, config, v) or {}
        results.append(r)
        print(f"{config} {v.name}{f' (round {k + 1})' if args.repeats > 1 else ''}: rc={rc} {r.ms} ms/iter, "
              f"{r.max_alloc_mib} MiB, {r.gemms} ({time.time() - t0:.0f} s)", flush=True)
        if rc:
            print(r.tail, flush=True)
        log.write(f"===== {config} {v.name} rc={rc}{f' round={k}' if args.repeats > 1 else ''}\n$ {' '.join(cmd)}\n"
                  f"{out}\n")
        log.flush()
        if args.pyspy and os.path.isfile(samples):
            import trace_step  # scripts/

            print(f"\n## {config} {v.name}: where the process's wall time goes after the warm-up "
                  f"(py-spy, {args.pyspy:g} Hz)\n")
            print(trace_step.pyspy_summarize(samples, args.pyspy), flush=True)
    if profiles:
        found = {k: p for k, p in profiles.items() if p}
        print("\n## Where one iteration's time goes (ms, profiled; trace_step.py --summarize)\n")
        import trace_step

        print(trace_step.table(found) if found else "no trace was written (is --profile supported by this "
                                                      "Megatron-LM?)")
        for name, p in found.items():
            marks = ", ".join(f"{n} {ms} ms" for n, ms in p.get("annotations", []))
            print(f"\n### {name}: the kernels with the most GPU time (ms per profiled iteration; "
                  f"step annotations: {marks})\n")
            print(trace_step.kernels_table(p["kernels"]))
        print(f"runs without a trace: {sorted(set(profiles) - set(found))}" if len(found) < len(profiles) else "")
        with open(os.path.join(args.out, "bench_megatron_profiles.json"), "w") as g:
            json.dump(profiles, g, indent=1)
    return report(results, args, plot_too=not args.smoke)


def paired_ratios(results: list[Result]) -> dict[tuple[str, str], list[float]]:
    """Per config and variant, its tokens/s over its baseline's (``_baseline``) in each round where
    both ran: the ratios ``rounds_table`` and the plot report."""
    by = {(r.config, r.variant, r.round): r for r in results if r.ms}
    out: dict[tuple[str, str], list[float]] = {}
    for (config, variant, k), r in by.items():
        base = by.get((config, _baseline(variant), k))
        if base is not None:
            out.setdefault((config, variant), []).append(base.ms / r.ms)
    return out


def rounds_table(results: list[Result]) -> str:
    """With ``--repeats``: per config and variant, the median over the rounds of each process's
    ms/iter (its range beside it), and the median of the per-round ratios to the baseline run in
    the same round: paired, so a round where the host ran slow for every process moves no ratio."""
    rounds = sorted({r.round for r in results})
    by = {(r.config, r.variant, r.round): r for r in results if r.ms}
    paired = paired_ratios(results)
    rows = ["| config | variant | ms/iter, median of rounds (range) | vs megatron, median of the rounds' ratios "
            "(range) | rounds |", "|---|---|---|---|---|"]
    for config, variant in dict.fromkeys((r.config, r.variant) for r in results):
        runs = [by[(config, variant, k)] for k in rounds if (config, variant, k) in by]
        if not runs:
            rows.append(f"| {config} | {variant} | failed in every round | - | 0 |")
            continue
        ms = [r.ms for r in runs if r.ms]
        ratios = paired.get((config, variant), [])
        rel = f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else "-"
        rows.append(f"| {config} | {variant} | {statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f}) | {rel} | "
                    f"{len(runs)} of {len(rounds)} |")
    return "\n".join(rows)


def report(results: list[Result], args: argparse.Namespace, plot_too: bool) -> int:
    rounds = sorted({r.round for r in results})
    for k in rounds:
        if len(rounds) > 1:
            print(f"\n## Round {k + 1} of {len(rounds)}\n")
        print(table([r for r in results if r.round == k]))
    if len(rounds) > 1:
        print(f"\n## Over the {len(rounds)} rounds (one process per variant and round, variants interleaved)\n")
        print(rounds_table(results))
    with open(os.path.join(args.out, "bench_megatron.json"), "w") as g:
        json.dump({"args": vars(args), "results": [asdict(r) for r in results]}, g, indent=1)
    if plot_too:
        plot(results, os.path.join(args.out, "bench_megatron.png"))
    return 1 if any(r.rc for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
