"""Autograd-aware TP region maps around a linear (Megatron's ``mappings``), on ``collectives``.

=================================  ==========================  ============================
map                                forward                     backward
=================================  ==========================  ============================
``reduce_from_region``             all-reduce                  identity
``reduce_scatter_to_sequence``     reduce-scatter dim 0        all-gather dim 0
``scatter_to_region``              split last dim              all-gather last dim
``gather_from_region``             all-gather last dim         split last dim
=================================  ==========================  ============================

The column-parallel input side (identity / all-gather forward, all-reduce / reduce-scatter
dgrad) lives inside the linear autograd function (``comm.ColumnComm``) so it can overlap the
backward GEMMs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import collectives as C

__all__ = ["reduce_from_region", "reduce_scatter_to_sequence", "scatter_to_region", "gather_from_region"]


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y_partial: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        # y_partial is the row layer's own GEMM output, saved by nothing: summing into its
        # storage (as Megatron does) saves a copy of the output.
        return C.all_reduce(y_partial.detach(), group, inplace=True).wait()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        return dy, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y_partial: torch.Tensor, group: dist.ProcessGroup | None,  # type: ignore[override]
                what: str) -> torch.Tensor:
        ctx.group = group
        return C.reduce_scatter_tokens(y_partial, group, what).wait()

    @staticmethod
    def backward(ctx: Any, dy_local: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return C.all_gather_tokens(dy_local, ctx.group).wait(), None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return C.split_last_dim(x, group)

    @staticmethod
    def backward(ctx: Any, dx_local: torch.Tensor) -> tuple[torch.Tensor, None]:
        return C.all_gather_last_dim(dx_local, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y_local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return C.all_gather_last_dim(y_local, group)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        return C.split_last_dim(dy, ctx.group), None


def reduce_from_region(y_partial: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Row-parallel output: ``[..., N]`` partial sums -> ``[..., N]`` summed; grad passes through."""
    return _ReduceFromRegion.apply(y_partial, group)


def reduce_scatter_to_sequence(y_partial: torch.Tensor, group: dist.ProcessGroup | None,
                               what: str = "tensor") -> torch.Tensor:
    """Row-parallel output with SP: ``[s, b, N]`` partial -> ``[s/tp, b, N]`` summed shard."""
    return _ReduceScatterToSequence.apply(y_partial, group, what)


def scatter_to_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Row-parallel input not yet split: ``[..., K]`` -> this rank's ``[..., K/tp]``."""
    return _ScatterToRegion.apply(x, group)


def gather_from_region(y_local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Column-parallel ``gather_output``: ``[..., N/tp]`` -> ``[..., N]``."""
    return _GatherFromRegion.apply(y_local, group)
