"""``ColumnComm``: the ``LinearComm`` hooks of a column-parallel linear.

=====================  ===============================  ===================================
mode                   forward (input x)                backward (dgrad dx)
=====================  ===============================  ===================================
no sequence parallel   identity (x is replicated)       all-reduce ``[M, K]``, async
sequence parallel      all-gather ``[M/tp, K] -> [M,    reduce-scatter ``[M, K] ->
                       K]`` (FP8 rowwise when FP8 on)   [M/tp, K]``, async
=====================  ===============================  ===================================

In backward the local input shard (original or columnwise FP8) is gathered again for wgrad;
each collective is launched before the GEMM it overlaps (see ``ops.linear._backward_fp8``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ops.linear import Done, Pending
from ..quant.tensor import Operand
from . import collectives as C


@dataclass(frozen=True)
class ColumnComm:
    """Token-dim hooks over ``group``: with ``sequence_parallel`` gather tokens and always
    reduce-scatter dgrad (dx must come back as the local shard); without it all-reduce dgrad
    iff ``reduce_dgrad_enabled`` (Megatron's ``disable_grad_reduce`` turns it off)."""

    group: dist.ProcessGroup | None
    sequence_parallel: bool
    reduce_dgrad_enabled: bool
    name: str = "ColumnParallelLinear"

    def gather_input(self, x_local: torch.Tensor) -> Pending:
        return C.all_gather_tokens(x_local, self.group) if self.sequence_parallel else Done(x_local)

    def gather_fp8(self, op: Operand, *, columnwise: bool) -> Pending:
        if not self.sequence_parallel:
            return Done(op)
        return C.all_gather_fp8(op, self.group, columnwise=columnwise)

    def reduce_dgrad(self, dx_partial: torch.Tensor) -> Pending:
        if self.sequence_parallel:
            return C.reduce_scatter_tokens(dx_partial, self.group, f"{self.name} dgrad")
        if not self.reduce_dgrad_enabled:
            return Done(dx_partial)
        return C.all_reduce(dx_partial, self.group, inplace=True)  # dx is ours: no copy
