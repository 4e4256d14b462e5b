"""The layer norms of our Megatron spec: megatron-core's torch norms, with sequence parallelism.

Without Transformer Engine or apex, megatron-core's local spec builds its norms with
``WrappedTorchNorm`` (``torch.nn.LayerNorm`` / ``RMSNorm``), which refuses
``sequence_parallel``, so a Megatron-LM run of our spec could not use ``--sequence-parallel``,
and MoE with tensor parallelism could not run at all (megatron-core requires sequence
parallelism there). A norm needs nothing from sequence parallelism but a mark: each rank
normalises its own tokens, so its weight (and bias) gradients are partial sums over the
sequence, and Megatron's ``finalize_model_grads`` all-reduces, across the tensor-parallel group,
the gradients of every parameter marked ``sequence_parallel``, as Transformer Engine's and apex's
norms mark theirs. ``Norm`` builds the module ``WrappedTorchNorm`` builds (same class, same
numbers) and marks its parameters. ``persist_layer_norm`` (the default of Megatron-LM's
arguments) is accepted: it picks apex's persistent kernel, which torch's norms do not have, and
changes no number. Zero-centred gamma and the memory-efficient norm are refused as
megatron-core refuses them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .specs import Overlay, import_megatron


class Norm:
    """megatron-core's norm interface (``Norm(config, hidden_size, eps, ...)``) on torch's
    ``LayerNorm`` / ``RMSNorm``, with ``config.sequence_parallel`` allowed (module docstring)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> nn.Module:
        torch_norm = import_megatron("megatron.core.transformer.torch_norm", "megatron_fp8.megatron.Norm")
        for field, why in (("layernorm_zero_centered_gamma", "zero-centred gamma"),
                           ("memory_efficient_layer_norm", "the memory-efficient layer norm")):
            if getattr(config, field, False):
                raise ValueError(f"megatron_fp8.megatron.Norm: {why} ({field}=True) needs Transformer Engine's or "
                                 f"apex's norm, which megatron_fp8's spec does not build; set {field}=False")
        sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        norm = torch_norm.WrappedTorchNorm(Overlay(config, sequence_parallel=False, persist_layer_norm=False),
                                           hidden_size, eps)
        if sequence_parallel:
            for p in norm.parameters():
                p.sequence_parallel = True  # type: ignore[attr-defined]
        return norm
