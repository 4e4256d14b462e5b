"""Probe: what backward on the autograd engine's CUDA device thread costs the host, per layer.

Run AM (H100, 2026-12-06) found a current ``Linear`` step 100-140 us faster on the host when its
backward ran on the calling thread (``torch.autograd.set_multithreading_enabled(False)``), and
BF16 ``nn.Linear`` 37-60 us faster. This probe splits that cost: per layer of a chain of
``depth`` layers (one backward per chain, as in a model), for BF16 ``nn.Linear``, a minimal
Python ``autograd.Function`` doing the same BF16 matmuls (the cost of any Python backward),
``host_floor``'s minimal current step (our routes, nothing else), and our ``Linear`` (weight
cast every step, and reused), with the engine's multithreading on (the default) and off. Host us
per layer, alternated in one process, BF16 ratios per mode and depth.

    python scripts/probes/host_threads.py [--depths 1 8] [--rounds 2] [--steps 300] [--stub]
    PROBE_DEVICE=cpu MEGATRON_FP8_LEAN=1 python scripts/probes/host_threads.py --steps 2 --no-minimal  # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib

import torch  # noqa: E402
from benchlib import host_and_device_ms, train_step, wall_us  # noqa: E402

import megatron_fp8 as mf  # noqa: E402
from megatron_fp8.recipe import PRESETS  # noqa: E402

DEVICE = os.environ.get("PROBE_DEVICE", "cuda")
WIDTH = 2048


class _PyMatmul(torch.autograd.Function):
    """``x @ w.T`` with a Python backward: the floor any Python-backward layer pays."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return dy @ w, dy.t() @ x


class _PyLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH, device=DEVICE, dtype=torch.bfloat16) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PyMatmul.apply(x, self.weight)


class _Minimal(torch.nn.Module):
    """``host_floor``'s minimal current step (our two cast routes, three ``_scaled_mm``) as a layer."""

    def __init__(self) -> None:
        super().__init__()
        from host_floor import planned_linear

        x = torch.randn(256, WIDTH, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        layer, plan, self.wq = planned_linear("current", x, torch.randn_like(x))
        self.weight = layer.weight
        self.cast_x, self.cast_dy = plan.cast_x, plan.dy_route

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from host_floor import _MinLinear

        return _MinLinear.apply(x, self.weight, self.wq, self.cast_x, self.cast_dy)


class _Timed(torch.autograd.Function):
    """``host_floor._MinLinear`` with a host clock read between its ops (``_MARKS``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, wq: Any, cast_x: Any, cast_dy: Any) -> torch.Tensor:
        t = time.perf_counter
        _MARKS.append(("forward entered", t()))
        xr, xrs, xc, xcs, _ = cast_x(x.reshape(-1, x.shape[-1]))
        _MARKS.append(("x cast", t()))
        ctx.save_for_backward(xc, xcs, wq.columnwise.data, wq.columnwise.scale_inv)
        ctx.cast_dy = cast_dy
        y = torch._scaled_mm(xr, wq.rowwise.data.t(), scale_a=xrs, scale_b=wq.rowwise.scale_inv,
                             out_dtype=x.dtype, use_fast_accum=True)
        _MARKS.append(("fprop", t()))
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        t = time.perf_counter
        _MARKS.append(("backward entered", t()))
        xc, xcs, wc, wcs = ctx.saved_tensors
        dyr, dyrs, dyc, dycs, _ = ctx.cast_dy(dy.contiguous())
        _MARKS.append(("dy cast", t()))
        dx = torch._scaled_mm(dyr, wc.t(), scale_a=dyrs, scale_b=wcs, out_dtype=dy.dtype)
        _MARKS.append(("dgrad", t()))
        dw = torch._scaled_mm(dyc, xc.t(), scale_a=dycs, scale_b=xcs, out_dtype=dy.dtype)
        _MARKS.append(("wgrad", t()))
        return dx, dw, None, None, None


_MARKS: list[tuple[str, float]] = []


class _WhoRuns(torch.autograd.Function):
    """Identity whose backward records the native id of the thread that runs it."""

    tid = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> torch.Tensor:
        import threading

        _WhoRuns.tid = threading.get_native_id()
        return dy


def pin(main_core: int, engine_core: int) -> None:
    """The calling thread to ``main_core``, the autograd engine's CUDA device thread to ``engine_core``
    (Linux: ``sched_setaffinity`` of a thread id)."""
    x = torch.randn(4, device=DEVICE, requires_grad=True)
    _WhoRuns.apply(x).sum().backward()
    os.sched_setaffinity(0, {main_core})
    os.sched_setaffinity(_WhoRuns.tid, {engine_core})


def breakdown(steps: int) -> None:
    """Host us between the clock reads of ``_Timed``'s steps, engine multithreading on and off."""
    x = torch.randn(256, WIDTH, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, WIDTH, device=DEVICE, dtype=torch.bfloat16)
    m = _Minimal()
    for multi in (True, False, True, False):
        with torch.autograd.set_multithreading_enabled(multi):
            spans: dict[str, list[float]] = defaultdict(list)
            for i in range(steps + 20):
                _MARKS.clear()
                t0 = time.perf_counter()
                x.grad = None
                m.weight.grad = None
                y = _Timed.apply(x, m.weight, m.wq, m.cast_x, m.cast_dy)
                _MARKS.append(("backward called", time.perf_counter()))
                y.backward(dy)
                _MARKS.append(("backward returned", time.perf_counter()))
                if i >= 20:
                    prev = t0
                    for name, at in _MARKS:
                        spans[name].append((at - prev) * 1e6)
                        prev = at
        print(f"multithreading {'on ' if multi else 'off'}: " + ", ".join(
            f"{k} {statistics.median(v):.1f}" for k, v in spans.items()) +
            f"; total {sum(statistics.median(v) for v in spans.values()):.1f} us (medians)")


def _chain(kind: str, depth: int) -> torch.nn.Module:
    def one() -> torch.nn.Module:
        if kind == "nn.Linear":
            return torch.nn.Linear(WIDTH, WIDTH, bias=False, dtype=torch.bfloat16, device=DEVICE)
        if kind == "python Function":
            return _PyLinear()
        if kind == "minimal Function, our routes":
            return _Minimal()
        layer = mf.Linear(WIDTH, WIDTH, bias=False, params_dtype=torch.bfloat16, device=DEVICE)
        if kind.endswith("reused"):
            layer.is_first_microbatch = True
        return layer
    return torch.nn.Sequential(*[one() for _ in range(depth)])


def _per_layer_us(step: Callable[[], None], depth: int, steps: int) -> float:
    for _ in range(5):
        step()
    total = host_and_device_ms(step, steps)[0] * 1e3 if DEVICE == "cuda" else wall_us(step, steps)
    return total / depth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--stub", action="store_true", help="our cast and GEMM routes stubbed (the glue alone)")
    ap.add_argument("--no-minimal", action="store_true", help="without the minimal Function (it needs a GPU)")
    ap.add_argument("--breakdown", action="store_true", help="host us between the ops of a minimal step")
    ap.add_argument("--pin", type=int, nargs=2, metavar=("MAIN", "ENGINE"),
                    help="pin the calling thread and the engine's device thread to these cores")
    args = ap.parse_args()
    if args.pin:
        if DEVICE != "cuda":
            ap.error("--pin: a CUDA backward's engine thread only (off CUDA the backward runs on the caller)")
        pin(*args.pin)
        print(f"calling thread on core {args.pin[0]}, engine device thread on core {args.pin[1]}")
    if args.breakdown:
        breakdown(args.steps)
        return
    if args.stub:
        from lean_overhead import stub_routes

        stub_routes()
    recipe = PRESETS[os.environ.get("RECIPE", "current")]
    x = torch.randn(256, WIDTH, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, WIDTH, device=DEVICE, dtype=torch.bfloat16)
    kinds = ("nn.Linear", "python Function", "minimal Function, our routes", "Linear, weight cast every step",
             "Linear, weight reused")
    if args.stub or args.no_minimal:
        kinds = tuple(k for k in kinds if not k.startswith("minimal"))
    found: dict[tuple[str, int, bool], list[float]] = defaultdict(list)
    for _ in range(args.rounds):
        for depth in args.depths:
            for kind in kinds:
                model = _chain(kind, depth)
                fp8 = kind.startswith("Linear")
                for multi in (True, False):
                    with torch.autograd.set_multithreading_enabled(multi):
                        step = train_step(model, x, dy, recipe if fp8 else None)
                        found[kind, depth, multi].append(_per_layer_us(step, depth, args.steps))
    print(f"\nhost us per layer (median of {args.rounds} rounds), T=256, K=N={WIDTH}, "
          f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU'}")
    print("| layer | depth | device thread | caller | device thread / BF16 | caller / BF16 |")
    print("|---|---|---|---|---|---|")
    for depth in args.depths:
        ref = {m: statistics.median(found["nn.Linear", depth, m]) for m in (True, False)}
        for kind in kinds:
            on, off = (statistics.median(found[kind, depth, m]) for m in (True, False))
            print(f"| {kind} | {depth} | {on:.1f} | {off:.1f} | {on / ref[True]:.2f}x | {off / ref[False]:.2f}x |")


if __name__ == "__main__":
    main()
