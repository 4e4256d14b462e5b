"""Weight allocation and initialisation of a TP shard, and Megatron's parameter attributes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import _mcore

__all__ = ["set_tp_attributes", "init_shard_from_master", "init_shard_directly"]


def set_tp_attributes(param: nn.Parameter, is_parallel: bool, partition_dim: int, stride: int) -> None:
    """``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``: what Megatron's
    optimizer, grad-norm and checkpoint code read to tell shards from replicas."""
    param.tensor_model_parallel = is_parallel  # type: ignore[attr-defined]
    param.partition_dim = partition_dim  # type: ignore[attr-defined]
    param.partition_stride = stride  # type: ignore[attr-defined]


@torch.no_grad()
def init_shard_from_master(
    weight: torch.Tensor,
    full_shape: tuple[int, int],
    partition_dim: int,
    init_method: Callable[[torch.Tensor], object],
    stride: int,
    rank: int,
    tp: int,
) -> torch.Tensor:
    """Initialise the full ``[out, in]`` weight in FP32 on CPU (the same on every rank), copy
    this rank's shard into ``weight`` and return the full (master) weight.

    With ``stride`` s the partition dim is cut into ``tp * s`` chunks and rank r takes chunks
    ``r, r + tp, ...`` (strided layouts such as a fused gate/up projection).
    """
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    master = master.to(weight.dtype)
    chunk = weight.shape[partition_dim] // stride
    pieces = torch.split(master, chunk, dim=partition_dim)[rank::tp]
    weight.copy_(torch.cat(pieces, dim=partition_dim))
    return master


@torch.no_grad()
def init_shard_directly(weight: torch.Tensor, init_method: Callable[[torch.Tensor], object]) -> None:
    """Initialise the local shard in place (device initialisation), under megatron-core's
    model-parallel RNG when it is set up so that shards differ across TP ranks."""
    tracker = _mcore.model_parallel_rng_tracker() if weight.is_cuda else None
    if tracker is None:
        init_method(weight)
        return
    with tracker.fork():
        init_method(weight)
