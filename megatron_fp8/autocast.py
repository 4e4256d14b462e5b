"""The FP8 region: which recipe is active, over which group per-tensor amaxes are reduced.

``fp8_autocast`` mirrors Transformer Engine's context of the same name. Regions nest; the
innermost one wins. Each entry into an outermost enabled region starts a new FP8 *step*, the
unit in which delayed scaling rolls its amax history.

The region stack is per thread (a forward's region belongs to the thread running it); the step
counter is process-wide, because autograd runs the backward of CUDA tensors on its own worker
threads, and the gradients' delayed-scaling quantizers must see the steps the forward counted.
``resume_region`` re-enters a saved region without counting a step (for recompute).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist

from .recipe import Float8CurrentScaling, Recipe

__all__ = ["fp8_autocast", "resume_region", "FP8State", "current_fp8_state", "is_fp8_enabled", "fp8_step"]


@dataclass(frozen=True)
class FP8State:
    """What layers see inside a region: ``enabled``, the recipe, the amax-reduction group."""

    enabled: bool
    recipe: Recipe
    group: dist.ProcessGroup | None


class _Regions(threading.local):
    def __init__(self) -> None:
        self.stack: list[FP8State] = []
        self.replaying = 0  # > 0 inside resume_region: nested regions count no step


_regions = _Regions()
_step = 0
_step_lock = threading.Lock()


def current_fp8_state() -> FP8State | None:
    """The innermost region's state, or ``None`` outside every region."""
    return _regions.stack[-1] if _regions.stack else None


def is_fp8_enabled() -> bool:
    state = current_fp8_state()
    return state is not None and state.enabled


def fp8_step() -> int:
    """Counter of outermost enabled-region entries (the delayed-scaling step), process-wide."""
    return _step


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True,
    fp8_recipe: Recipe | None = None,
    fp8_group: dist.ProcessGroup | None = None,
) -> Iterator[FP8State]:
    """Run the layers inside with FP8 GEMMs under ``fp8_recipe`` (default: current scaling).

    ``fp8_group``: the process group over which per-tensor recipes (delayed, current) reduce
    amaxes, so that every rank of a tensor-parallel group casts with the same scale.
    """
    if fp8_recipe is None:
        fp8_recipe = Float8CurrentScaling()
    if not isinstance(fp8_recipe, Recipe.__args__):  # type: ignore[attr-defined]
        raise TypeError(
            f"fp8_autocast(fp8_recipe=...) takes a recipe from megatron_fp8.recipe, got "
            f"{type(fp8_recipe).__name__}"
        )
    global _step
    state = FP8State(bool(enabled), fp8_recipe, fp8_group)
    if state.enabled and not _regions.replaying and not any(s.enabled for s in _regions.stack):
        with _step_lock:
            _step += 1
    _regions.stack.append(state)
    try:
        yield state
    finally:
        _regions.stack.pop()


@contextlib.contextmanager
def resume_region(state: FP8State | None) -> Iterator[None]:
    """Re-enter a region saved earlier (``current_fp8_state()`` at the time; ``None`` = FP8 off)
    without starting a step, also for ``fp8_autocast`` regions opened inside it."""
    _regions.stack.append(state if state is not None else FP8State(False, Float8CurrentScaling(), None))
    _regions.replaying += 1
    try:
        yield
    finally:
        _regions.replaying -= 1
        _regions.stack.pop()
