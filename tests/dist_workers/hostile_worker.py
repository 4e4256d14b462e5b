"""torchrun worker (2 ranks, gloo, CPU): tensor-parallel ranks that disagree fail fast, on every
rank, with an error naming each rank's value (``tests/test_hostile.py``).

Each case runs in a fresh layer and records, per rank, whether the expected RuntimeError came
(category ``disagree``); a case that hangs is ended by the launching test's timeout.

* rank 0 delayed scaling, rank 1 current scaling (``ColumnParallelLinear``, SP);
* rank 0 block scaling, rank 1 current scaling (used to hang in the FP8 all-gather);
* rank 0 FP8 on, rank 1 FP8 off;
* uneven sequence shards, 5 vs 4 rows, on the column SP gather (used to abort in gloo);
* the same recipe on both ranks runs (the check passes and costs one all-gather per change);
* a NaN in one rank's sequence shard under delayed scaling (the input amax reduced over the TP
  group): that step's output is NaN in the NaN's token on every rank, finite elsewhere; the
  amax of the whole tensor is NaN on every rank (whatever the backend does with NaN in a MAX),
  so every rank's history records the step before's amax: finite and equal, the scales equal,
  the step after finite again (category ``nonfinite``).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from common import Checker, Config, init_gloo, shutdown

import megatron_fp8 as mf
from megatron_fp8.parallel import ColumnParallelLinear
from megatron_fp8.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

warnings.filterwarnings("ignore")


def _layer(tp: int, sp: bool = True) -> ColumnParallelLinear:
    torch.manual_seed(0)
    return ColumnParallelLinear(128, 256, config=Config(tensor_model_parallel_size=tp, sequence_parallel=sp),
                                bias=False, name="decoder.layers.0.mlp.linear_fc1")


def _expect_error(ck: Checker, name: str, run: Any, *needles: str) -> None:
    try:
        run()
    except RuntimeError as e:
        msg = str(e)
        ck.true("disagree", all(n in msg for n in needles), f"{name}: the error lacks {needles}: {msg}")
    else:
        ck.fail("disagree", f"{name}: no error")


def _nan_on_one_rank(ck: Checker, rank: int, tp: int, x: torch.Tensor) -> None:
    layer = _layer(tp)
    recipe = DelayedScaling(amax_history_len=4)
    problems = []
    for step in range(3):
        xi = x * (step + 1)
        if step == 1 and rank == 1:
            xi[3, 0, 7] = float("nan")  # token 128 + 3 of the gathered sequence
        with mf.fp8_autocast(fp8_recipe=recipe):
            y, _ = layer(xi)
            q = layer.fp8_quantizers().input
        state = torch.cat([q.amax_history, q.scale.view(1)])
        every = [torch.empty_like(state) for _ in range(tp)]
        dist.all_gather(every, state)
        if not torch.isfinite(state).all() or not all(torch.equal(e, state) for e in every):
            problems.append(f"step {step}: history and scale {state.tolist()} (ranks: {[e.tolist() for e in every]})")
        if step == 1 and not torch.equal(state[0], state[1]):  # the whole tensor's amax is NaN: step 0's recorded
            problems.append(f"step 1 recorded {state[0].item()}, not step 0's amax {state[1].item()}")
        bad_tokens = (~torch.isfinite(y)).any(dim=-1).flatten().nonzero().flatten().tolist()
        if bad_tokens != ([131] if step == 1 else []):
            problems.append(f"step {step}: non-finite output in tokens {bad_tokens}")
    ck.true("nonfinite", not problems, "; ".join(problems))


def main() -> int:
    rank, tp = init_gloo()
    ck = Checker(rank)
    x = torch.randn(128, 1, 128)  # each rank's shard of a 256-token sequence

    def recipes(mine: object, theirs: object) -> Any:
        def run() -> None:
            with mf.fp8_autocast(fp8_recipe=mine if rank == 0 else theirs):
                _layer(tp)(x)
        return run

    _expect_error(ck, "delayed vs current", recipes(DelayedScaling(), Float8CurrentScaling()),
                  "rank 0: DelayedScaling", "rank 1: Float8CurrentScaling", "linear_fc1")
    _expect_error(ck, "blocks vs current", recipes(Float8BlockScaling(), Float8CurrentScaling()),
                  "rank 0: Float8BlockScaling", "rank 1: Float8CurrentScaling")

    def on_off() -> None:
        with mf.fp8_autocast(enabled=rank == 0, fp8_recipe=Float8CurrentScaling()):
            _layer(tp)(x)

    _expect_error(ck, "FP8 on vs off", on_off, "rank 1: FP8 off")

    def uneven() -> None:
        _layer(tp)(torch.randn(5 if rank == 0 else 4, 1, 128))

    _expect_error(ck, "uneven SP shards", uneven, "rank 0: 5 local tokens", "rank 1: 4 local tokens", "pad")
    layer = _layer(tp)
    for _ in range(2):
        with mf.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
            y, _ = layer(x)
    ck.true("agree", y.shape == (256, 1, 128), f"the agreeing ranks' output has shape {tuple(y.shape)}")
    _nan_on_one_rank(ck, rank, tp, x)
    code = ck.report()
    shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
