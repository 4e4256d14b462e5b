"""Block quantizers: DeepSeek-style 1x128 / 128x128 blocks, and MXFP8's 1x32 blocks.

The rowwise and columnwise copies have different scales (blocks run along the contraction
dim), so each is cast from the high-precision tensor.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch

from . import kernels
from .formats import ScaleLayout
from .quantizer import Quantizer, Segments, _check_2d
from .tensor import Operand, QuantizedTensor


class _BlockQuantizer(Quantizer):
    """Shared quantize() of the block recipes: their scales are a pure function of the data,
    so ``scale``/``record_amax`` do not apply; subclasses pick the cast."""

    def quantize(self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False,
                 scale: torch.Tensor | None = None, record_amax: bool = True) -> QuantizedTensor:
        _check_2d(x, self.name)
        qt = self._new(x)
        row, col = self._cast(x, rowwise, columnwise)
        if row is not None:
            qt.rowwise = Operand(*row, self.layout)
        if col is not None:
            qt.columnwise = Operand(*col, self.layout)
        return qt

    @abc.abstractmethod
    def _cast(self, x: torch.Tensor, rowwise: bool, columnwise: bool) -> kernels.Copies: ...

    def check_shape(self, shape: tuple[int, int], *, rowwise: bool, columnwise: bool) -> None:
        if self.layout is ScaleLayout.BLOCK_128x128:
            kernels.ref.check_block_shape_2d(tuple(shape), self.block, self.name)
        else:
            kernels.check_1d(tuple(shape), rowwise, columnwise, self.block, self.name)


class _DeepSeekBlockQuantizer(_BlockQuantizer):
    def __init__(self, fp8_dtype: torch.dtype, *, power_2_scale: bool = True, amax_epsilon: float = 0.0,
                 block: int = 128, name: str = "tensor") -> None:
        super().__init__(fp8_dtype, name)
        self.power_2_scale, self.amax_epsilon, self.block = power_2_scale, amax_epsilon, block

    def _config(self) -> tuple[Any, ...]:
        return (*super()._config(), self.power_2_scale, self.amax_epsilon, self.block)

    def casts_segments(self, x: torch.Tensor) -> bool:
        return kernels.block_segments_fused(x, self.block, self.power_2_scale, self.amax_epsilon)

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
        """One launch when every split and K are multiples of 128 (no block spans two
        segments: experts' tokens, or for 128x128 the experts' weights stacked) and the fused
        kernel covers the options (power-of-two, no epsilon)."""
        _check_2d(x, self.name)
        if not self._peers_match(peers) or not (rowwise or columnwise):
            return None
        mode = "1x128" if self.layout is ScaleLayout.BLOCK_1x128 else "128x128"
        raw = kernels.cast_blocks_segments(x, splits, self.fp8_dtype, rowwise, columnwise, self.block,
                                           self.power_2_scale, self.amax_epsilon, mode)
        return Segments(*self._packs(x, splits, *raw), None) if raw is not None else None

    def quantize_segments_gathered(self, src: kernels.PaddedRows, splits: Sequence[int], *,
                                   peers: Sequence[Quantizer], rowwise: bool, columnwise: bool,
                                   scales: Sequence[torch.Tensor | None] | None = None) -> Segments | None:
        x = src.x
        if (self.layout is not ScaleLayout.BLOCK_1x128 or not self._peers_match(peers)
                or not kernels.block_segments_fused(x, self.block, self.power_2_scale, self.amax_epsilon)):
            return None
        raw = kernels.cast_gathered(src, splits, self.fp8_dtype, "1x128", None, rowwise, columnwise)
        return Segments(*self._packs(x, splits, *raw), None) if raw is not None else None


class Block1DQuantizer(_DeepSeekBlockQuantizer):
    """1x128 tiles along the contraction dim (activations and gradients)."""

    layout = ScaleLayout.BLOCK_1x128

    def _cast(self, x: torch.Tensor, rowwise: bool, columnwise: bool) -> kernels.Copies:
        return kernels.cast_blocks_1d(x, self.fp8_dtype, rowwise, columnwise, self.block, self.power_2_scale,
                                      self.amax_epsilon, self.name)


class Block2DQuantizer(_DeepSeekBlockQuantizer):
    """128x128 blocks (weights). The columnwise copy is the rowwise one transposed: a 2-D block
    has the same amax whichever dim is contracted, so nothing is recast."""

    layout = ScaleLayout.BLOCK_128x128

    def _cast(self, x: torch.Tensor, rowwise: bool, columnwise: bool) -> kernels.Copies:
        return kernels.cast_blocks_2d(x, self.fp8_dtype, rowwise, columnwise, self.block, self.power_2_scale,
                                      self.amax_epsilon, self.name)


class MXFP8Quantizer(_BlockQuantizer):
    """1x32 blocks with E8M0 scales; rowwise blocks run along K, columnwise along M."""

    layout = ScaleLayout.MX_1x32

    def __init__(self, fp8_dtype: torch.dtype, *, block: int = 32, name: str = "tensor") -> None:
        super().__init__(fp8_dtype, name)
        self.block = block

    def _cast(self, x: torch.Tensor, rowwise: bool, columnwise: bool) -> kernels.Copies:
        return kernels.cast_mx(x, self.fp8_dtype, rowwise, columnwise, self.block, self.name)
