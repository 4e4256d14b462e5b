"""MoE pieces on the FP8 layers: the grouped expert MLP, shared experts, a top-k router, and a
single-device MoE layer in which the router and the shared experts read one layernorm output.

==========================  ==================================================================
module                      what it is
==========================  ==================================================================
``GroupedMLP``              local experts' fc1 -> activation -> fc2 on ``GroupedLinear``
                            (or the expert-TP grouped layers); Megatron's
                            ``forward(permuted_tokens, tokens_per_expert) -> (output, bias)``
``SharedExpertMLP``         a dense fc1 -> activation -> fc2 on ``megatron_fp8.Linear``, run on
                            every token; ``save_original_input`` = its fc1's flag
``TopKRouter``              logits ``h @ W_r.T`` -> softmax -> top-k (saves ``h`` itself)
``MoELayer``                pre-MLP norm -> (routed experts, shared experts) via
                            ``blocks.NormProjections``; output = routed + shared
==========================  ==================================================================

The memory point (issue 5): the router saves the layernorm output ``h`` for its own backward,
so the shared experts' fc1 with ``save_original_input=True`` aliases that storage and saves no
columnwise FP8 copy of ``h``. With ``recompute_norm`` ``h`` itself is discarded and recomputed
(``megatron_fp8.recompute``), which needs the flag on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import ActivationFC2, NormProjections, make_norm, swiglu
from .modules.grouped import GroupedLinear
from .modules.linear import Linear

__all__ = [
    "ACTIVATIONS",
    "GroupedMLP",
    "SharedExpertMLP",
    "TopKRouter",
    "MoELayer",
    "num_local_experts",
    "permute",
    "unpermute",
]


def _gelu(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h, approximate="tanh")


# name -> (activation, fc1 output width as a multiple of ffn_hidden_size)
ACTIVATIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
    "swiglu": (swiglu, 2),
    "gelu": (_gelu, 1),
}


def _activation(name: str, owner: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    if name not in ACTIVATIONS:
        raise ValueError(f"{owner}: activation={name!r}; choose one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def num_local_experts(num_experts: int, expert_parallel_size: int, owner: str = "MoE") -> int:
    """Experts per expert-parallel rank, or a ValueError naming the layer and the fix."""
    if num_experts <= 0 or expert_parallel_size <= 0:
        raise ValueError(f"{owner}: num_experts={num_experts} and expert_parallel_size={expert_parallel_size} "
                         f"must be positive")
    if num_experts % expert_parallel_size:
        raise ValueError(
            f"{owner}: num_experts={num_experts} is not divisible by the expert-parallel size "
            f"{expert_parallel_size}; choose a number of experts that is a multiple of it (or change "
            f"expert_model_parallel_size)"
        )
    return num_experts // expert_parallel_size


def _first(out: Any) -> torch.Tensor:
    """A layer's output tensor: Megatron-style layers return ``(output, bias)``."""
    return out[0] if isinstance(out, tuple) else out


class _Fc2Adapter(nn.Module):
    """fc2 as ``ActivationFC2`` calls it; exposes the wrapped layer's ``save_original_input``."""

    def __init__(self, fc2: nn.Module) -> None:
        super().__init__()
        self.layer = fc2

    @property
    def save_original_input(self) -> bool:
        return bool(getattr(self.layer, "save_original_input", False))

    def forward(self, h: torch.Tensor, *args: Any) -> torch.Tensor:
        return _first(self.layer(h, *args))


class GroupedMLP(nn.Module):
    """The local experts' MLP: ``fc2(act(fc1(x)))`` per expert over back-to-back token groups.

    ``num_experts`` is the global count; ``expert_parallel_size`` ranks hold
    ``num_experts / expert_parallel_size`` each (must divide). ``linear_fc1`` / ``linear_fc2``:
    prebuilt grouped layers (e.g. the expert-TP ``ColumnParallelGroupedLinear`` /
    ``RowParallelGroupedLinear``); by default single-device ``GroupedLinear``s.
    ``recompute_activation``: discard the activation output and recompute it in backward (needs
    ``save_original_input`` on fc2; set here when building fc2).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str = "swiglu",
        bias: bool = False,
        expert_parallel_size: int = 1,
        params_dtype: torch.dtype | None = None,
        recompute_activation: bool = False,
        linear_fc1: nn.Module | None = None,
        linear_fc2: nn.Module | None = None,
        name: str = "experts",
    ) -> None:
        super().__init__()
        self._owner = f"{type(self).__name__}({name})"
        self.num_local_experts = num_local_experts(num_experts, expert_parallel_size, self._owner)
        act, width = _activation(activation, self._owner)
        n, kw = self.num_local_experts, {"bias": bias, "params_dtype": params_dtype}
        self.linear_fc1 = linear_fc1 or GroupedLinear(n, hidden_size, width * ffn_hidden_size,
                                                      name=f"{name}.linear_fc1", **kw)
        self.linear_fc2 = linear_fc2 or GroupedLinear(n, ffn_hidden_size, hidden_size,
                                                      save_original_input=recompute_activation,
                                                      name=f"{name}.linear_fc2", **kw)
        self.act_fc2 = ActivationFC2(_Fc2Adapter(self.linear_fc2), activation=act,
                                     recompute=recompute_activation, name=f"{name}.activation")

    def forward(
        self, permuted_tokens: torch.Tensor, tokens_per_expert: Sequence[int] | torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """``permuted_tokens [T, hidden]`` grouped by local expert, ``tokens_per_expert [E_local]``
        -> ``(output [T, hidden], None)`` (biases, if any, are added inside)."""
        if isinstance(tokens_per_expert, torch.Tensor):
            tokens_per_expert = tokens_per_expert.tolist()
        h = _first(self.linear_fc1(permuted_tokens, tokens_per_expert))
        return self.act_fc2(h, tokens_per_expert), None


class SharedExpertMLP(nn.Module):
    """Dense ``fc2(act(fc1(h)))`` over every token (Megatron's shared experts), on FP8 ``Linear``.

    ``save_original_input`` is fc1's flag: turn it on when another module (the router) keeps the
    input ``h`` alive anyway. fc2's input (the activation output) is saved as its FP8 copy.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str = "swiglu",
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        save_original_input: bool = False,
    ) -> None:
        super().__init__()
        self.activation, width = _activation(activation, type(self).__name__)
        kw = {"bias": bias, "params_dtype": params_dtype}
        self.linear_fc1 = Linear(hidden_size, width * ffn_hidden_size, save_original_input=save_original_input, **kw)
        self.linear_fc2 = Linear(ffn_hidden_size, hidden_size, **kw)

    @property
    def save_original_input(self) -> bool:
        return self.linear_fc1.save_original_input

    @save_original_input.setter
    def save_original_input(self, value: bool) -> None:
        self.linear_fc1.save_original_input = value

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation(self.linear_fc1(h)))


class TopKRouter(nn.Module):
    """``softmax(h @ weight.T)`` over experts, top-k per token (probabilities renormalised over
    the k chosen). The logits GEMM is high precision and saves ``h`` itself for backward."""

    def __init__(self, hidden_size: int, num_experts: int, topk: int, *,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not 1 <= topk <= num_experts:
            raise ValueError(f"TopKRouter: topk={topk} must be in [1, num_experts={num_experts}]")
        self.topk = topk
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=params_dtype))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h [T, hidden]`` -> ``(probs [T, k] (h's dtype), expert ids [T, k])``."""
        logits = F.linear(h, self.weight.to(h.dtype))
        probs, ids = torch.topk(torch.softmax(logits.float(), dim=-1), self.topk, dim=-1)
        return (probs / probs.sum(-1, keepdim=True)).to(h.dtype), ids


def permute(h: torch.Tensor, ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Group token copies by expert: ``(permuted [T*k, hidden], order [T*k], tokens_per_expert)``
    where ``order[j]`` is the flat (token, slot) index of row ``j`` (stable within an expert)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return h.index_select(0, order // ids.shape[1]), order, counts


def unpermute(out: torch.Tensor, order: torch.Tensor, probs: torch.Tensor, tokens: int) -> torch.Tensor:
    """Weight each expert output by its routing probability and sum back per token."""
    weighted = out * probs.reshape(-1).index_select(0, order).unsqueeze(-1).to(out.dtype)
    combined = torch.zeros(tokens, out.shape[-1], dtype=out.dtype, device=out.device)
    return combined.index_add(0, order // probs.shape[1], weighted)


class RoutedExperts(nn.Module):
    """Router -> permute -> ``GroupedMLP`` -> unpermute, over ``h [T, hidden]`` (one device)."""

    def __init__(self, router: TopKRouter, experts: GroupedMLP) -> None:
        super().__init__()
        self.router, self.experts = router, experts

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs, ids = self.router(h)
        permuted, order, counts = permute(h, ids, self.experts.num_local_experts)
        out, _ = self.experts(permuted, counts)
        return unpermute(out, order, probs, h.shape[0])


class MoELayer(nn.Module):
    """The MoE MLP of a transformer layer (no residual): ``routed(norm(x)) + shared(norm(x))``.

    ``shared_save_original_input``: the shared experts' fc1 flag (default on: the router keeps
    ``norm(x)`` alive). ``recompute_norm``: discard and recompute ``norm(x)`` (needs the flag).
    Returns ``(output, None)`` with the input's shape.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        *,
        topk: int = 2,
        shared_ffn_hidden_size: int | None = None,
        activation: str = "swiglu",
        norm: str = "layernorm",
        params_dtype: torch.dtype | None = None,
        shared_save_original_input: bool = True,
        recompute_norm: bool = False,
        recompute_activation: bool = False,
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"activation": activation, "params_dtype": params_dtype}
        routed = RoutedExperts(
            TopKRouter(hidden_size, num_experts, topk, params_dtype=params_dtype),
            GroupedMLP(num_experts, hidden_size, ffn_hidden_size, recompute_activation=recompute_activation, **kw),
        )
        projections: list[nn.Module] = [routed]
        if shared_ffn_hidden_size:
            projections.append(SharedExpertMLP(hidden_size, shared_ffn_hidden_size,
                                               save_original_input=shared_save_original_input, **kw))
        self.norm_mlp = NormProjections(make_norm(norm, hidden_size, dtype=params_dtype), projections,
                                        recompute=recompute_norm, name="pre_mlp_layernorm")

    @property
    def router(self) -> TopKRouter:
        return self.norm_mlp.projections[0].router

    @property
    def experts(self) -> GroupedMLP:
        return self.norm_mlp.projections[0].experts

    @property
    def shared_experts(self) -> SharedExpertMLP | None:
        p = self.norm_mlp.projections
        return p[1] if len(p) > 1 else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        outs = self.norm_mlp(x.reshape(-1, x.shape[-1]))
        y = outs[0] if len(outs) == 1 else outs[0] + outs[1]
        return y.reshape(x.shape), None
