"""Padding each expert's rows to what its FP8 GEMMs need: the index of every real row among the
padded ones (``expert_rows``), padding inside an autograd function (``Padded``: the grouped
linear's own) and as an op of its own (``pad_rows``: Megatron's ``ExpertPadding``). Zero rows
change no output row and add zeros to every gradient sum; both save only the index for backward
(``Tensor.index_copy`` would also keep its source, a whole high-precision copy of the input)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..quant.kernels import PaddedRows, device_ints, expert_index, pad_expert_rows

__all__ = ["Padded", "expert_rows", "pad_rows"]


def expert_rows(splits: Sequence[int], align: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """For each real row (experts back to back), its row once every expert is padded to a multiple
    of ``align``; and the padded splits. The counts and shifts reach the device through
    ``kernels.device_ints`` (pinned, no sync, kept for the last few lists, safe under CUDA graph
    capture); the index is torch's ``arange + repeat_interleave`` on them (five launches), or one
    launch where the Triton kernels run (``kernels.expert_index``, from the prefix sums the casts
    and GEMMs use too)."""
    padded = [-(-m // align) * align for m in splits]
    rows = expert_index(splits, padded, torch.device(device))
    if rows is not None:
        return rows, padded
    shift, real_start, pad_start = [], 0, 0
    for m, p in zip(splits, padded):
        shift.append(pad_start - real_start)
        real_start, pad_start = real_start + m, pad_start + p
    counts_shifts = device_ints((*splits, *shift), device)
    counts, shifts = counts_shifts[: len(splits)], counts_shifts[len(splits):]
    rows = torch.arange(real_start, device=device) + torch.repeat_interleave(shifts, counts, output_size=real_start)
    return rows, padded


class Padded(NamedTuple):
    """Each expert's rows padded inside the function: the padded row of every real row
    (``expert_rows``) and the padded total."""

    rows: torch.Tensor
    total: int

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s rows at their padded rows, zeros between (no autograd: inside a function; one
        pass on the GPU, ``kernels.pad_expert_rows``)."""
        return pad_expert_rows(t, self.rows, self.total)

    def source(self, t: torch.Tensor, real: Sequence[int]) -> PaddedRows:
        """``t`` (the experts' ``real`` rows) as a cast's source: padded only if the cast needs the
        padded tensor (``quant.kernels.PaddedRows``)."""
        return PaddedRows(t, tuple(real), self.rows, self.total)


class _PadRows(torch.autograd.Function):
    """``x``'s rows written to rows ``rows`` of ``total`` zero rows; backward gathers them back.
    Saves the index only: ``Tensor.index_copy`` also saves its source, so padding that way kept a
    whole high-precision copy of the experts' input alive until backward (beside their FP8 copies)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(rows)
        return Padded(rows, total).pad(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (rows,) = ctx.saved_tensors
        return grad.index_select(0, rows), None, None


def pad_rows(x: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:
    """``x [M, ...]`` scattered into ``total`` zero rows at ``rows`` (``expert_rows``'s index), the
    gradient gathered back; saves only the index for backward."""
    return _PadRows.apply(x, rows, total)
