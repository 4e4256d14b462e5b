"""Single-device FP8 ``Linear`` (the tensor-parallel layers wrap the same function)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..ops.linear import linear
from .base import FP8Module, default_init


class Linear(FP8Module):
    """``y = x @ weight.T + bias`` with FP8 GEMMs inside ``fp8_autocast``.

    Args:
        save_original_input: save the high-precision input instead of its columnwise FP8 copy
            (RECIPES.md); a plain attribute, settable after construction.
        skip_bias_add: return ``(y, bias)`` and leave the add to the caller (Megatron style).
        fuse_wgrad_accumulation: accumulate wgrad into ``weight.main_grad`` in FP32.
        name: used in error messages (e.g. ``"decoder.layers.3.self_attention.linear_proj"``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method: Callable[[torch.Tensor], None] | None = None,
        save_original_input: bool = False,
        skip_bias_add: bool = False,
        fuse_wgrad_accumulation: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear({in_features}, {out_features}): sizes must be positive")
        self.in_features, self.out_features = in_features, out_features
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        with torch.no_grad():
            (init_method or default_init)(self.weight)
        self.save_original_input = save_original_input
        self.skip_bias_add = skip_bias_add
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.name = name

    def forward(
        self, x: torch.Tensor, is_first_microbatch: bool | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        q = self.fp8_quantizers("weight")
        # (with FP8 off Megatron's flag stays for the first forward that casts the weight)
        w_fp8 = self.fp8_weight("weight", q, self.microbatch_flag(is_first_microbatch)) if q is not None else None
        y = linear(
            x, self.weight, None if self.skip_bias_add else self.bias,
            w_fp8=w_fp8, quantizers=q, save_original_input=self.save_original_input,
            fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
        )
        return (y, self.bias) if self.skip_bias_add else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, save_original_input={self.save_original_input}"
        )
