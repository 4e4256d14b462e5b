"""Raw tensor-parallel collectives on plain tensors and FP8 operands, sync or async.

Every function returns an ``InFlight`` (an ``ops.linear.Pending``): the collective is already
launched (``async_op=True``), ``wait()`` finishes it and returns the result, so callers can run
a GEMM in between (the overlap of issue 4). FP8 payloads travel as ``uint8`` views (bit-exact;
neither gloo nor every NCCL build has FP8 dtypes). Only "no process group at all" short-circuits
(``Done``): a group of one rank still runs the (trivial) collective, which is how the async
path is tested on one GPU; the last-dim helpers skip work at tp == 1. Names: ``tp`` = group size,
``M`` = tokens (dim 0, the sequence-parallel dim), ``K`` = features.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..ops.linear import Done
from ..quant.formats import FP8_DTYPES, ScaleLayout
from ..quant.tensor import Operand
from .groups import group_size

# torch >= 2.13 names them *_single (the *_tensor names warn); torch 2.11 has only *_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = [
    "InFlight",
    "all_gather_tokens",
    "reduce_scatter_tokens",
    "all_reduce",
    "all_gather_fp8",
    "all_gather_last_dim",
    "split_last_dim",
]

Group = dist.ProcessGroup | None


class InFlight:
    """In-flight collectives plus the function that assembles their result."""

    def __init__(self, works: list[Any], finish: Callable[[], Any]) -> None:
        self._works, self._finish = works, finish

    def wait(self) -> Any:
        for work in self._works:
            work.wait()
        self._works = []
        return self._finish()


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor as sent: FP8 viewed as uint8 (same bytes), contiguous."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def _gather_dim0(t: torch.Tensor, group: Group) -> tuple[Any, torch.Tensor]:
    """Launch an all-gather of ``t [m, ...]`` into ``[tp * m, ...]`` (rank order)."""
    send = _wire(t)
    out = torch.empty((group_size(group) * send.shape[0], *send.shape[1:]), dtype=send.dtype,
                      device=send.device)
    return _all_gather_single(out, send, group=group, async_op=True), out


def all_gather_tokens(x_local: torch.Tensor, group: Group) -> InFlight | Done:
    """All-gather along dim 0 (sequence parallel: the local token shard -> all tokens).

    ===========  =====================  ======================
    tensor       in                     out
    ===========  =====================  ======================
    x_local      ``[M/tp, ...]``        x ``[M, ...]``
    ===========  =====================  ======================
    """
    if group is None:
        return Done(x_local)
    work, out = _gather_dim0(x_local, group)
    return InFlight([work], lambda: out.view(x_local.dtype) if out.dtype != x_local.dtype else out)


def reduce_scatter_tokens(x_partial: torch.Tensor, group: Group, what: str = "tensor") -> InFlight | Done:
    """Sum over the group, each rank keeping its slice of dim 0.

    ===========  =====================  ======================
    tensor       in                     out
    ===========  =====================  ======================
    x_partial    ``[M, ...]`` (partial)  x_local ``[M/tp, ...]``
    ===========  =====================  ======================
    """
    if group is None:
        return Done(x_partial)
    tp = group_size(group)
    if x_partial.shape[0] % tp:
        raise ValueError(
            f"{what}: sequence-parallel reduce-scatter splits dim 0 (the sequence) of shape "
            f"{tuple(x_partial.shape)} over {tp} tensor-parallel ranks; make the sequence length a "
            f"multiple of {tp} (pad it) or turn sequence_parallel off"
        )
    send = x_partial.contiguous()
    out = torch.empty((send.shape[0] // tp, *send.shape[1:]), dtype=send.dtype, device=send.device)
    work = _reduce_scatter_single(out, send, group=group, async_op=True)
    return InFlight([work], lambda: out)


def all_reduce(x_partial: torch.Tensor, group: Group, *, inplace: bool = False) -> InFlight | Done:
    """Sum over the group; into ``x_partial`` itself with ``inplace`` (it must be contiguous),
    else into a new tensor.

    ===========  =====================  ======================
    tensor       in                     out
    ===========  =====================  ======================
    x_partial    ``[...]`` (partial)    x ``[...]`` (summed)
    ===========  =====================  ======================
    """
    if group is None:
        return Done(x_partial)
    out = x_partial if inplace and x_partial.is_contiguous() else x_partial.clone(
        memory_format=torch.contiguous_format)
    work = dist.all_reduce(out, group=group, async_op=True)
    return InFlight([work], lambda: out)


def all_gather_fp8(op: Operand, group: Group, *, columnwise: bool) -> InFlight | Done:
    """All-gather one FP8 copy of a token-sharded tensor along the token dim, with its scales.

    Per-tensor scales (``TENSOR``) are equal on every rank (amax reduced over the group) and are
    not sent; block scales travel with the data. Block scales along the token dim (columnwise
    1x128 / 1x32) are exact when each rank's token count is a multiple of the block.

    ===================  ==========================  ==========================
    operand              in (local)                  out
    ===================  ==========================  ==========================
    rowwise data         x_fp8_row ``[M/tp, K]``     ``[M, K]``
    rowwise scale_inv    ``[M/tp, K/b]``              ``[M, K/b]``
    columnwise data      x_fp8_col ``[K, M/tp]``     ``[K, M]``
    columnwise scale_inv ``[K, M/tp/b]``              ``[K, M/b]``
    ===================  ==========================  ==========================
    """
    if group is None:
        return Done(op)
    tp = group_size(group)
    token_sharded = {ScaleLayout.TENSOR, ScaleLayout.BLOCK_1x128, ScaleLayout.MX_1x32}
    if not columnwise:
        token_sharded.add(ScaleLayout.ROW)  # one scale per token row
    if op.layout not in token_sharded:
        raise ValueError(
            f"all_gather_fp8: {op.layout.value}-scaled {'columnwise' if columnwise else 'rowwise'} "
            f"operands have scale blocks spanning ranks' tokens and cannot be gathered"
        )
    tensors = [op.data] + ([] if op.layout is ScaleLayout.TENSOR else [op.scale_inv])
    if columnwise:  # token dim is dim 1: gather [K, m] blocks as [tp, K, m], then interleave
        launched = [_gather_dim0(t.unsqueeze(0), group) for t in tensors]
    else:
        launched = [_gather_dim0(t, group) for t in tensors]

    def finish() -> Operand:
        outs = []
        for (_, out), t in zip(launched, tensors):
            out = out.view(t.dtype) if out.dtype != t.dtype else out
            if columnwise:
                out = out.permute(1, 0, 2).reshape(t.shape[0], tp * t.shape[1])
            outs.append(out)
        scale_inv = op.scale_inv if op.layout is ScaleLayout.TENSOR else outs[1]
        return Operand(outs[0], scale_inv, op.layout)

    return InFlight([w for w, _ in launched], finish)


def all_gather_last_dim(x_local: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along the last dim (column-parallel ``gather_output``), synchronously.

    ===========  =====================  ======================
    tensor       in                     out
    ===========  =====================  ======================
    y_local      ``[..., N/tp]``        y ``[..., N]``
    ===========  =====================  ======================
    """
    tp = group_size(group)
    if tp == 1:
        return x_local
    x_t = x_local.movedim(-1, 0)
    out = all_gather_tokens(x_t, group).wait()
    return out.movedim(0, -1).contiguous()


def split_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's slice of the last dim (no communication).

    ===========  =====================  ======================
    tensor       in                     out
    ===========  =====================  ======================
    x            ``[..., K]``           x_local ``[..., K/tp]``
    ===========  =====================  ======================
    """
    tp = group_size(group)
    if tp == 1:
        return x
    if x.shape[-1] % tp:
        raise ValueError(f"cannot split last dim of shape {tuple(x.shape)} over {tp} ranks")
    return x.chunk(tp, dim=-1)[dist.get_rank(group)].contiguous()
