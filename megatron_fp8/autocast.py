"""The FP8 region: which recipe is active, over which group per-tensor amaxes are reduced.

``fp8_autocast`` mirrors Transformer Engine's context of the same name. Regions nest; the
innermost one wins. Each entry into an outermost enabled region starts a new FP8 *step*, the
unit in which delayed scaling rolls its amax history.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist

from .recipe import Float8CurrentScaling, Recipe

__all__ = ["fp8_autocast", "FP8State", "current_fp8_state", "is_fp8_enabled", "fp8_step"]


@dataclass(frozen=True)
class FP8State:
    """What layers see inside a region: ``enabled``, the recipe, the amax-reduction group."""

    enabled: bool
    recipe: Recipe
    group: dist.ProcessGroup | None


class _Regions(threading.local):
    def __init__(self) -> None:
        self.stack: list[FP8State] = []
        self.step = 0


_regions = _Regions()


def current_fp8_state() -> FP8State | None:
    """The innermost region's state, or ``None`` outside every region."""
    return _regions.stack[-1] if _regions.stack else None


def is_fp8_enabled() -> bool:
    state = current_fp8_state()
    return state is not None and state.enabled


def fp8_step() -> int:
    """Counter of outermost enabled-region entries (the delayed-scaling step)."""
    return _regions.step


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
    state = FP8State(bool(enabled), fp8_recipe, fp8_group)
    if state.enabled and not any(s.enabled for s in _regions.stack):
        _regions.step += 1
    _regions.stack.append(state)
    try:
        yield state
    finally:
        _regions.stack.pop()
