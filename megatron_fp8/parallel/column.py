"""``ColumnParallelLinear``: weight split along its output dim; Megatron-core's signature.

===================  ======================================  ====================================
tensor (per rank)    no sequence parallel                    sequence parallel
===================  ======================================  ====================================
input x              ``[s, b, K]`` (replicated)              ``[s/tp, b, K]`` (local tokens)
weight               ``[N/tp, K]``                           ``[N/tp, K]``
output y             ``[s, b, N/tp]`` (``[s, b, N]`` with     ``[s, b, N/tp]``
                     ``gather_output``)
forward comm         none                                    all-gather x (FP8 rowwise with FP8)
backward comm        all-reduce dx (async, behind wgrad)     reduce-scatter dx (async), x gathered
                                                             again for wgrad (behind dgrad)
===================  ======================================  ====================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..ops.linear import linear
from .base import ParallelLinearBase, init_device
from .checks import divide, same_on_all_ranks
from .comm import ColumnComm
from .init import set_tp_attributes
from .mappings import gather_from_region

__all__ = ["ColumnParallelLinear"]


class ColumnParallelLinear(ParallelLinearBase):
    """``Y = X W^T + b`` with ``W [N, K]`` split along N over the TP group (FP8 inside
    ``fp8_autocast``). Arguments as Megatron-core's ``ColumnParallelLinear``; in addition
    ``save_original_input`` (RECIPES.md; with SP the *local* input shard is saved),
    ``pg_collection`` and ``name``. ``forward`` returns ``(output, bias or None)``."""

    partition_dim = 0

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Callable[[torch.Tensor], object] | None = None,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: list[torch.Tensor] | None = None,
        grad_output_buffer: list[torch.Tensor] | None = None,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        disable_grad_reduce: bool = False,
        tp_group: dist.ProcessGroup | None = None,
        pg_collection: Any | None = None,
        name: str | None = None,
        save_original_input: bool = False,
    ) -> None:
        super().__init__()
        self._setup(input_size, output_size, config=config, is_expert=is_expert, tp_group=tp_group,
                    pg_collection=pg_collection, name=name)
        self.output_size_per_partition = divide(output_size, self.tp_size, self._owner, "output_size")
        divide(input_size, 1, self._owner, "input_size")
        self.stride = stride
        if self.output_size_per_partition % stride:
            raise ValueError(f"{self._owner}: output_size per partition {self.output_size_per_partition} "
                             f"is not divisible by stride={stride}")
        self.gather_output = gather_output
        self._check_gather(gather_output, "gather_output")
        self.skip_bias_add, self.save_original_input = skip_bias_add, save_original_input
        self.disable_grad_reduce, self.tp_comm_buffer_name = disable_grad_reduce, tp_comm_buffer_name
        self.embedding_activation_buffer, self.grad_output_buffer = embedding_activation_buffer, grad_output_buffer
        shape = (self.output_size_per_partition, input_size)
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
            device = init_device(config)
        else:
            self.weight = self._new_weight(shape, init_method, stride, keep_master_weight_for_test)
            device = self.weight.device
        if bias:
            self.bias = self._new_bias(self.output_size_per_partition, device)
            set_tp_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)
        if self.explicit_expert_comm:  # the MoE token dispatcher does the communication
            self.sequence_parallel = False
        self.allreduce_dgrad = (self.tp_size > 1 and not self.sequence_parallel and not disable_grad_reduce
                                and not self.explicit_expert_comm)
        self._comm = (ColumnComm(self.tp_group, self.sequence_parallel, self.allreduce_dgrad, self._owner)
                      if self.sequence_parallel or self.allreduce_dgrad else None)
        self._sp_checked = -1  # the local sequence length last checked equal on every rank

    def _check_gather(self, gather: bool, what: str) -> None:
        if not gather:
            return
        if self.stride > 1:
            raise ValueError(
                f"{self._owner}: {what}=True with stride={self.stride}: the gathered output would "
                f"have its columns in strided (interleaved) order; gather outside the layer or use stride=1")
        if self.is_expert:
            raise ValueError(f"{self._owner}: {what}=True on an expert layer: expert outputs are "
                             f"returned to the token dispatcher, not gathered; set {what}=False")

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
        *,
        is_first_microbatch: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_`` ``[s, b, K]`` (``[s/tp, b, K]`` with SP) -> ``(output, bias or None)``."""
        weight = self._resolve_weight(weight)
        self._check_features(input_, self.input_size, "the column-parallel input is the full hidden size")
        if self.sequence_parallel and input_.dim() < 2:
            raise ValueError(f"{self._owner}: sequence parallelism needs an input [sequence, ..., hidden], "
                             f"got shape {tuple(input_.shape)}")
        if self.sequence_parallel and input_.shape[0] != self._sp_checked:  # the first call, and each new length
            same_on_all_ranks(f"{input_.shape[0]} local tokens", self.tp_group, input_.device, self._owner,
                              "sequence-parallel", "each rank must hold an equal shard of the sequence (dim 0); "
                              "pad the sequence to a multiple of the tensor-parallel size")
            self._sp_checked = input_.shape[0]
        q, w_fp8 = self._fp8_operands(weight, is_first_microbatch)
        y = linear(
            input_, weight, None if self.skip_bias_add else self.bias, w_fp8=w_fp8, quantizers=q,
            save_original_input=self.save_original_input,
            fuse_wgrad_accumulation=self.gradient_accumulation_fusion, comm=self._comm,
        )
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            self._check_gather(True, "runtime_gather_output")
            y = gather_from_region(y, self.tp_group)
        return y, (self.bias if self.skip_bias_add else None)

    def _resolve_weight(self, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is None:
            if self.weight is None:
                raise RuntimeError(f"{self._owner}: skip_weight_param_allocation=True, so pass weight= "
                                   f"to forward (shape {(self.output_size_per_partition, self.input_size)})")
            return self.weight
        expected = (self.output_size_per_partition, self.input_size)
        if tuple(weight.shape) != expected:
            raise RuntimeError(f"{self._owner}: supplied weight has shape {tuple(weight.shape)}, "
                               f"expected {expected} (this rank's shard)")
        return weight

