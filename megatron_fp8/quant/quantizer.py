"""The ``Quantizer`` base: one recipe and tensor role, a 2-D tensor in, a QuantizedTensor out.

``quantize(x, rowwise=, columnwise=)`` casts the requested copies; ``quantize_segments`` casts the
row segments of ``x`` (the experts' tokens) as separate ``quantize`` calls would, in one launch
where a subclass has a fused path. The recipes' quantizers: ``tensor_scaling`` (current, delayed)
and ``block_scaling`` (1x128 / 128x128, MXFP8); ``quantizers.make_quantizer`` picks one for a recipe.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from .formats import ScaleLayout, check_high_precision
from .tensor import Pack, QuantizedTensor

if TYPE_CHECKING:
    from .kernels import PaddedRows


def _grouped(group: dist.ProcessGroup | None) -> bool:
    """Whether amaxes are reduced over ``group`` (more than one rank)."""
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1


def _reduce_amax(amax: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The max of ``amax`` over ``group``'s ranks. A NaN goes in as +inf, which every backend's MAX
    keeps (NaN handling in a reduction is the backend's), so a non-finite amax on any rank is
    non-finite on all of them: the scale and history rules see it the same everywhere."""
    if _grouped(group):
        amax = torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _check_2d(x: torch.Tensor, name: str) -> None:
    check_high_precision(x, name)
    if x.dim() != 2:
        raise ValueError(f"{name}: quantizers take 2-D tensors, got shape {tuple(x.shape)}")


class Segments(NamedTuple):
    """A one-launch cast of row segments: the rowwise and columnwise ``Pack`` (None where not
    cast) and the per-tensor scale each segment keeps (None for block recipes)."""

    rows: Pack | None
    cols: Pack | None
    scales: Sequence[torch.Tensor] | None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor it holds: the packs' buffers and the kept scales."""
        packs = [p for p in (self.rows, self.cols) if p is not None]
        return [*(t for p in packs for t in (p.data, p.scale_inv)), *(self.scales or ())]


class Quantizer(abc.ABC):
    """Casts tensors of one role under one recipe."""

    layout: ScaleLayout

    def __init__(self, fp8_dtype: torch.dtype, name: str = "tensor") -> None:
        self.fp8_dtype = fp8_dtype
        self.name = name

    @abc.abstractmethod
    def quantize(
        self,
        x: torch.Tensor,
        *,
        rowwise: bool = True,
        columnwise: bool = False,
        scale: torch.Tensor | None = None,
        record_amax: bool = True,
    ) -> QuantizedTensor: ...

    def quantize_segments(
        self,
        x: torch.Tensor,
        splits: Sequence[int],
        *,
        peers: Sequence[Quantizer],
        rowwise: bool,
        columnwise: bool,
        scales: Sequence[torch.Tensor | None] | None = None,
    ) -> list[QuantizedTensor] | None:
        """Cast each row segment of ``x`` (``splits``: the experts' token counts; ``peers``: one
        quantizer per segment, this one first) exactly as ``peers[i].quantize(segment_i)`` would,
        in one pass; ``scales``: per-segment scales to reuse. None where no fused path applies
        here (the caller then casts segment by segment). One QuantizedTensor per segment, whose
        Operands are views of ``quantize_segments_packed``'s buffers."""
        seg = self.quantize_segments_packed(x, splits, peers=peers, rowwise=rowwise, columnwise=columnwise,
                                            scales=scales)
        return self._segment_tensors(x, splits, *seg) if seg is not None else None

    def quantize_segments_packed(
        self,
        x: torch.Tensor,
        splits: Sequence[int],
        *,
        peers: Sequence[Quantizer],
        rowwise: bool,
        columnwise: bool,
        scales: Sequence[torch.Tensor | None] | None = None,
    ) -> Segments | None:
        """``quantize_segments`` as the one launch leaves it: the rowwise and columnwise ``Pack``
        and each segment's kept scale (per-tensor recipes). None where no fused path applies."""
        return None

    def quantize_segments_gathered(self, src: PaddedRows, splits: Sequence[int], *, peers: Sequence[Quantizer],
                                   rowwise: bool, columnwise: bool,
                                   scales: Sequence[torch.Tensor | None] | None = None) -> Segments | None:
        """``quantize_segments_packed`` of ``src.padded()`` (``splits`` the padded counts) without
        writing that padded tensor, where a kernel reads the padding as zeros
        (``kernels.cast_gathered``); None elsewhere (the caller pads and casts)."""
        return None

    def casts_segments(self, x: torch.Tensor) -> bool:
        """Whether ``quantize_segments`` may cast segments of tensors like ``x`` in one launch
        here (lets a caller skip stacking tensors for it)."""
        return False

    def _packs(self, x: torch.Tensor, splits: Sequence[int], row: torch.Tensor | None, row_s: torch.Tensor | None,
               col: torch.Tensor | None, col_s: torch.Tensor | None) -> tuple[Pack | None, Pack | None]:
        """The rowwise and columnwise ``Pack`` of a segmented cast's raw buffers (``col_s`` None:
        the rowwise scales serve the columnwise copy, 128x128 blocks of unequal splits)."""
        sp, k = tuple(splits), x.shape[1]
        rows = Pack(row, row_s, sp, k, self.layout, False) if row is not None and row_s is not None else None
        scale = col_s if col_s is not None else row_s
        cols = Pack(col, scale, sp, k, self.layout, True) if col is not None and scale is not None else None
        return rows, cols

    def _segment_tensors(
        self,
        x: torch.Tensor,
        splits: Sequence[int],
        rows: Pack | None,
        cols: Pack | None,
        scales: Sequence[torch.Tensor] | None = None,
    ) -> list[QuantizedTensor]:
        """One QuantizedTensor per segment from the packs' per-segment Operands."""
        row_ops = rows.operands() if rows is not None else [None] * len(splits)
        col_ops = cols.operands() if cols is not None else [None] * len(splits)
        k, dtype, fp8 = x.shape[1], x.dtype, self.fp8_dtype
        return [QuantizedTensor(torch.Size((m, k)), dtype, fp8, r, c, scales[i] if scales is not None else None)
                for i, (m, r, c) in enumerate(zip(splits, row_ops, col_ops))]

    def _config(self) -> tuple[Any, ...]:
        """What makes two stateless quantizers cast identically."""
        return (type(self), self.fp8_dtype)

    def _peers_match(self, peers: Sequence[Quantizer]) -> bool:
        mine = self._config()
        return all(q is self or q._config() == mine for q in peers)

    def check_shape(self, shape: tuple[int, int], *, rowwise: bool, columnwise: bool) -> None:  # noqa: B027
        """Raise the error ``quantize`` would raise for a 2-D ``shape``, without casting (lets a
        layer fail in forward for a cast that only backward will do). Per-tensor: any shape."""

    def _new(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> QuantizedTensor:
        return QuantizedTensor(x.shape, x.dtype, self.fp8_dtype, scale=scale)

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave out the lean path's cast routes (``ops.routes.cast_route``):
        they hold this quantizer by reference and are local functions. A copy makes its own."""
        return {k: v for k, v in self.__dict__.items() if k != "_lean_routes"}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} ({self.name}) holds no state, got {sorted(state)}")
