"""Which process group a parallel layer communicates over, and its size and rank.

Resolution order (issue 4): an explicit ``tp_group`` (or ``pg_collection.tp`` /
``pg_collection.expt_tp`` for experts), else megatron-core's ``parallel_state`` when it is
initialised, else the default ``torch.distributed`` group when a process group exists, else no
group (a single process: TP size 1).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from . import _mcore

__all__ = ["resolve_tp_group", "group_size", "group_rank"]


def resolve_tp_group(
    tp_group: dist.ProcessGroup | None = None,
    *,
    is_expert: bool = False,
    pg_collection: Any | None = None,
) -> dist.ProcessGroup | None:
    """The tensor-parallel group a layer should use (see the module docstring)."""
    if tp_group is not None:
        return tp_group
    if pg_collection is not None:
        group = getattr(pg_collection, "expt_tp" if is_expert else "tp", None)
        if group is not None:
            return group
    group = _mcore.default_tp_group(is_expert)
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else 1


def group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if group is not None else 0
