"""FP8 recipes: frozen, validated descriptions of *how* to scale (see RECIPES.md).

A recipe says nothing about tensors or devices; quantizers (``megatron_fp8.quant``) turn a
recipe plus a tensor role (input, weight, grad-output) into casts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

import torch

__all__ = [
    "Format",
    "TensorRole",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "Recipe",
    "PRESETS",
    "recipe_from_name",
]


class Format(enum.Enum):
    """FP8 formats per tensor role. ``HYBRID``: E4M3 forward, E5M2 gradients."""

    E4M3 = "E4M3"
    HYBRID = "HYBRID"


class TensorRole(enum.Enum):
    """The three tensors a linear layer quantizes."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"


def _fail(recipe: object, name: str, value: object, allowed: str) -> None:
    raise ValueError(f"{type(recipe).__name__}.{name}={value!r} is invalid; allowed: {allowed}")


def _check_format(recipe: object) -> None:
    fmt = recipe.fp8_format
    if not isinstance(fmt, Format):
        _fail(recipe, "fp8_format", fmt, "Format.E4M3 or Format.HYBRID")


# Bounds beyond which no normal tensor casts to a finite, non-zero FP8 tensor:
MAX_MARGIN = 16  # amax maps to FP8_MAX / 2**margin: past ~17 (E4M3) even the largest element flushes
MAX_AMAX_EPSILON = 1.0  # a floor on the amax of near-zero tensors; above 1.0 it rescales ordinary ones
MAX_AMAX_HISTORY_LEN = 65536


def _check_epsilon(recipe: object) -> None:
    eps = recipe.amax_epsilon
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0.0 <= eps <= MAX_AMAX_EPSILON:
        _fail(recipe, "amax_epsilon", eps,
              f"a float in [0.0, {MAX_AMAX_EPSILON}] (a floor for the amax of all-zero or tiny tensors; a larger "
              f"one scales ordinary tensors down until they cast to zeros)")


def _check_bool(recipe: object, name: str) -> None:
    if not isinstance(getattr(recipe, name), bool):
        _fail(recipe, name, getattr(recipe, name), "True or False")


class _RecipeBase:
    """Shared helpers: the FP8 dtype each tensor role is cast to."""

    fp8_format: Format

    def fp8_dtype(self, role: TensorRole) -> torch.dtype:
        if self.fp8_format is Format.HYBRID and role is TensorRole.GRAD_OUTPUT:
            return torch.float8_e5m2
        return torch.float8_e4m3fn

    @property
    def per_tensor(self) -> bool:
        """True for recipes with one scale per tensor (amaxes reduced over ``fp8_group``)."""
        return False

    def describe(self) -> str:
        args = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))  # type: ignore[arg-type]
        return f"{type(self).__name__}({args})"


@dataclass(frozen=True)
class DelayedScaling(_RecipeBase):
    """Per-tensor scale from a history of past amaxes (recipe 1).

    ``scale = FP8_MAX / amax / 2**margin`` with ``amax`` the max (``"max"``) or the newest
    (``"most_recent"``) entry of the last ``amax_history_len`` steps.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        _check_format(self)
        if not isinstance(self.margin, int) or isinstance(self.margin, bool) or not 0 <= self.margin <= MAX_MARGIN:
            _fail(self, "margin", self.margin,
                  f"an int in [0, {MAX_MARGIN}] (the amax maps to FP8_MAX / 2**margin; a larger margin casts "
                  f"every element to zero or to a few subnormal steps)")
        if (
            not isinstance(self.amax_history_len, int)
            or isinstance(self.amax_history_len, bool)
            or not 1 <= self.amax_history_len <= MAX_AMAX_HISTORY_LEN
        ):
            _fail(self, "amax_history_len", self.amax_history_len, f"an int in [1, {MAX_AMAX_HISTORY_LEN}]")
        if self.amax_compute_algo not in ("max", "most_recent"):
            _fail(self, "amax_compute_algo", self.amax_compute_algo, "'max' or 'most_recent'")

    @property
    def per_tensor(self) -> bool:
        return True


@dataclass(frozen=True)
class Float8CurrentScaling(_RecipeBase):
    """Per-tensor scale from the amax of the tensor being cast (recipe 2)."""

    fp8_format: Format = Format.HYBRID
    power_2_scale: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        _check_format(self)
        _check_bool(self, "power_2_scale")
        _check_epsilon(self)

    @property
    def per_tensor(self) -> bool:
        return True


@dataclass(frozen=True)
class Float8BlockScaling(_RecipeBase):
    """DeepSeek-V3 block scaling (recipe 3): 1x128 tiles for x/dy, 128x128 blocks for w."""

    fp8_format: Format = Format.E4M3
    power_2_scale: bool = True
    amax_epsilon: float = 0.0
    block_size: int = 128

    def __post_init__(self) -> None:
        _check_format(self)
        _check_bool(self, "power_2_scale")
        _check_epsilon(self)
        if self.block_size != 128:
            _fail(self, "block_size", self.block_size, "128 (the tile Hopper GEMMs consume)")


@dataclass(frozen=True)
class MXFP8BlockScaling(_RecipeBase):
    """OCP MXFP8 (recipe 4): 1x32 blocks along the contraction dim, E8M0 scales."""

    fp8_format: Format = Format.E4M3
    block_size: int = 32

    def __post_init__(self) -> None:
        _check_format(self)
        if self.block_size != 32:
            _fail(self, "block_size", self.block_size, "32 (the OCP MX block)")


Recipe = DelayedScaling | Float8CurrentScaling | Float8BlockScaling | MXFP8BlockScaling

PRESETS: dict[str, Recipe] = {
    "delayed": DelayedScaling(),
    "current": Float8CurrentScaling(),
    "current_pow2": Float8CurrentScaling(power_2_scale=True),
    "blockwise": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
}


def recipe_from_name(name: str) -> Recipe:
    """Return the named preset recipe (``PRESETS``), or raise naming the choices."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown FP8 recipe {name!r}; choose one of {sorted(PRESETS)}") from None
