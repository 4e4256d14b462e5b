"""Activation checkpointing of whole computations (layers, MLPs) with the forward's FP8 environment:
megatron-core's full and module recompute under ``config.fp8`` for our layers.

megatron-core recomputes a layer chunk (``--recompute-granularity full``), a layer's MLP, its MoE
block or shared experts (``--recompute-modules mlp moe shared_experts``) through
``tensor_parallel.checkpoint`` in high precision, but through Transformer Engine's checkpoint
(``te_checkpoint``) whenever ``config.fp8`` is set, because a recompute must run in the FP8 state of
its forward. Without TE that function raises (or is ``None``). ``checkpoint_layers`` is the same
contract for our layers, in plain PyTorch:

- forward runs ``fn(*args)`` without a graph and saves only ``args`` (with
  ``distribute_saved_activations``, the first one split across the tensor-parallel group and
  gathered again for backward; as in Megatron's checkpoint, a first argument that is no view is
  shrunk *in place* to this rank's share until backward, so its memory is freed even where the
  caller keeps the tensor, as a pipeline schedule keeps a stage's input);
- backward re-runs ``fn`` on them with the forward's RNG states (CPU, CUDA, Megatron's CUDA RNG
  tracker), FP8 region, torch autocast and, for delayed scaling, the scales the forward cast
  with (no amax recorded, no history rolled: ``replay._Environment``, as the output-discarding
  recompute uses), then backpropagates through it.

So the recompute casts what the forward cast, bit for bit, and the step's gradients are those of
the model without recompute (tests/dist_workers/plugin_worker.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .guard import recording_modules
from .inputs import backprop, replay_arguments, save_arguments
from .replay import _Environment

__all__ = ["checkpoint_layers"]


def _tp_share(x: torch.Tensor, group: Any, in_place: bool) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """This rank's equal 1-D share of ``x`` across ``group`` and ``x``'s shape (None where there
    is nothing to split). ``in_place``: ``x`` itself is shrunk to the share (and returned), as
    megatron-core's checkpoint does, so its full storage is freed even where the caller still holds
    the tensor (a pipeline stage's input, kept by the schedule); else the share is a copy."""
    if group is None or not dist.is_initialized():
        return None
    size = dist.get_world_size(group)
    if size == 1 or x.numel() % size:
        return None
    share = x.numel() // size
    rank = dist.get_rank(group)
    shape = tuple(x.shape)
    part = x.detach().reshape(-1)[rank * share:(rank + 1) * share].clone()
    if not in_place:
        return part, shape
    x.data = part
    return x, shape


def _tp_gather(share: torch.Tensor, shape: tuple[int, ...], group: Any) -> torch.Tensor:
    parts = [torch.empty_like(share) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, share.contiguous(), group=group)
    return torch.cat(parts).view(shape)


class _LayerCheckpoint(torch.autograd.Function):
    """``fn(*args)`` without a graph; backward replays it in the forward's environment."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], tp_group: Any, anchor: torch.Tensor | None,  # type: ignore[override]
                *args: Any) -> Any:
        ctx.fn, ctx.group = fn, tp_group
        ctx.env = _Environment.capture(args)
        with recording_modules() as modules, torch.no_grad():
            outputs = fn(*args)
        ctx.env.record_delayed_scales(modules)
        # a tensor ``fn`` hands back as it is (a layer's bias with skip_bias_add) leaves as an alias:
        # autograd would otherwise make the parameter itself an output of this function
        outputs = _alias_leaves(outputs, args)
        saved = save_arguments(ctx, args)
        ctx.needs_grad = [t.requires_grad for t in saved]
        ctx.split = None
        if tp_group is not None and saved and not any(saved[0] is t for t in saved[1:]):
            # shrunk in place unless a view (its base stays alive anyway) or handed back as an output
            returned = outputs if isinstance(outputs, tuple) else (outputs,)
            in_place = saved[0]._base is None and not any(saved[0] is o for o in returned)
            shared = _tp_share(saved[0], tp_group, in_place)
            if shared is not None:
                saved[0], shape = shared
                ctx.split = (shape, in_place)
        ctx.save_for_backward(*saved)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("megatron_fp8 checkpoint_layers: the recompute needs .backward(); "
                               "torch.autograd.grad would put the parameters' gradients in their .grad")
        saved = list(ctx.saved_tensors)
        if ctx.split is not None:
            shape, in_place = ctx.split
            full = _tp_gather(saved[0], shape, ctx.group)
            if in_place:  # the caller's tensor whole again (its gradient, a pipeline schedule's reads)
                saved[0].data = full
            saved[0] = full
        args = replay_arguments(ctx, saved, ctx.needs_grad)
        with ctx.env.replay(), torch.enable_grad():
            outputs = ctx.fn(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return (None, None, None, *backprop(outputs, grads, args))


def _alias_leaves(outputs: Any, args: tuple[Any, ...]) -> Any:
    """``outputs`` with every tensor that requires grad and is none of ``args`` (under no_grad:
    a leaf such as a parameter, handed back as it is) replaced by a detached alias."""
    inputs = {id(a) for a in args if isinstance(a, torch.Tensor)}

    def alias(o: Any) -> Any:
        return o.detach() if isinstance(o, torch.Tensor) and o.requires_grad and id(o) not in inputs else o

    return tuple(alias(o) for o in outputs) if isinstance(outputs, tuple) else alias(outputs)


def checkpoint_layers(fn: Callable[..., Any], *args: Any, distribute_saved_activations: bool = False,
                      tp_group: Any = None) -> Any:
    """``fn(*args)``, keeping only ``args`` for backward, where ``fn`` is re-run in the forward's
    RNG, FP8 and autocast state (module docstring). ``distribute_saved_activations``: save only
    this rank's share of the first tensor argument across ``tp_group``; as with megatron-core's
    checkpoint, that argument (unless it is a view, or ``fn`` returns it) holds only the share from
    this call until backward, so the caller must not read it in between. Under ``no_grad`` it is a plain call."""
    if not torch.is_grad_enabled():
        return fn(*args)
    # no input needing grad (e.g. a frozen embedding's output): an anchor makes the outputs need it,
    # so backward reaches the recompute and ``fn``'s parameters get their gradients
    needs = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    anchor = None if needs else torch.empty(0, requires_grad=True)
    return _LayerCheckpoint.apply(fn, tp_group if distribute_saved_activations else None, anchor, *args)
