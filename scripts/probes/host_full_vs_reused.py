"""Probe: why an eager current-scaling ``Linear`` step that casts its weight costs twice the host
time of one that reuses it (run AL: 618 vs 294 us on an H100, where the weight cast's route alone
takes 33 us). Host and device us of both, with the one-launch cast on and off, and cProfiles.

    python scripts/probes/host_full_vs_reused.py              # host/device us, cProfiles
    python scripts/probes/host_full_vs_reused.py kernels      # GPU kernel time per step (torch.profiler)
    python scripts/probes/host_full_vs_reused.py gc           # with the garbage collector on and off
    python scripts/probes/host_full_vs_reused.py isolate      # reused steps plus a weight cast dropped / kept
    python scripts/probes/host_full_vs_reused.py sync         # a sync torch knows of inside a step (raises there)
    python scripts/probes/host_full_vs_reused.py spin full 8  # 8 s of steps, for a sampling profiler
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib

import torch  # noqa: E402
from benchlib import host_and_device_ms, own_time_profile, train_step, wall_us  # noqa: E402

import megatron_fp8 as mf  # noqa: E402
from megatron_fp8.recipe import PRESETS  # noqa: E402

DEVICE = os.environ.get("PROBE_DEVICE", "cuda")  # "cpu" (with MEGATRON_FP8_LEAN=1): a smoke run of the plumbing


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """x [256, 2048] (requiring grad) and dy [256, 2048], BF16 on ``DEVICE``."""
    x = torch.randn(256, 2048, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    return x, torch.randn(256, 2048, device=DEVICE, dtype=torch.bfloat16)


def _warm(x: torch.Tensor, dy: torch.Tensor, recipe: object, reuse: bool) -> tuple[Callable[[], None], mf.Linear]:
    """A new ``Linear`` and its fwd+bwd step (weight cast every step, or ``reuse``d), run 30 times."""
    layer = mf.Linear(x.shape[1], dy.shape[1], bias=False, params_dtype=torch.bfloat16, device=x.device)
    if reuse:
        layer.is_first_microbatch = True
    step = train_step(layer, x, dy, recipe)
    for _ in range(30 if x.is_cuda else 1):
        step()
    return step, layer


def _warm_step(x: torch.Tensor, dy: torch.Tensor, recipe: object, reuse: bool) -> Callable[[], None]:
    return _warm(x, dy, recipe, reuse)[0]


def main() -> None:
    main_steps(4)
    x, dy = _inputs()
    recipe = PRESETS[os.environ.get("RECIPE", "current")]
    for label, reuse in (("full", False), ("reused", True)):
        print(f"--- {label} ---\n{own_time_profile(_warm_step(x, dy, recipe, reuse), 300, 16)}")


def main_steps(rounds: int) -> None:
    """Host and device us per step, weight cast every step and reused, alternated; BF16 beside."""
    x, dy = _inputs()
    recipe = PRESETS[os.environ.get("RECIPE", "current")]
    ref = torch.nn.Linear(2048, 2048, bias=False, dtype=torch.bfloat16, device="cuda")
    for label, reuse in [("full", False), ("reused", True)] * (rounds // 2) + [("bf16", None)]:
        if reuse is None:
            host, dev = host_and_device_ms(train_step(ref, x, dy), 400)
            print(f"nn.Linear: host {host * 1e3:.1f} us, device {dev * 1e3:.1f} us per step")
            continue
        host, dev = host_and_device_ms(_warm_step(x, dy, recipe, reuse), 400)
        print(f"{label}: host {host * 1e3:.1f} us, device {dev * 1e3:.1f} us per step")


def isolate(rounds: int = 2) -> None:
    """Where the full step's excess lives (run AL's open question): reused steps plus a weight
    cast whose result is dropped at once, or kept (not saved for backward) until the next step's;
    against the full and reused steps. Host us per step, in one process, alternated."""
    from megatron_fp8.ops.lean import lean_cast

    x, dy = _inputs()
    recipe = PRESETS[os.environ.get("RECIPE", "current")]
    kept: list[object] = []

    def with_cast(keep: bool) -> Callable[[], None]:
        step, layer = _warm(x, dy, recipe, True)
        q = layer._quantizers["weight"]
        w = layer.weight

        def run() -> None:
            with torch.no_grad():
                qt = lean_cast(q.weight, w)
            if keep:
                kept[:] = [qt]
            step()
        return run
    cases = {"full": lambda: _warm_step(x, dy, recipe, False), "reused": lambda: _warm_step(x, dy, recipe, True),
             "reused + cast dropped": lambda: with_cast(False), "reused + cast kept a step": lambda: with_cast(True)}
    for rnd in range(rounds):
        for name, make in cases.items():
            step = make()
            host = host_and_device_ms(step, 400)[0] * 1e3 if x.is_cuda else wall_us(step, 3)
            print(f"round {rnd}: {name}: host {host:.1f} us per step")


def syncs() -> None:
    """Run full and reused steps with CUDA's sync debug mode at "error": the traceback names an
    operation torch knows to wait for the GPU (a sync costs the queued kernels' time on the
    host); waits inside the driver or cuBLASLt go unseen (``host_coop.py`` times the routes)."""
    import traceback

    x, dy = _inputs()
    recipe = PRESETS[os.environ.get("RECIPE", "current")]
    for name, reuse in (("full", False), ("reused", True)):
        step = _warm_step(x, dy, recipe, reuse)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                step()
            print(f"{name}: no synchronizing operation in 3 steps")
        except RuntimeError:
            print(f"{name}: a step synchronizes:\n{traceback.format_exc(limit=12)}")
        finally:
            torch.cuda.set_sync_debug_mode("default")


def kernels(recipe_name: str, reuse: bool, steps: int = 50) -> None:
    """The GPU's kernel time per step (torch.profiler): whether a step is bound by its kernels."""
    from torch.profiler import ProfilerActivity, profile

    x, dy = _inputs()
    step = _warm_step(x, dy, PRESETS[recipe_name], reuse)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total = sum(e.device_time for e in events) / steps
    print(f"{recipe_name} {'reused' if reuse else 'full'}: GPU kernel time {total:.1f} us per step, "
          f"{len(events) / steps:.1f} kernels")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "spin":  # for a sampling profiler: steps for a while
        import time

        which, seconds = sys.argv[2], float(sys.argv[3])
        x, dy = _inputs()
        if which == "bf16":
            step = train_step(torch.nn.Linear(2048, 2048, bias=False, dtype=torch.bfloat16, device="cuda"), x, dy)
        else:
            step = _warm_step(x, dy, PRESETS[os.environ.get("RECIPE", "current")], which == "reused")
        end, count = time.perf_counter() + seconds, 0
        while time.perf_counter() < end:
            for _ in range(50):
                step()
            count += 50
        torch.cuda.synchronize()
        print(f"{which}: {seconds * 1e6 / count:.1f} us per step")
    elif len(sys.argv) > 1 and sys.argv[1] == "sync":
        syncs()
    elif len(sys.argv) > 1 and sys.argv[1] == "isolate":
        isolate()
    elif len(sys.argv) > 1 and sys.argv[1] == "gc":
        import gc

        for state in ("on", "off", "on", "off"):
            (gc.enable if state == "on" else gc.disable)()
            print(f"garbage collector {state}:")
            main_steps(2)
        gc.enable()
    elif len(sys.argv) > 1 and sys.argv[1] == "kernels":
        for name in ("current", "blockwise"):
            for reuse in (False, True):
                kernels(name, reuse)
    else:
        main()
