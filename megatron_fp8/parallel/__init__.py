"""Tensor parallelism: process groups, TP collectives, and the Megatron-signature
``ColumnParallelLinear`` / ``RowParallelLinear`` on the FP8 linear autograd function."""

from .column import ColumnParallelLinear
from .config import ParallelConfig
from .groups import group_rank, group_size, resolve_tp_group
from .row import RowParallelLinear

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "ParallelConfig", "resolve_tp_group", "group_size", "group_rank",
]
