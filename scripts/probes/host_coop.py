"""Probe: does a cast route's launch wait for the GPU? Host us of each route of a lean ``Linear``
plan (x's cast, dy's cast, the weight's cast, fprop) issued on an idle GPU and right behind a
long BF16 matmul (a few ms of queued work). A route that waits for the queue (a cooperative
launch the driver serialises, an allocation that synchronises) shows the matmul's time.

    python scripts/probes/host_coop.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib

import torch  # noqa: E402
from host_floor import planned_linear  # noqa: E402

from megatron_fp8.ops.lean import lean_cast  # noqa: E402


def _host_us(fn: Callable[[], object], busy: torch.Tensor | None, n: int = 30) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        if busy is not None:
            busy @ busy  # queued work ahead of the route
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _rows(recipe: str, x: torch.Tensor, dy: torch.Tensor, busy: torch.Tensor) -> None:
    layer, plan, wq = planned_linear(recipe, x, dy)
    q, w = plan.q, layer.weight.detach()
    x2d = x.detach()
    xr, xrs, *_ = plan.cast_x(x2d)
    routes = {"x cast": lambda: plan.cast_x(x2d), "dy cast": lambda: plan.dy_route(dy),
              "weight cast": lambda: lean_cast(q.weight, w),
              "fprop": lambda: plan.fprop(xr, xrs, wq.rowwise.data, wq.rowwise.scale_inv),
              "torch.empty": lambda: torch.empty(256, 2048, device="cuda"),
              "torch.mm": lambda: x2d @ w.t()}
    for name, fn in routes.items():
        fn()
        print(f"| {recipe} | {name} | {_host_us(fn, None):.1f} | {_host_us(fn, busy):.1f} |")


def main() -> None:
    x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    busy @ busy
    end.record()
    torch.cuda.synchronize()
    print(f"queued matmul: {start.elapsed_time(end) * 1e3:.0f} us on the GPU")
    print("| recipe | route | host us, idle GPU | host us, behind the matmul |\n|---|---|---|---|")
    for recipe in ("current", "blockwise"):
        _rows(recipe, x, dy, busy)

if __name__ == "__main__":
    main()
