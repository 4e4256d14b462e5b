"""``SDPAttention``: PyTorch's ``scaled_dot_product_attention`` (flash / cuDNN / efficient kernels on
CUDA, its own kernels on CPU) behind megatron-core's core-attention interface.

megatron-core's local ``DotProductAttention`` materialises the ``[b*np, sq, sk]`` scores and
probabilities and returns a fresh ``.contiguous()`` copy of its context, which nobody else saves:
``save_original_input`` on ``linear_proj`` then keeps a high-precision tensor that only the
projection holds. This core keeps Megatron's ``[s, b, np, hn]`` memory (queries, keys and values
are passed as permuted views, no copy), so SDPA writes its output in that layout and the
``[s, b, np * hn]`` context returned is a *view of the output SDPA saved for its own backward*:
with the flag on ``linear_proj`` the projection saves that very storage (zero extra bytes).

======================  =============================================================
argument                handled as
======================  =============================================================
causal mask type        ``is_causal=True`` (Megatron's mask tensor is not read)
padding / arbitrary     ``attn_mask = ~attention_mask`` (Megatron: True = masked out)
GQA                     ``enable_gqa=True``: keys and values are not repeated
dropout                 ``dropout_p`` in training, inside Megatron's CUDA RNG tracker
softmax scale           ``softmax_scale`` or 1/sqrt(hn) (query-key layer scaling is a
                        no-op here: the softmax runs in FP32)
======================  =============================================================

Refused with an error naming the setting: context parallelism, packed sequences, attention
bias, sliding windows, non-vanilla softmax.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F

from .specs import import_megatron, lazy_class

__all__: list[str] = []  # SDPAttention: built on first use (module __getattr__); it subclasses MegatronModule


def _build_class() -> type:
    module = import_megatron("megatron.core.transformer.module", "megatron_fp8.megatron.attention")
    enums = import_megatron("megatron.core.transformer.enums", "megatron_fp8.megatron.attention")
    tp = import_megatron("megatron.core.tensor_parallel", "megatron_fp8.megatron.attention")
    causal = {enums.AttnMaskType.causal}
    if hasattr(enums.AttnMaskType, "padding_causal"):
        causal.add(enums.AttnMaskType.padding_causal)  # causal is implied, the padding mask applied

    class SDPAttention(module.MegatronModule):  # type: ignore[misc, name-defined]
        """Core attention on ``F.scaled_dot_product_attention`` (module docstring)."""

        def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                     attention_dropout: float | None = None, softmax_scale: float | None = None,
                     cp_comm_type: str | None = None, pg_collection: Any = None, **kwargs: Any) -> None:
            super().__init__(config=config)
            where = f"megatron_fp8 SDPAttention (layer {layer_number})"
            refused = {
                "context_parallel_size": getattr(config, "context_parallel_size", 1) != 1,
                "window_size": getattr(config, "window_size", None) is not None,
                "softmax_type": getattr(config, "softmax_type", "vanilla") != "vanilla",
            }
            bad = [k for k, v in refused.items() if v]
            if bad:
                raise ValueError(f"{where}: config.{bad[0]}={getattr(config, bad[0])!r} is not supported by this "
                                 f"core attention; use megatron-core's (get_gpt_layer_spec(core_attention='local'))")
            tp_size = pg_collection.tp.size() if pg_collection is not None and hasattr(pg_collection, "tp") else \
                getattr(config, "tensor_model_parallel_size", 1)
            self.layer_number, self.attn_mask_type, self.attention_type = max(1, layer_number), attn_mask_type, \
                attention_type
            heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
            if heads % tp_size or groups % tp_size:
                raise ValueError(f"{where}: {heads} heads / {groups} query groups do not split over TP={tp_size}")
            self.heads, self.groups = heads // tp_size, groups // tp_size
            kv = getattr(config, "kv_channels", None) or config.hidden_size // heads
            self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv)
            self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                    attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None,
                    **kwargs: Any) -> torch.Tensor:
            """``query [sq, b, np, hn]``, ``key`` / ``value [sk, b, ng, hn]`` -> context
            ``[sq, b, np * hn]``, a view of the output SDPA saved (for Megatron's layout)."""
            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError("megatron_fp8 SDPAttention: packed sequences and attention bias are not supported; "
                                 "use megatron-core's core attention for them")
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            is_causal = mask_type in causal
            mask = None
            if attention_mask is not None and (not is_causal or getattr(mask_type, "name", "") == "padding_causal"):
                mask = ~attention_mask  # Megatron: True = masked out; SDPA: True = attend
                if is_causal:  # padding_causal: SDPA takes one of mask / is_causal, so fold causality in
                    sq, sk = query.shape[0], key.shape[0]
                    mask = mask & torch.ones(sq, sk, dtype=torch.bool, device=mask.device).tril(sk - sq)
                    is_causal = False
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d] views of [s, b, h, d]
            dropout = self.dropout_p if self.training else 0.0
            rng = contextlib.nullcontext()
            if dropout > 0 and not getattr(self.config, "sequence_parallel", False):
                rng = tp.get_cuda_rng_tracker().fork()
            with rng:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                                                     scale=self.softmax_scale, enable_gqa=self.heads != self.groups)
            context = out.permute(2, 0, 1, 3)  # [sq, b, np, hn]
            return context.reshape(*context.shape[:2], -1)  # a view when SDPA kept the query's layout

    SDPAttention.__module__ = __name__
    return SDPAttention


# built on first use: it subclasses megatron-core's class, and the package imports megatron-core
# only when a Megatron entry point is used
__getattr__ = lazy_class(__name__, "SDPAttention", _build_class)
