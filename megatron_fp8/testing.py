"""Small reference modules shared by tests, examples and benchmarks."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class _FlashLikeAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d)) v that saves q, k, v, its *output* and the log-sum-exp, as
    flash attention does: the attention output is kept alive for attention's own backward."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        out = (torch.exp(s - lse) @ v.float()).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, out, lse = ctx.saved_tensors
        scale = 1 / math.sqrt(q.shape[-1])
        p = torch.exp((q.float() @ k.float().transpose(-1, -2)) * scale - lse)
        dv = p.transpose(-1, -2) @ dout.float()
        dp = dout.float() @ v.float().transpose(-1, -2)
        delta = (dout.float() * out.float()).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq, dk = ds @ k.float(), ds.transpose(-1, -2) @ q.float()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class AttentionCore(nn.Module):
    """Single-head core attention over ``[tokens, hidden]`` (q = k = v = input, for brevity),
    saving its output like flash attention; the output is what a projection layer consumes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FlashLikeAttention.apply(x, x, x)
