"""Input checks of the parallel layers: clear errors naming the layer and the fix, and the
single warning when a recipe's GEMMs must be emulated on this hardware."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from ..gemm import native_supported
from ..ops.linear import LinearQuantizers
from ..recipe import Recipe

__all__ = ["divide", "config_value", "check_sequence_parallel_input", "warn_if_emulated", "same_on_all_ranks"]

_REQUIRED_CONFIG = ("tensor_model_parallel_size", "sequence_parallel", "params_dtype")
_CONFIG_DEFAULTS: dict[str, Any] = {
    "gradient_accumulation_fusion": False,
    "use_cpu_initialization": False,
    "perform_initialization": True,
    "expert_model_parallel_size": 1,
    "defer_embedding_wgrad_compute": False,
}


def divide(size: int, tp: int, owner: str, what: str) -> int:
    """``size // tp``, or a ValueError naming the layer, the size and the fix."""
    if size <= 0:
        raise ValueError(f"{owner}: {what}={size} must be positive")
    if size % tp:
        raise ValueError(
            f"{owner}: {what}={size} is not divisible by the tensor-parallel size {tp}; "
            f"pick a {what} that is a multiple of {tp} (pad it) or change the TP size"
        )
    return size // tp


def config_value(config: Any, name: str, owner: str) -> Any:
    """A field of a Megatron ``TransformerConfig`` (or look-alike), with Megatron's default."""
    if config is None:
        raise TypeError(f"{owner}: config=None; pass a megatron TransformerConfig or an object "
                        f"with the fields {', '.join(_REQUIRED_CONFIG + tuple(_CONFIG_DEFAULTS))}")
    if hasattr(config, name):
        return getattr(config, name)
    if name in _CONFIG_DEFAULTS:
        return _CONFIG_DEFAULTS[name]
    raise TypeError(f"{owner}: config ({type(config).__name__}) lacks the field {name!r}, which "
                    f"the tensor-parallel layers read; add it (Megatron's TransformerConfig has it)")


def check_sequence_parallel_input(x: torch.Tensor, tp: int, owner: str) -> None:
    """Sequence parallelism needs a ``[s, b, h]``-style input whose dim 0 is the sequence."""
    if x.dim() < 2:
        raise ValueError(f"{owner}: sequence parallelism needs an input of at least 2 dims "
                         f"[sequence, ..., hidden], got shape {tuple(x.shape)}")
    if x.shape[0] % tp:
        raise ValueError(
            f"{owner}: with sequence_parallel the sequence dim (dim 0) of the input, "
            f"{x.shape[0]}, must be divisible by the tensor-parallel size {tp}; pad the sequence "
            f"or turn sequence_parallel off"
        )


_warned: set[tuple[str, str]] = set()


def warn_if_emulated(q: LinearQuantizers, recipe: Recipe, device: torch.device, owner: str) -> None:
    """Warn once per (recipe type, device type) per process when this device has no native FP8
    GEMM for some of the recipe's layout pairs: those GEMMs are emulated (same numbers within
    accumulation tolerance, much slower)."""
    key = (type(recipe).__name__, device.type)
    if key in _warned:
        return
    _warned.add(key)
    pairs = {
        "fprop": (q.input.layout, q.weight.layout),
        "dgrad": (q.grad_output.layout, q.weight.layout),
        "wgrad": (q.grad_output.layout, q.input.layout),
    }
    missing = [f"{g} ({a.value} x {b.value})" for g, (a, b) in pairs.items()
               if not native_supported(a, b, device)]
    if missing:
        warnings.warn(
            f"{owner}: {type(recipe).__name__} has no native FP8 GEMM on this {device.type} device "
            f"for {', '.join(missing)}; those GEMMs are emulated (dequantize + FP32 matmul). "
            f"Results are correct but slow; shown once per recipe and device type",
            RuntimeWarning,
            stacklevel=3,
        )


_WIDTH = 384  # bytes of a value compared across ranks (a recipe's description fits; longer ones are hashed)


def _encode(value: str, device: torch.device) -> torch.Tensor:
    raw = value.encode()
    if len(raw) > _WIDTH:
        raw = raw[:_WIDTH - 20] + f"..#{hash(value) & 0xFFFFFFFF:08x}".encode()
    return torch.tensor(list(raw.ljust(_WIDTH, b"\0")), dtype=torch.uint8, device=device)


def same_on_all_ranks(value: str, group: dist.ProcessGroup | None, device: torch.device, owner: str,
                      what: str, fix: str = "open the same fp8_autocast (recipe and format) on every rank") -> None:
    """Raise on every rank of ``group`` unless all ranks pass the same ``value``: one small
    all-gather (call it when the value may have changed, never per step), then an error naming
    each rank's value and the fix. Ranks that disagree would otherwise run collectives of
    different sizes or scales: wrong numbers or a hang."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    mine = _encode(value, device)
    everyone = torch.empty(dist.get_world_size(group) * _WIDTH, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    got = [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in everyone.view(-1, _WIDTH).cpu()]
    if len(set(got)) > 1:
        ranks = dist.get_process_group_ranks(group)
        listing = "; ".join(f"rank {r}: {v}" for r, v in zip(ranks, got))
        raise RuntimeError(f"{owner}: the ranks of its {what} group disagree ({listing}); {fix}")
