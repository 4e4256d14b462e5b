"""The grouped-experts container of our Megatron specs: megatron-core's ``TEGroupedMLP`` holding
megatron_fp8's grouped linears, made to work with ``config.fp8`` set and Transformer Engine absent.

megatron-core's ``TEGroupedMLP`` asserts TE when ``config.fp8`` is set, because it pads each
expert's tokens to the FP8 GEMM alignment with TE's ``Fp8Padding``. ``GroupedMLP`` builds it with
the FP8 fields hidden, then gives it ``ExpertPadding`` / ``ExpertUnpadding`` (Megatron's own
contract: its forward calls the two objects). Our grouped linears pad each expert's rows to what
the active recipe's GEMMs need themselves (``ops.grouped_linear``: 128 tokens for 1x128 block
scaling and, on CUDA, per-tensor scaling; 32 for MXFP8), inside their casts where those read the
padding as zeros (``quant.kernels.cast_gathered``), and their GEMMs write only the real rows. So by default
(``MEGATRON_FP8_EXPERT_PADDING=inside``) the two objects pass the tokens through, and the
activation between fc1 and fc2 runs on the real rows only. ``outside`` pads there, as TE's
``Fp8Padding`` does: zero rows appended per expert (``layout_rows``), which never leave the experts
and add nothing to any output or gradient; the padding saves only its row index for backward
(``ops.padding.pad_rows``; TE's saves only the splits). As Megatron does with TE, ``moe_act``
recompute turns ``save_original_input`` on for ``linear_fc2`` (the activation's consumer).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from typing import Any

import torch

from ..autocast import current_fp8_state
from ..ops.grouped_linear import layout_rows
from ..ops.padding import expert_rows, pad_rows
from ..quant.formats import ScaleLayout
from ..quant.quantizers import make_quantizer
from ..recipe import Recipe, TensorRole
from ..settings import env_choice
from .specs import import_megatron, lazy_class

__all__ = ["ExpertPadding", "ExpertUnpadding", "alignment"]  # and GroupedMLP (module __getattr__)


@functools.lru_cache(maxsize=32)
def _input_layout(recipe: Recipe) -> ScaleLayout:
    return make_quantizer(recipe, TensorRole.INPUT).layout


def alignment(recipe: Recipe | None, device: torch.device | None = None) -> int:
    """Rows per expert that the recipe's FP8 GEMMs need to run natively on ``device`` (1: no FP8):
    the grouped layers' rule (``layout_rows``) for the layout the recipe casts activations with."""
    return 1 if recipe is None else layout_rows(_input_layout(recipe), device)


def _active_alignment(device: torch.device) -> int:
    state = current_fp8_state()
    return alignment(state.recipe if state is not None and state.enabled else None, device)


def padding_setting() -> str:
    """``MEGATRON_FP8_EXPERT_PADDING``: ``inside`` (the default: the grouped linears pad each expert
    themselves, ``ExpertPadding`` passes the tokens through) or ``outside`` (``ExpertPadding``
    pads, as Transformer Engine's ``Fp8Padding``). Anything else raises."""
    return env_choice("MEGATRON_FP8_EXPERT_PADDING", "inside", {
        "inside": "the grouped linears pad each expert in their casts",
        "outside": "Megatron's padding objects pad the tokens"})


class ExpertPadding:
    """``(x, tokens_per_expert) -> (x padded per expert, padded tokens_per_expert)``, the
    interface of TE's ``Fp8Padding`` that megatron-core's grouped experts call."""

    def __call__(self, x: torch.Tensor, tokens_per_expert: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        splits = [int(m) for m in tokens_per_expert]
        if padding_setting() == "inside":  # the grouped linears pad (module docstring)
            return x, splits
        align = _active_alignment(x.device)
        if align == 1 or all(m % align == 0 for m in splits):
            return x, splits
        rows, padded = expert_rows(splits, align, x.device)
        return pad_rows(x, rows, sum(padded)), padded


class ExpertUnpadding:
    """``(y padded per expert, actual tokens_per_expert) -> y`` of the real rows (TE's
    ``Fp8Unpadding`` interface)."""

    def __call__(self, y: torch.Tensor, tokens_per_expert: Sequence[int]) -> torch.Tensor:
        splits = [int(m) for m in tokens_per_expert]
        if y.shape[0] == sum(splits):
            return y
        rows, padded = expert_rows(splits, _active_alignment(y.device), y.device)
        if sum(padded) != y.shape[0]:
            raise RuntimeError(f"megatron_fp8 GroupedMLP: the experts' output has {y.shape[0]} rows, but the "
                               f"splits {splits} pad to {sum(padded)}; the FP8 recipe changed inside the layer")
        return y.index_select(0, rows)


def _container() -> type:
    experts = import_megatron("megatron.core.transformer.moe.experts", "megatron_fp8 grouped experts")
    container = getattr(experts, "TEGroupedMLP", None)
    if container is None:
        raise ValueError(
            "moe_grouped_gemm=True: this megatron-core has no TEGroupedMLP to hold megatron_fp8's grouped "
            "linears; build the spec with moe_grouped_gemm=False (SequentialMLP experts use our linears)"
        )
    return container


def _build_class() -> type:
    base = _container()

    class GroupedMLP(base):  # type: ignore[misc, valid-type]
        """megatron-core's ``TEGroupedMLP`` with megatron_fp8's grouped linears and padding
        (module docstring); same parameters, checkpoint keys and forward."""

        def __init__(self, num_local_experts: int, config: Any, *args: Any, **kwargs: Any) -> None:
            quantized = bool(getattr(config, "fp8", None))
            hidden = config
            if quantized:  # TEGroupedMLP asserts TE when it sees config.fp8
                hidden = copy.copy(config)
                hidden.fp8 = None
            super().__init__(num_local_experts, hidden, *args, **kwargs)
            if not quantized:
                return
            self.config = config
            for linear in (self.linear_fc1, self.linear_fc2):
                linear.config = config
            self.quantization_padding = ExpertPadding()
            self.quantization_unpadding = ExpertUnpadding()
            if getattr(self, "activation_recompute", False):
                self.linear_fc2.save_original_input = True  # what megatron-core does with TE

    GroupedMLP.__qualname__ = GroupedMLP.__name__ = "GroupedMLP"
    GroupedMLP.__module__ = __name__
    return GroupedMLP


# built on first use: it subclasses megatron-core's class, and the package imports megatron-core
# only when a Megatron entry point is used
__getattr__ = lazy_class(__name__, "GroupedMLP", _build_class)
