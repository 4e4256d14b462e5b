"""``ParallelConfig``: the fields of Megatron's ``TransformerConfig`` the parallel layers read,
for users without megatron-core (with it, pass its ``TransformerConfig`` instead)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ParallelConfig"]


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    gradient_accumulation_fusion: bool = False
    use_cpu_initialization: bool = False
    perform_initialization: bool = True
    expert_model_parallel_size: int = 1
