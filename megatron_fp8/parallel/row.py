"""``RowParallelLinear``: weight split along its input dim; Megatron-core's signature.

===================  ======================================  ====================================
tensor (per rank)    no sequence parallel                    sequence parallel
===================  ======================================  ====================================
input x              ``[s, b, K/tp]`` (``input_is_parallel``; ``[s, b, K/tp]``
                     else ``[s, b, K]``, split here)
weight               ``[N, K/tp]``                           ``[N, K/tp]``
output y             ``[s, b, N]``                           ``[s/tp, b, N]``
forward comm         all-reduce y                            reduce-scatter y along s
backward comm        none                                    all-gather dy along s
===================  ======================================  ====================================

The bias is not split; with SP its gradient is the local tokens' part and the bias carries
``sequence_parallel=True`` so Megatron's grad finalisation all-reduces it over TP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..ops.linear import linear
from .base import ParallelLinearBase
from .checks import check_sequence_parallel_input, divide
from .mappings import reduce_from_region, reduce_scatter_to_sequence, scatter_to_region

__all__ = ["RowParallelLinear"]


class RowParallelLinear(ParallelLinearBase):
    """``Y = X W^T + b`` with ``W [N, K]`` split along K over the TP group (FP8 inside
    ``fp8_autocast``). Arguments as Megatron-core's ``RowParallelLinear``; in addition
    ``save_original_input``, ``pg_collection`` and ``name``. ``forward`` returns
    ``(output, bias or None)``."""

    partition_dim = 1

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Callable[[torch.Tensor], object] | None = None,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
        pg_collection: Any | None = None,
        name: str | None = None,
        save_original_input: bool = False,
    ) -> None:
        super().__init__()
        self._setup(input_size, output_size, config=config, is_expert=is_expert, tp_group=tp_group,
                    pg_collection=pg_collection, name=name)
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError(f"{self._owner}: sequence_parallel needs input_is_parallel=True (the input "
                             f"of a row-parallel layer under SP is already split by the column layer)")
        self.input_size_per_partition = divide(input_size, self.tp_size, self._owner, "input_size")
        divide(output_size, 1, self._owner, "output_size")
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.save_original_input, self.tp_comm_buffer_name, self.stride = (
            save_original_input, tp_comm_buffer_name, stride)
        self.weight = self._new_weight((output_size, self.input_size_per_partition), init_method, stride,
                                       keep_master_weight_for_test)
        if bias:
            self.bias = self._new_bias(output_size, self.weight.device)
            self.bias.sequence_parallel = self.config_sequence_parallel  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        if self.explicit_expert_comm and not skip_bias_add and bias:
            raise ValueError(f"{self._owner}: an expert row-parallel layer with a bias needs "
                             f"skip_bias_add=True (the dispatcher adds it after combining tokens)")

    def forward(
        self, input_: torch.Tensor, *, is_first_microbatch: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_`` ``[s, b, K/tp]`` -> ``(output [s, b, N] (``[s/tp, b, N]`` with SP), bias or None)``."""
        if self.input_is_parallel:
            self._check_features(input_, self.input_size_per_partition,
                                 "input_is_parallel=True: pass this rank's [.., input_size/TP] slice")
            x_local = input_
        else:
            self._check_features(input_, self.input_size, "input_is_parallel=False: pass the full input")
            x_local = scatter_to_region(input_, self.tp_group)
        if self.sequence_parallel and not self.explicit_expert_comm:
            check_sequence_parallel_input(x_local, self.tp_size, self._owner)
        q, w_fp8 = self._fp8_operands(self.weight, is_first_microbatch)
        y_partial = linear(x_local, self.weight, None, w_fp8=w_fp8, quantizers=q,
                           save_original_input=self.save_original_input,
                           fuse_wgrad_accumulation=self.gradient_accumulation_fusion)
        if self.explicit_expert_comm or self.tp_size == 1:
            y = y_partial
        elif self.sequence_parallel:
            y = reduce_scatter_to_sequence(y_partial, self.tp_group, self._owner)
        else:
            y = reduce_from_region(y_partial, self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return y, self.bias if self.skip_bias_add else None
        return y + self.bias, None

