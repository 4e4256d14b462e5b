"""The recipes' quantizers, and ``make_quantizer``: the quantizer a recipe prescribes for a role.

``quantize(x, rowwise=, columnwise=)`` casts the requested copies. Per-tensor quantizers accept
``scale=`` to reuse a scale cast earlier (``save_original_input`` casts the columnwise copy in
backward with the forward's scale, recording no second amax). The base class is in
``quantizer``, the per-tensor ones in ``tensor_scaling``, the block ones in ``block_scaling``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    Recipe,
    TensorRole,
)
from .block_scaling import Block1DQuantizer, Block2DQuantizer, MXFP8Quantizer
from .quantizer import Quantizer, Segments
from .tensor_scaling import CurrentScalingQuantizer, DelayedScalingQuantizer

__all__ = [
    "Quantizer",
    "Segments",
    "CurrentScalingQuantizer",
    "DelayedScalingQuantizer",
    "Block1DQuantizer",
    "Block2DQuantizer",
    "MXFP8Quantizer",
    "make_quantizer",
]


def make_quantizer(
    recipe: Recipe,
    role: TensorRole,
    *,
    group: dist.ProcessGroup | None = None,
    name: str | None = None,
    device: torch.device | str | None = None,
) -> Quantizer:
    """The quantizer a recipe prescribes for a tensor role."""
    dtype = recipe.fp8_dtype(role)
    name = name or role.value
    if isinstance(recipe, DelayedScaling):
        return DelayedScalingQuantizer(dtype, recipe, group=group, name=name, device=device)
    if isinstance(recipe, Float8CurrentScaling):
        return CurrentScalingQuantizer(
            dtype, power_2_scale=recipe.power_2_scale, amax_epsilon=recipe.amax_epsilon,
            group=group, name=name,
        )
    if isinstance(recipe, Float8BlockScaling):
        cls = Block2DQuantizer if role is TensorRole.WEIGHT else Block1DQuantizer
        return cls(dtype, power_2_scale=recipe.power_2_scale, amax_epsilon=recipe.amax_epsilon,
                   block=recipe.block_size, name=name)
    if isinstance(recipe, MXFP8BlockScaling):
        return MXFP8Quantizer(dtype, block=recipe.block_size, name=name)
    raise TypeError(f"no quantizer for recipe {type(recipe).__name__}")
