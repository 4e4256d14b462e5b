"""torchrun worker (1 GPU, NCCL, TP=1): the parallel layers on CUDA vs ``megatron_fp8.Linear``,
and the async collective path (``ColumnComm`` over a one-rank NCCL group, which still launches
every collective) vs no communication -- bitwise, for FP8 off and every recipe, flag on/off."""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
from common import Checker, Config, shutdown
from conftest import RECIPES

import megatron_fp8 as mf
from megatron_fp8.ops.linear import LinearQuantizers, linear
from megatron_fp8.parallel import ColumnParallelLinear, RowParallelLinear
from megatron_fp8.parallel import collectives as C
from megatron_fp8.parallel.comm import ColumnComm
from megatron_fp8.quant.quantizers import make_quantizer
from megatron_fp8.recipe import TensorRole

warnings.filterwarnings("ignore")
DEV = torch.device("cuda")
NAMES = [None, *RECIPES]


def _autocast(name: str | None):  # type: ignore[no-untyped-def]
    return mf.fp8_autocast(enabled=name is not None, fp8_recipe=RECIPES[name] if name else None)


def layers_match_linear(ck: Checker) -> None:
    cfg = Config(tensor_model_parallel_size=1, sequence_parallel=False, params_dtype=torch.bfloat16,
                 use_cpu_initialization=False)
    for name in NAMES:
        for kind in ("column", "row"):
            cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
            tp_layer = cls(256, 512, config=cfg, bias=True, tp_group=dist.group.WORLD)
            ref = mf.Linear(256, 512, params_dtype=torch.bfloat16, device=DEV)
            with torch.no_grad():
                ref.weight.copy_(tp_layer.weight)
                ref.bias.copy_(torch.randn(512, device=DEV))
                tp_layer.bias.copy_(ref.bias)
            x = torch.randn(128, 2, 256, device=DEV, dtype=torch.bfloat16)
            dy = torch.randn(128, 2, 512, device=DEV, dtype=torch.bfloat16)
            outs = []
            for layer in (ref, tp_layer):
                xi = x.clone().requires_grad_(True)
                with _autocast(name):
                    y = layer(xi)
                y = y[0] if isinstance(y, tuple) else y
                y.backward(dy)
                outs.append((y.detach(), xi.grad, layer.weight.grad, layer.bias.grad))
            for what, a, b in zip(("out", "dx", "dw", "db"), *outs):
                ck.bitwise("layers", f"{kind} recipe={name} {what}", b, a)


def async_comm_matches_local(ck: Checker) -> None:
    group = dist.group.WORLD
    x_local = torch.randn(256, 256, device=DEV, dtype=torch.bfloat16)
    pending = C.all_gather_tokens(x_local, group)
    ck.true("async", isinstance(pending, C.InFlight) and len(pending._works) == 1,
            "all_gather_tokens on a one-rank NCCL group launched no async work")
    ck.bitwise("async", "one-rank all-gather", pending.wait(), x_local)
    for name in NAMES:
        for sp in (False, True):
            for soi in (False, True):
                comm = ColumnComm(group, sequence_parallel=sp, reduce_dgrad_enabled=True)
                w = torch.randn(384, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
                x = torch.randn(2, 128, 256, device=DEV, dtype=torch.bfloat16)
                dy = torch.randn(2, 128, 384, device=DEV, dtype=torch.bfloat16)
                outs = []
                for c in (None, comm):
                    q = None
                    if name:
                        q = LinearQuantizers(*(make_quantizer(RECIPES[name], r, device=DEV) for r in
                                               (TensorRole.INPUT, TensorRole.WEIGHT, TensorRole.GRAD_OUTPUT)))
                    xi = x.clone().requires_grad_(True)
                    w.grad = None
                    with _autocast(name):
                        y = linear(xi, w, None, quantizers=q, save_original_input=soi, comm=c)
                    y.backward(dy)
                    outs.append((y.detach(), xi.grad, w.grad))
                for what, a, b in zip(("out", "dx", "dw"), *outs):
                    ck.bitwise("async", f"recipe={name} sp={sp} flag={soi} {what}", b, a)


def main() -> int:
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    ck = Checker(dist.get_rank())
    ck.guard("layers", "layers", layers_match_linear, ck)
    ck.guard("async", "async", async_comm_matches_local, ck)
    code = ck.report()
    shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
