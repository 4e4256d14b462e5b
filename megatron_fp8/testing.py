"""Small reference modules and helpers shared by tests, examples and benchmarks."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s


class _FlashLikeAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d)) v over ``[..., s, d]`` that saves q, k, v, its *output* and the
    log-sum-exp, as flash attention does: the output stays alive for attention's own backward."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:  # type: ignore[override]
        qm, km, vm = (t.movedim(0, -2) for t in (q, k, v))  # [s, *batch, d] -> [*batch, s, d]
        s = _scores(qm, km, causal)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        out = (torch.exp(s - lse) @ vm.float()).to(q.dtype).movedim(-2, 0).contiguous()
        ctx.causal = causal
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = (t.movedim(0, -2) if t.dim() > 1 and i < 4 else t
                             for i, t in enumerate(ctx.saved_tensors))
        dout = dout.movedim(0, -2)
        scale = 1 / math.sqrt(q.shape[-1])
        p = torch.exp(_scores(q, k, ctx.causal) - lse)
        dv = p.transpose(-1, -2) @ dout.float()
        dp = dout.float() @ v.float().transpose(-1, -2)
        delta = (dout.float() * out.float()).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq, dk = ds @ k.float(), ds.transpose(-1, -2) @ q.float()
        return (*(g.to(t.dtype).movedim(-2, 0) for g, t in ((dq, q), (dk, k), (dv, v))), None)


def flash_like_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Attention over ``[s, *batch, d]`` (sequence first, Megatron's layout) returning a contiguous
    ``[s, *batch, d]`` output that it keeps for backward, as flash attention does: a projection
    reading ``out.view(s, b, heads * d)`` then aliases the attention's saved tensor."""
    return _FlashLikeAttention.apply(q, k, v, causal)


class AttentionCore(nn.Module):
    """Single-head core attention over ``[tokens, hidden]`` (q = k = v = input, for brevity),
    saving its output like flash attention; the output is what a projection layer consumes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return flash_like_attention(x, x, x)


T = TypeVar("T")


def capture_step(step: Callable[[], T], warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture a whole training step (forward, backward) in one CUDA graph, as in PyTorch's
    whole-network capture recipe: ``warmup`` eager calls on a side stream under the capture's
    settings (``ops.graphed.as_captured``: Triton compiles, the CUDA casts build, caches fill;
    tests/test_cuda_graph_gpu.py passed with it on the H100, docs/benchmarks.md run AI), then one
    captured call. Returns the graph and the captured call's result (its tensors, like the inputs'
    ``.grad``, are the graph's static outputs: each ``replay()`` rewrites them). Inputs must be
    static tensors the caller refills with ``copy_``, and the caller keeps ``step``'s tensors (its
    module's parameters, its inputs) alive as long as it replays the graph: the graph reads their
    memory, and freed memory is handed to other tensors, or returned to the driver when the next
    ``torch.cuda.graph`` capture begins (a replay then reads and writes others' memory, or faults)."""
    from .ops.graphed import as_captured

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with as_captured(), torch.cuda.stream(side):  # the warm-ups launch what the capture will
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, flat, on the CPU: ``torch.equal`` of two of these compares tensors of any
    dtype bit for bit (NaNs and signed zeros included)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def same_bits(one: Sequence[torch.Tensor | None], two: Sequence[torch.Tensor | None]) -> bool:
    """Whether two equally long sequences hold tensors of the same shapes and bytes, and None in
    the same places (a cast's outputs against another path's)."""
    return all((a is None and b is None)
               or (a is not None and b is not None and a.shape == b.shape and torch.equal(bits(a), bits(b)))
               for a, b in zip(one, two, strict=True))


def router_splits(rows: int, experts: int, topk: int, hidden: int = 256, seed: int = 7) -> list[int]:
    """``rows`` expert rows split as a top-k router hands them out (softmax over a random
    projection of ``rows // topk`` random tokens, top ``topk``; a remainder goes to the last
    expert): uneven, rarely a multiple of 16 or 128, as a real MoE step sees them (benchmarks
    and tests of the grouped layers)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows // topk, hidden, generator=g) @ torch.randn(hidden, experts, generator=g)
    chosen = logits.softmax(-1).topk(topk, dim=-1).indices
    splits = torch.bincount(chosen.flatten(), minlength=experts).tolist()
    splits[-1] += rows - sum(splits)
    return splits
