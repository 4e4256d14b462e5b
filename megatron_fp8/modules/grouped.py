"""Single-device FP8 ``GroupedLinear``: the local experts' linears run as one grouped call.

Parameters are ``weight0..weight{n-1}`` (and ``bias0..``), as Megatron and Transformer Engine
name them, so checkpoints map. Each expert has its own quantizers (``FP8Module`` key
``weight{i}``), so delayed-scaling histories and per-tensor scales are per expert, exactly as in
a list of separate ``Linear`` layers (see ``ops.grouped_linear``). The weights are views of one
``[num_gemms, N, K]`` buffer (``pack_weights``), so every expert's weight is cast in one launch
where the recipe allows (current scaling, 128x128 blocks on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..gemm_grouped import packed, stacked
from ..ops.grouped_linear import grouped_linear
from ..ops.lean_grouped import lean_weights
from ..ops.linear import LinearQuantizers, mark_tensors_param_derived, weight_row_padding
from ..quant.quantizers import Segments
from ..quant.tensor import QuantizedTensor
from .base import FP8Module, default_init

__all__ = ["GroupedLinear"]

_ALL = "weights"  # the weight cache's key for every expert's weight cast in one launch



class ExpertParams:
    """``weight0..weight{n-1}`` / ``bias0..`` as lists (mixin of the grouped layers)."""

    num_gemms: int
    use_bias: bool

    @property
    def weights(self) -> list[torch.Tensor]:
        # the registered Parameters straight from their dict (``nn.Module.__getattr__``'s fallback
        # costs ~1 us of host time per name, and a step asks for every expert's weight ~3 times)
        params = self._parameters  # type: ignore[attr-defined]
        names = [f"weight{i}" for i in range(self.num_gemms)]
        return [params[n] if n in params else getattr(self, n) for n in names]

    @property
    def biases(self) -> list[torch.Tensor] | None:
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else None

    def pack_weights(self) -> None:
        """Move ``weight0..`` into one ``[num_gemms, N, K]`` buffer (each Parameter a view of
        it, same objects and attributes): the experts' weights can then be cast in one launch
        with no copy. Called at construction; ``.to()`` / DDP re-allocation undo it, which
        only costs a stacking copy per cast."""
        ws = self.weights
        with torch.no_grad():
            buf = torch.stack(ws)
            for i, w in enumerate(ws):
                w.data = buf[i]

    def _stacked_weights(self) -> torch.Tensor:
        """All experts' weights as one ``[num_gemms * N, K]`` tensor: a view when they lie back
        to back in one buffer (``pack_weights``), else a copy."""
        ws = self.weights
        if packed(ws):
            return stacked(ws[0], len(ws)).flatten(0, 1)
        return torch.cat([w.detach() for w in ws])

    def _fp8_weights(self, qs: list[LinearQuantizers], is_first_microbatch: bool | None
                     ) -> list[QuantizedTensor] | Segments:
        """Every expert's FP8 weight: cached, or cast in one launch where the recipe's quantizer
        can (current scaling, 128x128 blocks on CUDA), kept as that cast's packs (``Segments``:
        no per-expert objects are made), else expert by expert."""
        cache: dict[str, QuantizedTensor | Segments] = self._w_cache  # type: ignore[attr-defined]
        keys = [f"weight{i}" for i in range(self.num_gemms)]
        if is_first_microbatch is False:
            if _ALL in cache:
                return cache[_ALL]  # type: ignore[return-value]
            if all(k in cache for k in keys):
                return [cache[k] for k in keys]  # type: ignore[misc]
        q0, w0 = qs[0].weight, self.weights[0]
        seg = None
        if self.num_gemms > 1 and not weight_row_padding(q0, w0.shape[0]) and q0.casts_segments(w0):
            with torch.no_grad():
                stacked = self._stacked_weights()
                seg = lean_weights(stacked, qs)  # (the same cast, its checks made once)
                if seg is None:
                    seg = q0.quantize_segments_packed(stacked, [w0.shape[0]] * self.num_gemms,
                                                      peers=[q.weight for q in qs], rowwise=True, columnwise=True)
        if seg is None or seg.rows is None or seg.cols is None:
            return [self.fp8_weight(k, q, is_first_microbatch)  # type: ignore[attr-defined]
                    for k, q in zip(keys, qs)]
        mark_tensors_param_derived(seg.tensors())
        return self._cache_fp8_weight(_ALL, seg, is_first_microbatch)  # type: ignore[attr-defined]

    def fp8_operands(
        self, is_first_microbatch: bool | None
    ) -> tuple[list[LinearQuantizers] | None, list[QuantizedTensor] | Segments | None]:
        """Per-expert quantizers and FP8 weights under the active recipe, or ``(None, None)``."""
        qs = [self.fp8_quantizers(f"weight{i}") for i in range(self.num_gemms)]  # type: ignore[attr-defined]
        if qs[0] is None:  # (Megatron's flag stays for the first forward that casts the weights)
            return None, None
        is_first_microbatch = self.microbatch_flag(is_first_microbatch)  # type: ignore[attr-defined]
        for q in qs:
            self._prepare_quantizers(q)
        return qs, self._fp8_weights(qs, is_first_microbatch)  # type: ignore[arg-type]

    def _prepare_quantizers(self, q: LinearQuantizers) -> None:
        """Hook for parallel subclasses (amax groups, the emulation warning); nothing on one device."""


class GroupedLinear(ExpertParams, FP8Module):
    """``num_gemms`` experts' ``y_i = x_i @ weight{i}.T + bias{i}`` with FP8 GEMMs inside
    ``fp8_autocast``; ``forward(x, m_splits)`` with ``x`` the experts' tokens back to back.

    Args:
        save_original_input: save the high-precision input (once, for all experts) instead of
            each expert's columnwise FP8 copy (RECIPES.md); settable after construction.
        skip_bias_add: return ``(y, [bias0, ...])`` and leave the adds to the caller.
        fuse_wgrad_accumulation: accumulate each expert's wgrad into its ``main_grad`` in FP32.
        name: used in error messages (e.g. ``"decoder.layers.3.mlp.experts.linear_fc1"``).
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method: Callable[[torch.Tensor], object] | None = None,
        save_original_input: bool = False,
        skip_bias_add: bool = False,
        fuse_wgrad_accumulation: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self._owner = self._fp8_owner()
        if num_gemms < 1:
            raise ValueError(f"{self._owner}: num_gemms={num_gemms}; a grouped layer needs at least one expert")
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"{self._owner}({in_features}, {out_features}): sizes must be positive")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        dtype = params_dtype or torch.get_default_dtype()
        for i in range(num_gemms):
            w = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
            with torch.no_grad():
                (init_method or default_init)(w)
            self.register_parameter(f"weight{i}", w)
            b = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
            self.register_parameter(f"bias{i}", b)
        self.use_bias = bias
        self.pack_weights()
        self.save_original_input = save_original_input
        self.skip_bias_add = skip_bias_add
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation

    def forward(
        self,
        x: torch.Tensor,
        m_splits: Sequence[int] | torch.Tensor,
        is_first_microbatch: bool | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor] | None]:
        """``x [..., in_features]`` (rows = tokens of expert 0, then expert 1, ...) ->
        ``y [..., out_features]``; ``(y, biases)`` with ``skip_bias_add``."""
        qs, w_fp8 = self.fp8_operands(is_first_microbatch)
        y = grouped_linear(
            x, self.weights, None if self.skip_bias_add else self.biases, m_splits,
            w_fp8=w_fp8, quantizers=qs, save_original_input=self.save_original_input,
            fuse_wgrad_accumulation=self.fuse_wgrad_accumulation, name=self._owner,
        )
        return (y, self.biases) if self.skip_bias_add else y

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, save_original_input={self.save_original_input}"
        )
