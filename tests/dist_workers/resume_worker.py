"""torchrun worker (2 ranks, TP=2, gloo, CPU): a tensor-parallel pair (ColumnParallelLinear with
sequence parallelism -> RowParallelLinear) under delayed scaling, checkpointed after N = 1, 2, 5
training steps and resumed in a fresh process, makes the next step bitwise as the run that
saved it: through ``state_dict`` (one file per rank) and through megatron-core's
``dist_checkpointing`` (``sharded_state_dict``).

Usage: ``resume_worker.py save DIR`` (one uninterrupted run: checkpoints after steps 1, 2, 5, and
the output and gradients of the step after each) or ``resume_worker.py load N DIR`` (a fresh
process: both checkpoints of step N loaded into new layers, the next step compared, category
``resume``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import torch
import torch.distributed as dist
from common import Checker, init_gloo, shutdown
from mcore_worker import _cpu_shims

warnings.filterwarnings("ignore")
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

import megatron_fp8 as mf  # noqa: E402
from megatron_fp8.parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron_fp8.recipe import DelayedScaling  # noqa: E402

RECIPE = DelayedScaling(amax_history_len=8)
SAVED_AT = (1, 2, 5)


class Pair(torch.nn.Module):
    def __init__(self, tp: int, seed: int) -> None:
        super().__init__()
        cfg = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, tensor_model_parallel_size=tp,
                                sequence_parallel=True, use_cpu_initialization=True, params_dtype=torch.float32)
        torch.manual_seed(seed)
        self.fc1 = ColumnParallelLinear(256, 512, config=cfg, init_method=torch.nn.init.xavier_normal_, bias=True,
                                        gather_output=False)
        self.fc2 = RowParallelLinear(512, 256, config=cfg, init_method=torch.nn.init.xavier_normal_, bias=True,
                                     input_is_parallel=True)

    def sharded_state_dict(self, prefix: str = "") -> dict:
        return {**self.fc1.sharded_state_dict(prefix=f"{prefix}fc1."),
                **self.fc2.sharded_state_dict(prefix=f"{prefix}fc2.")}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(x)
        y, _ = self.fc2(torch.nn.functional.gelu(h))
        return y


def _step(model: Pair, i: int) -> torch.Tensor:
    """Step ``i`` (inputs grow with i, so the amax history matters); returns out, dx and the
    weight gradients, flattened."""
    g = torch.Generator().manual_seed(100 + i * 2 + dist.get_rank())  # each rank's sequence shard
    x = (torch.randn(128, 1, 256, generator=g) * (1 + i)).requires_grad_()
    with mf.fp8_autocast(fp8_recipe=RECIPE):
        y = model(x)
    y.backward(torch.randn(y.shape, generator=g))
    for p in model.parameters():  # replicated under SP (the row bias): summed over TP, as Megatron's finalize does
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad)
    out = torch.cat([y.detach().flatten(), x.grad.flatten(), *(p.grad.flatten() for p in model.parameters())])
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.05 * p.grad
    model.zero_grad(set_to_none=True)
    return out


def save(directory: str) -> None:
    model, rank = Pair(dist.get_world_size(), seed=0), dist.get_rank()
    for i in range(max(SAVED_AT) + 1):
        if i in SAVED_AT:
            torch.save(model.state_dict(), f"{directory}/sd{i}-rank{rank}.pt")
            path = f"{directory}/dist{i}"
            if rank == 0:
                os.makedirs(path, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(model.sharded_state_dict(prefix=""), path)
        out = _step(model, i)
        if i in SAVED_AT:
            torch.save(out, f"{directory}/want{i}-rank{rank}.pt")


def load(ck: Checker, n: int, directory: str) -> None:
    rank = dist.get_rank()
    want = torch.load(f"{directory}/want{n}-rank{rank}.pt")
    by_sd = Pair(dist.get_world_size(), seed=7)
    by_sd.load_state_dict(torch.load(f"{directory}/sd{n}-rank{rank}.pt"))
    ck.bitwise("resume", f"step {n + 1} after state_dict of step {n}", _step(by_sd, n), want)
    by_dist = Pair(dist.get_world_size(), seed=8)
    by_dist.load_state_dict(dist_checkpointing.load(by_dist.sharded_state_dict(prefix=""), f"{directory}/dist{n}"))
    ck.bitwise("resume", f"step {n + 1} after dist_checkpointing of step {n}", _step(by_dist, n), want)


def main() -> int:
    rank, tp = init_gloo()
    _cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    ck = Checker(rank)
    if importlib.util.find_spec("psutil") is None:  # megatron's checkpoint writer needs it
        ck.fail("resume", "psutil is not installed (megatron-core's dist_checkpointing needs it)")
    elif sys.argv[1] == "save":
        ck.guard("save", "the uninterrupted run", save, sys.argv[2])
    else:
        ck.guard("resume", f"resume from step {sys.argv[2]}", load, ck, int(sys.argv[2]), sys.argv[3])
    code = ck.report()
    parallel_state.destroy_model_parallel()
    shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
