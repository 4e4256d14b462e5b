"""Multi-latent attention on megatron_fp8's linears: ``MLASelfAttention`` and its layer spec.

megatron-core's ``MLASelfAttention`` accepts only ``Linear``, TE's ``ColumnParallelLinear`` and
its own ``ColumnParallelLinear`` for ``linear_q_down_proj`` / ``linear_kv_down_proj`` (a
``submodules.x in [...]`` check, in 0.16 through 0.20), so our linears cannot sit there through a
spec. Our ``MLASelfAttention`` is megatron-core's class whose constructor sees our
``ColumnParallelLinear`` under megatron-core's name for that check (a swap of the name in
megatron-core's module for the duration of the constructor, restored after); everything else,
including the forward, the ``mla_up_proj`` output-discarding recompute and the checkpoint keys,
is megatron-core's.

The two down-projections read the same tensor (the input layernorm's output): that is where
``save_original_input`` pays, and where Megatron's ``--recompute-modules layernorm`` then frees
the norm output (megatron-core turns the flag on for them itself when FP8 and that recompute are
on).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from .specs import import_megatron, lazy_class

__all__: list[str] = []  # MLASelfAttention: built on first use (module __getattr__), like experts.GroupedMLP


class _NoTE:
    """Stands for TE's ``TELinear`` where TE is absent: nothing is an instance of it."""


def _build_class() -> type:
    mla = import_megatron("megatron.core.transformer.multi_latent_attention", "megatron_fp8 multi-latent attention")
    from ..parallel import ColumnParallelLinear

    class MLASelfAttention(mla.MLASelfAttention):  # type: ignore[misc, name-defined]
        """megatron-core's MLA self-attention with megatron_fp8's down-projections (module
        docstring)."""

        def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
            theirs = mla.ColumnParallelLinear, getattr(mla, "TELinear", None)
            mla.ColumnParallelLinear = ColumnParallelLinear  # what its class check compares against
            if not isinstance(theirs[1], type):  # TE absent: a stub (None, a MagicMock) that megatron-core
                mla.TELinear = _NoTE                  # still passes to isinstance()
            try:
                super().__init__(config, submodules, *args, **kwargs)
            finally:
                mla.ColumnParallelLinear, mla.TELinear = theirs

    MLASelfAttention.__module__ = __name__
    return MLASelfAttention


def mla_attention_spec(norm: Any, qk_layernorm: bool, core_attention: type) -> Any:
    """The ``self_attention`` entry of an MLA layer: our ``MLASelfAttention`` with our Column /
    Row linears, ``core_attention`` and ``norm`` for the q / kv latents (or none)."""
    what = "megatron_fp8 multi-latent attention"
    spec_utils = import_megatron("megatron.core.transformer.spec_utils", what)
    enums = import_megatron("megatron.core.transformer.enums", what)
    mla = import_megatron("megatron.core.transformer.multi_latent_attention", what)
    identity = import_megatron("megatron.core.transformer.identity_op", what).IdentityOp
    from ..parallel import ColumnParallelLinear, RowParallelLinear

    qk_norm = norm if qk_layernorm else identity
    return spec_utils.ModuleSpec(
        module=__getattr__("MLASelfAttention"),
        params={"attn_mask_type": enums.AttnMaskType.causal},
        submodules=mla.MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear, core_attention=core_attention, linear_proj=RowParallelLinear,
            q_layernorm=qk_norm, kv_layernorm=qk_norm),
    )


def with_mla(layer_spec: Any, qk_layernorm: bool, core_attention: type) -> Any:
    """A copy of a (converted) dense or MoE layer spec whose self-attention is MLA."""
    new = copy.copy(layer_spec)
    sub = copy.copy(layer_spec.submodules)
    norm = sub.input_layernorm
    if isinstance(norm, functools.partial) or not isinstance(norm, type):
        norm = getattr(norm, "module", getattr(norm, "func", norm))
    sub.self_attention = mla_attention_spec(norm, qk_layernorm, core_attention)
    new.submodules = sub
    return new


# built on first use: it subclasses megatron-core's class, and the package imports megatron-core
# only when a Megatron entry point is used
__getattr__ = lazy_class(__name__, "MLASelfAttention", _build_class)
