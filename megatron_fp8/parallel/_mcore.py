"""The only place in ``megatron_fp8.parallel`` that imports megatron-core, always lazily.

Everything here degrades to ``None`` / ``False`` without megatron-core, so the parallel layers
run on plain ``torch.distributed``.
"""

from __future__ import annotations

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
