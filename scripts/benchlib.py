"""Shared plumbing for the GPU benchmark scripts: timing, environment line, tables, plots.

Timing follows /work/.library/device/METHOD.md: CUDA-event timing through
``triton.testing.do_bench`` (median), after warm-up, on random (never zero) data.
"""

from __future__ import annotations

import datetime
import os
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import torch


def median_ms(fn: Callable[[], object], warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median milliseconds of ``fn`` (CUDA events; CPU wall clock when CUDA is absent)."""
    if torch.cuda.is_available():
        import triton.testing

        fn()  # compile / autotune outside the timing (do_bench sizes its loops from early calls)
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    import statistics
    import time

    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def wall_us(fn: Callable[[], object], calls: int, warmup: int = 0) -> float:
    """Wall-clock microseconds per call of ``fn``, ``calls`` back to back after ``warmup`` (no
    device synchronisation: on a CPU the whole cost, on CUDA the host's issuing time)."""
    import time

    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e6 / calls


def own_time_profile(fn: Callable[[], object], calls: int, rows: int, sort: str = "tottime") -> str:
    """cProfile of ``calls`` calls of ``fn``: the top ``rows`` functions by ``sort`` (any pstats
    key; default their own time), as text. CUDA work is synchronised before and after."""
    import cProfile
    import io
    import pstats

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    sync()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats(sort).print_stats(rows)
    return buf.getvalue()


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error of ``got`` against ``want`` (in FP32)."""
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm()).item()


def train_step(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, recipe: Any = None,
               splits: Sequence[int] | None = None, autocast: Callable[..., Any] | None = None,
               routed: Sequence[Sequence[int]] | None = None) -> Callable[[], None]:
    """A forward+backward closure over ``module`` (grads of ``x`` and the parameters reset each
    call): under ``fp8_autocast(recipe)`` unless ``recipe`` is None; ``splits``: a grouped
    layer's per-expert token counts; ``routed``: instead, one list of counts per step, taken in
    turn (a router's splits change every step); ``autocast``: the ``fp8_autocast`` to use
    (default: the imported package's, bound now; ``ab_host.py`` passes each checkout's own)."""
    import contextlib
    import itertools

    if autocast is None:
        from megatron_fp8 import fp8_autocast as autocast

    params = list(module.parameters())
    turn = itertools.cycle(routed) if routed else itertools.repeat(splits)

    def step() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        counts = next(turn)
        with autocast(fp8_recipe=recipe) if recipe is not None else contextlib.nullcontext():
            y = module(x) if counts is None else module(x, counts)
        y.backward(dy)

    return step


def interleaved_ms(fns: dict[str, Callable[[], object]], rounds: int = 3) -> dict[str, tuple[float, float]]:
    """``{name: (median ms, spread)}``, every function timed once per round, the order rotated
    each round, the median over rounds reported; spread = (max - min) / median over rounds.
    Timed one after another, a drift of the GPU's clocks over the run would favour whichever
    variant ran first; interleaved, the drift is spread over all of them."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(median_ms(fns[name]))
    out = {}
    for name, ts in times.items():
        med = sorted(ts)[len(ts) // 2]
        out[name] = (med, (max(ts) - min(ts)) / med)
    return out


def host_and_device_ms(fn: Callable[[], object], n: int = 20) -> tuple[float, float]:
    """(host ms per call, device ms per call) over ``n`` back-to-back calls (CUDA): equal when
    the calls are launch-bound, host far below device when the GPU is the limit."""
    import time

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    host = (time.perf_counter() - t0) * 1e3 / n
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / n


# settings that change which kernels run (named in the tables when set)
_SETTINGS = ("CUBLASLT_WORKSPACE_SIZE", "MEGATRON_FP8_GEMM_BACKEND", "MEGATRON_FP8_GROUPED_GEMM",
             "MEGATRON_FP8_ONE_LAUNCH_CAST", "MEGATRON_FP8_CAST_BACKEND", "MEGATRON_FP8_CUDA_CAST",
             "MEGATRON_FP8_CAST_CLAMP", "MEGATRON_FP8_CUDA_CURRENT")


def environment() -> str:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    settings = "".join(f", {k}={os.environ[k]}" for k in _SETTINGS if k in os.environ)
    return (f"{dev}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"{datetime.date.today().isoformat()}{settings}")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(v: object) -> str:
        if not isinstance(v, float):
            return str(v)
        # 4 significant digits below 100: a 1.03 ms step then reads 1.031, not 1.03 (+-5 us)
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.4g}"

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_outputs(name: str, title: str, md: str, out_dir: str | None = None) -> str:
    """Write ``<name>.md`` under ``out_dir`` (default ``$OUT`` or ``.``); return the path."""
    out_dir = out_dir or os.environ.get("OUT", ".")
    path = os.path.join(out_dir, f"{name}.md")
    with open(path, "w") as f:
        f.write(f"## {title}\n\n{environment()}\n\n{md}\n")
    return path


def bar_chart(path: str, groups: Sequence[str], series: dict[str, Sequence[float]], ylabel: str,
              title: str) -> None:
    """Grouped bar chart (one group per shape, one bar per path)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(groups)), 4))
    width = 0.8 / max(1, len(series))
    colors = plt.get_cmap("tab20").colors  # 20 distinct colours: no two paths share one up to 20
    for i, (label, vals) in enumerate(series.items()):
        ax.bar([g + i * width for g in range(len(groups))], vals, width, label=label, color=colors[i % len(colors)])
    # long group names ("8x2048 K=4096 N=2048 router splits") wrapped so that neighbours do not overlap
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], [textwrap.fill(g, 16) for g in groups],
                  fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
