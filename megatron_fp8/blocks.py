"""Reusable layer pieces with optional output-discarding recompute (``megatron_fp8.recompute``).

The three placements Megatron names, each a small ``nn.Module`` with ``recompute=False|True``:

==========================  ==========================  =====================================
block                       discarded (recomputed)      consumers that must save it as is
==========================  ==========================  =====================================
``NormProjections``         the norm output             input layernorm -> qkv linear, or MLA
                                                        q_down + kv_down; pre-MLP layernorm ->
                                                        dense fc1, or shared experts' fc1 (+ a
                                                        router)
``ActivationFC2``           the activation output       MoE activation -> expert fc2
``MLAUpProjAttention``      q, k, v of the up-proj      core attention (hand-written: it saves
                                                        q, k, v themselves); the hook sits on
                                                        the attention projection's input
==========================  ==========================  =====================================

With ``recompute=True`` a consumer that has a ``save_original_input`` attribute set to False is
rejected at construction (``MissingSaveOriginalInputError``), and again at discard time if the
flag was cleared later. Blocks never change the flag themselves. With or without recompute the
numbers are bitwise the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .modules.linear import Linear
from .recompute import CheckpointWithoutOutput, MissingSaveOriginalInputError

__all__ = [
    "make_norm",
    "NormProjections",
    "ActivationFC2",
    "MLAUpProjAttention",
    "core_attention",
    "swiglu",
]


def make_norm(kind: str, hidden: int, *, eps: float = 1e-5, use_apex: bool = False,
              dtype: torch.dtype | None = None) -> nn.Module:
    """``"layernorm"`` or ``"rmsnorm"``: torch's modules; apex's fused ones only when
    ``use_apex`` and apex is importable (it is never required)."""
    if kind not in ("layernorm", "rmsnorm"):
        raise ValueError(f"make_norm: kind={kind!r}; choose 'layernorm' or 'rmsnorm'")
    if use_apex:
        try:
            from apex.normalization import FusedLayerNorm, FusedRMSNorm  # type: ignore[import-not-found]
        except ImportError:
            pass
        else:
            cls = FusedLayerNorm if kind == "layernorm" else FusedRMSNorm
            return cls(hidden, eps=eps).to(dtype=dtype)
    cls = nn.LayerNorm if kind == "layernorm" else nn.RMSNorm
    return cls(hidden, eps=eps, dtype=dtype)


def require_save_original_input(block: str, consumer: nn.Module) -> None:
    """Fail fast (at construction) when ``consumer`` would save its own copy of the input."""
    if hasattr(consumer, "save_original_input") and not consumer.save_original_input:
        name = type(consumer).__name__
        raise MissingSaveOriginalInputError(
            f"{block}(recompute=True): its consumer {name} has save_original_input=False, so it would "
            f"save its own FP8 copy and the recompute would free nothing. Fix: build the {name} with "
            f"save_original_input=True, or use recompute=False."
        )


def _tensors(out: Any) -> list[torch.Tensor]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor)]


class NormProjections(nn.Module):
    """``norm(x)`` fed to each projection; returns the projections' outputs as a tuple.

    Placements: input layernorm -> qkv (one projection) or MLA q_down and kv_down (two);
    pre-MLP layernorm -> dense fc1, or shared experts' fc1 next to a router. The norm may be
    any module (e.g. ``nn.Sequential(norm, nn.Dropout(p))``). With ``recompute`` the norm output
    is freed after the projections ran and recomputed when the first projection output's
    gradient arrives.
    """

    def __init__(self, norm: nn.Module, projections: Sequence[nn.Module], *, recompute: bool = False,
                 name: str = "norm") -> None:
        super().__init__()
        if not projections:
            raise ValueError("NormProjections: give at least one projection")
        self.norm = norm
        self.projections = nn.ModuleList(projections)
        self.recompute = recompute
        self.name = name
        if recompute:
            for p in self.projections:
                require_save_original_input(type(self).__name__, p)

    def _project(self, h: torch.Tensor) -> tuple[Any, ...]:
        return tuple(p(h) for p in self.projections)

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        if not self.recompute:
            return self._project(self.norm(x))
        ckpt = CheckpointWithoutOutput(self.name)
        outs = self._project(ckpt.checkpoint(self.norm, x))
        ckpt.discard_output_and_register_recompute([t for o in outs for t in _tensors(o)])
        return outs


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with ``h = [gate, up]`` along the last dim."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class ActivationFC2(nn.Module):
    """``fc2(dropout(activation(h)), *fc2_args)``: the MoE expert activation -> fc2.

    ``h``: the fc1 output over the (permuted) tokens routed to the experts. ``fc2``: any module
    with a ``save_original_input`` flag, on with ``recompute`` (``megatron_fp8.Linear``, or the
    FP8 ``GroupedLinear`` with ``m_splits`` in ``fc2_args``).
    """

    def __init__(self, fc2: nn.Module, *, activation: Callable[[torch.Tensor], torch.Tensor] = swiglu,
                 dropout: float = 0.0, recompute: bool = False, name: str = "moe_act") -> None:
        super().__init__()
        self.fc2 = fc2
        self.activation = activation
        self.dropout = nn.Dropout(dropout)
        self.recompute = recompute
        self.name = name
        if recompute:
            require_save_original_input(type(self).__name__, fc2)

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.activation(h))

    def forward(self, h: torch.Tensor, *fc2_args: Any) -> Any:
        if not self.recompute:
            return self.fc2(self._activate(h), *fc2_args)
        ckpt = CheckpointWithoutOutput(self.name)
        out = self.fc2(ckpt.checkpoint(self._activate, h), *fc2_args)
        ckpt.discard_output_and_register_recompute(_tensors(out))
        return out


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True) -> torch.Tensor:
    """Softmax attention on ``[b, heads, s, d]`` contiguous q, k, v; returns ``[b, heads, s, d]``.

    Written so that autograd saves q, k and v *themselves* (views of their storage), as flash
    attention does: the scale is applied to the scores, not to q.
    """
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        s = q.shape[-2]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


class MLAUpProjAttention(nn.Module):
    """MLA up-projection -> core attention -> attention projection (``linear_proj``).

    Input: the compressed ``q_c [s, b, q_rank]`` and ``kv_c [s, b, kv_rank]`` (the q_down /
    kv_down outputs, normed). ``q_up`` / ``kv_up`` make q, k, v, laid out ``[b, heads, s, d]``
    inside the recomputed function. With ``recompute`` q, k, v are freed once core attention
    saved them and recomputed when the gradient reaches the attention projection's input.
    """

    def __init__(self, q_rank: int, kv_rank: int, heads: int, head_dim: int, hidden: int, *,
                 recompute: bool = False, params_dtype: torch.dtype | None = None,
                 name: str = "mla_up_proj") -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        kw: dict[str, Any] = {"bias": False, "params_dtype": params_dtype}
        self.q_up = Linear(q_rank, heads * head_dim, **kw)
        self.kv_up = Linear(kv_rank, 2 * heads * head_dim, **kw)
        self.linear_proj = Linear(heads * head_dim, hidden, save_original_input=True, **kw)
        self.recompute = recompute
        self.name = name

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        s, b = t.shape[:2]
        return t.reshape(s, b, self.heads, -1).permute(1, 2, 0, 3).contiguous()

    def up_project(self, q_c: torch.Tensor, kv_c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v as ``[b, heads, s, head_dim]``, each in its own storage."""
        q = self._heads(self.q_up(q_c))
        k, v = self.kv_up(kv_c).chunk(2, dim=-1)
        return q, self._heads(k), self._heads(v)

    def _project(self, ctx: torch.Tensor) -> torch.Tensor:
        b, _, s, _ = ctx.shape
        return self.linear_proj(ctx.permute(2, 0, 1, 3).reshape(s, b, -1))

    def forward(self, q_c: torch.Tensor, kv_c: torch.Tensor) -> torch.Tensor:
        if not self.recompute:
            return self._project(core_attention(*self.up_project(q_c, kv_c)))
        ckpt = CheckpointWithoutOutput(self.name)
        ctx = core_attention(*ckpt.checkpoint(self.up_project, q_c, kv_c))
        ckpt.discard_output_and_register_recompute(ctx)
        return self._project(ctx)
