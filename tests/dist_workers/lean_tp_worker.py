"""torchrun worker: the lean path (ops/lean.py) on the tensor-parallel linears equals the general
path bit for bit (gloo, CPU, ``MEGATRON_FP8_LEAN=1`` against ``0``, set per run: the setting is
read per call). Column and row layers x sequence parallelism on/off x every FP8 recipe x
``save_original_input`` on/off, the cases of tp_worker.py: out, dx, dw, db of every step; and
a lean plan ran every lean step's forward and backward (the column layer's SP gathers and dgrad
reductions inside its autograd function)."""

from __future__ import annotations

import os
import sys

import torch
from common import Checker, init_gloo, shutdown
from conftest import RECIPES
from tp_worker import Case, _steps

import megatron_fp8 as mf


def _run(case: Case, soi: bool, lean: str) -> tuple[list[dict[str, torch.Tensor | None]], bool]:
    """The case's steps with ``MEGATRON_FP8_LEAN=lean``; and whether a lean plan ran them."""
    os.environ["MEGATRON_FP8_LEAN"] = lean
    layer = case.build(soi)
    results = []
    for _ in range(_steps(case.recipe)):
        layer.zero_grad(set_to_none=True)
        x = case.local_input().requires_grad_(True)
        with mf.fp8_autocast(fp8_recipe=RECIPES[case.recipe]):
            y, _ = layer(x)
        y.backward(case.local_grad())
        results.append({"out": y.detach(), "dx": x.grad, "dw": layer.weight.grad,
                        "db": layer.bias.grad if layer.bias is not None else None})
    plans = layer._quantizers["weight"].__dict__.get("_plans", {}).values()
    return results, any(p is not None and p.proven and p.backward_proven for p in plans)


def check(ck: Checker, case: Case) -> None:
    for soi in (False, True):
        general, _ = _run(case, soi, "0")
        lean, ran = _run(case, soi, "1")
        ck.true("lean_ran", ran, f"{case.name} soi={soi}: no lean plan ran forward and backward")
        for step, (a, b) in enumerate(zip(general, lean)):
            for key in ("out", "dx", "dw", "db"):
                ck.bitwise("lean", f"{case.name} soi={soi} step={step} {key}", b[key], a[key])


def main() -> int:
    rank, tp = init_gloo()
    ck = Checker(rank)
    for kind in ("column", "row"):
        for sp in (False, True):
            for recipe in RECIPES:
                case = Case(kind, sp, True, recipe, rank, tp)
                ck.guard("lean", case.name, check, ck, case)
    code = ck.report()
    shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
