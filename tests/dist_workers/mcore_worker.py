"""torchrun worker: our Column/RowParallelLinear vs megatron-core's own (FP8 off), and
checkpoint round trips (``state_dict`` and megatron ``dist_checkpointing``), gloo on CPU.

Usage: ``mcore_worker.py CKPT_DIR``. megatron-core allocates some buffers on CUDA
unconditionally; ``_cpu_shims`` redirects them to CPU (test-only) so SP and
``dist_checkpointing`` run here too.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
import zlib
from typing import Any

import torch
import torch.distributed as dist
from common import Checker, init_gloo, shutdown
from conftest import RECIPES

import megatron_fp8 as mf
from megatron_fp8.parallel import ColumnParallelLinear, RowParallelLinear

warnings.filterwarnings("ignore")
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core import tensor_parallel as mtp  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402


class _CpuBuffer:
    def get_tensor(self, shape: Any, dtype: torch.dtype, name: str) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)


def _cpu_shims() -> None:
    """megatron-core 0.16 assumes CUDA in three places we need on CPU (test-only shims): the
    SP all-gather buffer, SP backward's ``torch.empty(device=cuda.current_device())`` and the
    checkpoint writer's ``torch.cuda.synchronize()``."""
    import megatron.core.tensor_parallel.layers as layers
    import megatron.core.tensor_parallel.mappings as mappings

    layers.get_global_memory_buffer = mappings.get_global_memory_buffer = lambda: _CpuBuffer()
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]


def _config(tp: int, sp: bool) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4,
                             tensor_model_parallel_size=tp, sequence_parallel=sp,
                             use_cpu_initialization=True, params_dtype=torch.float32)


def _pair(kind: str, sp: bool, bias: bool, tp: int, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    cfg = _config(tp, sp)
    init = torch.nn.init.xavier_normal_
    k, n = 256, 512
    if kind == "column":
        torch.manual_seed(seed)
        theirs = mtp.ColumnParallelLinear(k, n, config=cfg, init_method=init, bias=bias, gather_output=False,
                                          skip_bias_add=False, is_expert=False, tp_comm_buffer_name="fc1")
        torch.manual_seed(seed)  # the same master weight for both
        ours = ColumnParallelLinear(k, n, config=cfg, init_method=init, bias=bias, gather_output=False,
                                    skip_bias_add=False, is_expert=False, tp_comm_buffer_name="fc1")
    else:
        torch.manual_seed(seed)
        theirs = mtp.RowParallelLinear(n, k, config=cfg, init_method=init, bias=bias, input_is_parallel=True,
                                       skip_bias_add=False, is_expert=False, tp_comm_buffer_name="fc2")
        torch.manual_seed(seed)
        ours = RowParallelLinear(n, k, config=cfg, init_method=init, bias=bias, input_is_parallel=True,
                                 skip_bias_add=False, is_expert=False, tp_comm_buffer_name="fc2")
    with torch.no_grad():
        if bias:  # Megatron zero-initialises biases: make them count
            theirs.bias.normal_(generator=torch.Generator().manual_seed(7))
            ours.bias.copy_(theirs.bias)
    return theirs, ours


def compare_with_megatron(ck: Checker, rank: int, tp: int) -> None:
    for kind in ("column", "row"):
        for sp in (False, True):
            for bias in (False, True):
                name = f"{kind} sp={sp} bias={bias}"
                torch.manual_seed(zlib.crc32(name.encode()))
                theirs, ours = _pair(kind, sp, bias, tp)
                ck.bitwise("mcore", f"{name} weights from the same init", ours.weight.data, theirs.weight.data)
                for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                    ck.true("mcore", getattr(ours.weight, attr) == getattr(theirs.weight, attr),
                            f"{name}: weight.{attr} differs from Megatron's")
                s = 64 * tp
                k_in = 256 if kind == "column" else 512 // tp
                x = torch.randn(s // tp if (sp and kind == "column") else s, 2, k_in)
                results = []
                for layer in (theirs, ours):
                    xi = x.clone().requires_grad_(True)
                    y, b = layer(xi)
                    g = torch.Generator().manual_seed(11)
                    y.backward(torch.randn(y.shape, generator=g))
                    results.append((y.detach(), b, xi.grad, layer.weight.grad,
                                    layer.bias.grad if bias else None))
                (y0, b0, dx0, dw0, db0), (y1, b1, dx1, dw1, db1) = results
                ck.true("mcore", b0 is None and b1 is None, f"{name}: returned bias differs")
                for what, got, want in (("out", y1, y0), ("dx", dx1, dx0), ("dw", dw1, dw0), ("db", db1, db0)):
                    ck.bitwise("mcore", f"{name} {what}", got, want)


def _delayed_steps(layer: torch.nn.Module, x: torch.Tensor, steps: int) -> list[torch.Tensor]:
    outs = []
    for _ in range(steps):
        with mf.fp8_autocast(fp8_recipe=RECIPES["delayed"]):
            y, _ = layer(x)
        y.sum().backward()
        outs.append(y.detach())
    return outs


def _fp8_state(layer: Any) -> dict[str, torch.Tensor]:
    q = layer._quantizers["weight"]
    return {f"{role}.{k}": v for role in ("input", "weight", "grad_output")
            for k, v in getattr(q, role).state_dict().items() if isinstance(v, torch.Tensor)}


def _check_restored(ck: Checker, cat: str, name: str, src: Any, dst: Any, x: torch.Tensor) -> None:
    for key in ("weight", "bias"):
        ck.bitwise(cat, f"{name} {key}", getattr(dst, key).data, getattr(src, key).data)
    out_src, out_dst = _delayed_steps(src, x, 1)[0], _delayed_steps(dst, x, 1)[0]
    ck.bitwise(cat, f"{name} next-step output (uses the restored scale)", out_dst, out_src)
    s_src, s_dst = _fp8_state(src), _fp8_state(dst)
    ck.true(cat, sorted(s_src) == sorted(s_dst), f"{name}: FP8 state keys differ")
    for k in s_src:
        ck.bitwise(cat, f"{name} FP8 state {k}", s_dst.get(k), s_src[k])


def checkpoint_round_trips(ck: Checker, rank: int, tp: int, ckpt_dir: str) -> None:
    for kind in ("column", "row"):
        _, src = _pair(kind, True, True, tp, seed=3)
        _, dst = _pair(kind, True, True, tp, seed=4)
        _, dst2 = _pair(kind, True, True, tp, seed=5)
        k_in = 256 if kind == "column" else 512 // tp
        x = torch.randn(64 if kind == "column" else 64 * tp, 2, k_in)
        _delayed_steps(src, x, 3)  # a non-trivial amax history
        dst.load_state_dict(src.state_dict())
        _check_restored(ck, "ckpt", f"{kind} state_dict", src, dst, x)

        if importlib.util.find_spec("psutil") is None:  # megatron's checkpoint writer needs it
            continue
        # megatron distributed checkpoint (torch_dist), saved and loaded by all ranks
        path = f"{ckpt_dir}/{kind}"
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(src.sharded_state_dict(prefix="layer."), path)
        loaded = dist_checkpointing.load(dst2.sharded_state_dict(prefix="layer."), path)
        dst2.load_state_dict({k.removeprefix("layer."): v for k, v in loaded.items()})
        _check_restored(ck, "ckpt_dist", f"{kind} dist_checkpointing", src, dst2, x)

    # a Megatron-native checkpoint (its _extra_state is None) loads into ours
    theirs, ours = _pair("column", False, True, tp)
    with torch.no_grad():
        theirs.weight.add_(1.0)
    ours.load_state_dict(theirs.state_dict())
    ck.bitwise("ckpt", "Megatron checkpoint -> ours weight", ours.weight.data, theirs.weight.data)


def main() -> int:
    ckpt_dir = sys.argv[1]
    rank, tp = init_gloo()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    _cpu_shims()
    ck = Checker(rank)
    ck.guard("mcore", "compare with megatron", compare_with_megatron, ck, rank, tp)
    ck.guard("ckpt", "checkpoints", checkpoint_round_trips, ck, rank, tp, ckpt_dir)
    code = ck.report()
    parallel_state.destroy_model_parallel()
    shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
