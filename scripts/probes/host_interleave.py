"""Probe: do a current-scaling step's host calls cost more one after another than each repeated
alone? (run AL found a step's routes dearer inside the step than in loops of their own). Host
us per iteration of loops that repeat one route, and of loops that alternate routes, on a GPU.

    python scripts/probes/host_interleave.py [--calls 3000]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib

import torch  # noqa: E402
from benchlib import wall_us  # noqa: E402
from host_floor import planned_linear  # noqa: E402 - this folder

from megatron_fp8.ops.lean import lean_cast  # noqa: E402


def _threads(ops: dict[str, Callable[[], object]], calls: int, x: torch.Tensor) -> None:
    """Host us per call of each route looped on the main thread, inside an autograd backward
    (the engine's device thread, where a step's backward launches) and in a Python thread."""
    import threading
    import time

    def loop(fn: Callable[[], object]) -> float:
        for _ in range(50):
            fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) * 1e6 / calls

    class InBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t: torch.Tensor, fn: Callable[[], object], out: list[float]) -> torch.Tensor:  # type: ignore[override]
            ctx.fn, ctx.out = fn, out
            return t.clone()

        @staticmethod
        def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
            ctx.out.append(loop(ctx.fn))
            return g, None, None

    print("| route | main thread | autograd backward | Python thread |\n|---|---|---|---|")
    for rnd in range(2):
        for name in ("cast x", "cast dy", "fprop", "dgrad", "bf16 mm", "empty"):
            fn = ops[name]
            main_us = loop(fn)
            got: list[float] = []
            InBackward.apply(x, fn, got).sum().backward()
            th: list[float] = []
            worker = threading.Thread(target=lambda th=th, fn=fn: th.append(loop(fn)))
            worker.start()
            worker.join()
            torch.cuda.synchronize()
            print(f"| {name} (round {rnd}) | {main_us:.1f} | {got[0]:.1f} | {th[0]:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--threads", action="store_true",
                    help="the same loops on the main thread, in an autograd backward, in a Python thread")
    args = ap.parse_args()
    t, k, n = 256, 2048, 2048
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    layer, plan, wq = planned_linear("current", x, dy)
    q, w = plan.q, layer.weight.detach()
    x2d = x.detach()
    xr, xrs, xc, xcs, _ = plan.cast_x(x2d)
    dyr, dyrs, dyc, dycs, _ = plan.dy_route(dy)
    wr, wc = wq.rowwise, wq.columnwise
    xb, wb = x2d, w
    ops: dict[str, Callable[[], object]] = {
        "cast x": lambda: plan.cast_x(x2d),
        "cast dy": lambda: plan.dy_route(dy),
        "cast w": lambda: lean_cast(q.weight, w),
        "fprop": lambda: plan.fprop(xr, xrs, wr.data, wr.scale_inv),
        "dgrad": lambda: plan.dgrad(dyr, dyrs, wc.data, wc.scale_inv),
        "wgrad": lambda: plan.wgrad_gemm(dyc, dycs, xc, xcs),
        "bf16 mm": lambda: torch.mm(xb, wb.t()),
        "empty": lambda: torch.empty((t, k), dtype=torch.float8_e4m3fn, device="cuda"),
    }

    def seq(*names: str) -> Callable[[], None]:
        fns = [ops[nm] for nm in names]

        def run() -> None:
            for f in fns:
                f()
        return run
    if args.threads:
        _threads(ops, args.calls, x)
        return
    combos = [("cast x",), ("fprop",), ("bf16 mm",), ("cast dy",), ("dgrad",), ("wgrad",), ("cast w",), ("empty",),
              ("cast x", "fprop"), ("cast x", "bf16 mm"), ("fprop", "bf16 mm"), ("cast x", "cast dy"),
              ("fprop", "dgrad"), ("bf16 mm", "bf16 mm"), ("fprop", "fprop"), ("cast x", "cast x"),
              ("cast x", "fprop", "cast dy", "dgrad", "wgrad"),
              ("cast w", "cast x", "fprop", "cast dy", "dgrad", "wgrad")]
    alone: dict[str, float] = {}
    rows = []
    for rnd in range(2):
        for combo in combos:
            us = wall_us(seq(*combo), args.calls, 50)
            torch.cuda.synchronize()
            if len(combo) == 1:
                alone[combo[0]] = us
            rows.append((rnd, " + ".join(combo), us, sum(alone.get(c, float("nan")) for c in combo)))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| round | loop body | host us per iteration | sum of the parts alone |\n|---|---|---|---|")
    for rnd, name, us, parts in rows:
        print(f"| {rnd} | {name} | {us:.1f} | {parts:.1f} |")


if __name__ == "__main__":
    main()
