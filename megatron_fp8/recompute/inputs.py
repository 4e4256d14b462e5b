"""The inputs of a recompute: what an autograd function saves of a checkpointed call's arguments,
the arguments rebuilt for the replay, and the backpropagation through the replayed outputs. Both
checkpoints (``core``'s output-discarding one and ``layers``' whole-computation one) use these."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def save_arguments(ctx: Any, args: Sequence[Any]) -> list[torch.Tensor]:
    """Note on ``ctx`` where ``args``' tensors sit and keep the other arguments; the tensors, in
    order, for the caller to save (as they are, or a share of one)."""
    ctx.tensor_idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    ctx.others = {i: a for i, a in enumerate(args) if not isinstance(a, torch.Tensor)}
    return [args[i] for i in ctx.tensor_idx]


def replay_arguments(ctx: Any, tensors: Sequence[torch.Tensor], needs_grad: Sequence[bool]) -> list[Any]:
    """The call's arguments again: ``tensors`` (the saved ones) detached, each needing grad as
    ``needs_grad`` says, in their places among the other arguments."""
    args: list[Any] = [None] * (len(tensors) + len(ctx.others))
    for i, t, needs in zip(ctx.tensor_idx, tensors, needs_grad):
        d = t.detach()
        d.requires_grad_(needs)
        args[i] = d
    for i, v in ctx.others.items():
        args[i] = v
    return args


def backprop(outputs: Sequence[Any], grads: Sequence[torch.Tensor | None], inputs: Sequence[Any]) -> list[Any]:
    """Backpropagate ``grads`` through the replayed ``outputs`` that need them; the gradients of
    ``inputs`` (None for the arguments that are no tensors)."""
    pairs = [(o, g) for o, g in zip(outputs, grads)
             if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return [a.grad if isinstance(a, torch.Tensor) else None for a in inputs]
