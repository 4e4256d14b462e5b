"""The only place in ``megatron_fp8.parallel`` that imports megatron-core, always lazily.

Everything here degrades to ``None`` / ``False`` without megatron-core, so the parallel layers
run on plain ``torch.distributed``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch.distributed as dist


def parallel_state() -> Any | None:
    """megatron-core's ``parallel_state`` module if imported *and* initialised, else None.

    Only looked up when the program already imported it (nothing else can have initialised
    it), so users without Megatron never pay megatron-core's import time or its warnings."""
    if "megatron.core.parallel_state" not in sys.modules:
        return None
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return None
    try:
        return ps if ps.model_parallel_is_initialized() else None
    except Exception:  # an older/newer API shape: treat as not initialised
        return None


def default_tp_group(is_expert: bool) -> dist.ProcessGroup | None:
    """megatron-core's (expert) tensor-parallel group, or None when it is not initialised."""
    ps = parallel_state()
    if ps is None:
        return None
    if is_expert and hasattr(ps, "get_expert_tensor_parallel_group"):
        return ps.get_expert_tensor_parallel_group()
    return ps.get_tensor_model_parallel_group()


@functools.cache
def _expert_group_terms() -> tuple[str, ...]:
    """The config comparisons that put an expert layer's parameters on the expert process groups
    (``allreduce=False``) in the installed megatron-core, read off its ``ColumnParallelLinear``:
    0.16 uses expert parallelism alone; 0.19 adds ``expert_tensor_parallel_size !=
    tensor_model_parallel_size``; 0.20 adds ``expert_gtp_weight_remat_size !=
    gtp_weight_remat_size``. Without megatron-core: the newest rule."""
    newest = ("expert_tensor_parallel_size", "expert_gtp_weight_remat_size")
    if "megatron.core" not in sys.modules:
        return newest
    try:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        source = inspect.getsource(ColumnParallelLinear.__init__)
    except (ImportError, OSError, TypeError):
        return newest
    return tuple(t for t in newest if f"config.{t} !=" in source)


def uses_expert_groups(config: Any, is_expert: bool) -> bool:
    """Whether an expert layer's parameters belong to the expert process groups (EP / ETP /
    EDP; Megatron marks them ``allreduce=False``), by the installed megatron-core's rule."""
    if not is_expert:
        return False
    if (getattr(config, "expert_model_parallel_size", 1) or 1) > 1:
        return True
    pairs = {"expert_tensor_parallel_size": "tensor_model_parallel_size",
             "expert_gtp_weight_remat_size": "gtp_weight_remat_size"}
    for term in _expert_group_terms():
        mine, dense = getattr(config, term, None), getattr(config, pairs[term], None)
        if mine is not None and dense is not None and mine != dense:
            return True
    return False


def make_sharded_tensors(
    state_dict: dict[str, Any],
    prefix: str,
    axis_map: dict[str, int],
    sharded_offsets: tuple[tuple[int, int, int], ...],
    tp_group: dist.ProcessGroup | None,
    metadata: dict[str, Any] | None,
    owner: str,
) -> dict[str, Any]:
    """megatron-core's ``make_sharded_tensors_for_checkpoint`` with the group keywords the
    installed version takes (0.16 added ``tp_group`` / ``dp_cp_group``)."""
    try:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
    except ImportError:
        raise RuntimeError(
            f"{owner}.sharded_state_dict needs megatron-core (pip install megatron-core); "
            f"use state_dict() for a plain torch checkpoint"
        ) from None
    kwargs: dict[str, Any] = {}
    params = inspect.signature(make_sharded_tensors_for_checkpoint).parameters
    dp_cp_group = (metadata or {}).get("dp_cp_group")
    if "tp_group" in params and (tp_group is not None or dp_cp_group is not None):
        if dp_cp_group is None:
            dp_cp_group = _default_dp_cp_group(owner)
        kwargs.update(tp_group=tp_group, dp_cp_group=dp_cp_group)
    return make_sharded_tensors_for_checkpoint(state_dict, prefix, axis_map, sharded_offsets, **kwargs)


def expert_dp_rank(pg_collection: Any | None, replicated: bool) -> int | None:
    """This rank's index among the ranks holding the same expert shard: the third entry of an
    expert checkpoint entry's ``replica_id`` (the dense data-parallel rank would mark the experts
    of every expert-parallel rank but the first as copies, and no rank would save them), as
    megatron-core sets it for Transformer Engine's grouped linears. ``replicated``: an entry every
    rank of the expert-data-parallel group holds alike (``_extra_state``; megatron-core main's
    ``expt_dp_gtp_remat`` group), else a weight (``expt_dp``). None where neither the
    process-group collection nor an initialised ``parallel_state`` names the group."""
    for name in (("expt_dp_gtp_remat", "expt_dp") if replicated else ("expt_dp",)):
        group = getattr(pg_collection, name, None) if pg_collection is not None else None
        if group is not None:
            return dist.get_rank(group)
    ps = parallel_state()
    if ps is None or not hasattr(ps, "get_expert_data_parallel_group"):
        return None
    get = ps.get_expert_data_parallel_group
    group = get(with_gtp_remat=replicated) if "with_gtp_remat" in inspect.signature(get).parameters else get()
    return dist.get_rank(group)


def _default_dp_cp_group(owner: str) -> dist.ProcessGroup:
    ps = parallel_state()
    if ps is not None:
        return ps.get_data_parallel_group(with_context_parallel=True)
    raise RuntimeError(
        f"{owner}.sharded_state_dict: megatron-core's parallel_state is not initialised, so pass "
        f"metadata={{'dp_cp_group': <data-parallel group>}} (a group of this rank alone when "
        f"there is no data parallelism)"
    )


def model_parallel_rng_tracker() -> Any | None:
    """megatron-core's CUDA RNG tracker when it holds the model-parallel states, else None."""
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    except ImportError:
        return None
    tracker = get_cuda_rng_tracker()
    states = tracker.get_states() if hasattr(tracker, "get_states") else {}
    return tracker if states else None
