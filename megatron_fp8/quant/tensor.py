"""QuantizedTensor: the rowwise and/or columnwise FP8 copies of one 2-D tensor, with scales.

For a logical tensor ``t [rows, cols]``:

* the rowwise copy is consumed with ``cols`` as the contraction dim: ``data [rows, cols]``;
* the columnwise copy is consumed with ``rows`` as the contraction dim and is stored
  transposed, ``data [cols, rows]`` (K-major, the layout Hopper FP8 GEMMs require).

Each copy is an ``Operand``: FP8 data whose last dim is contracted plus its scales in the
logical layout of ``ScaleLayout``. The GEMM core only ever sees Operands.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import ScaleLayout
from .reference import e8m0_to_float


@dataclass(frozen=True)
class Operand:
    """FP8 data ``[rows, k]`` (k contracted) and its ``scale_inv`` in ``layout``.

    ``scale_inv``: FP32 scalar (TENSOR), ``[rows, 1]`` (ROW), ``[rows, k/128]`` (BLOCK_1x128),
    ``[rows/128, k/128]`` (BLOCK_128x128), or uint8 E8M0 exponents ``[rows, k/32]`` (MX_1x32).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    layout: ScaleLayout

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self) -> torch.Tensor:
        """FP32 values ``data * scale_inv`` expanded over each scale's block."""
        d = self.data.float()
        s = self.scale_inv
        if self.layout is ScaleLayout.MX_1x32:
            s = e8m0_to_float(s)
        if self.layout in (ScaleLayout.TENSOR, ScaleLayout.ROW):
            return d * s
        br, bc = self.layout.block
        return d * s.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.data) + _nbytes(self.scale_inv)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class QuantizedTensor:
    """FP8 copies of one tensor of logical ``shape [rows, cols]`` and dtype ``orig_dtype``.

    ``scale`` is the per-tensor quantization scale (``FP8_MAX / amax``), kept for per-tensor
    recipes so that a later cast of the same tensor can reuse it; ``None`` for block recipes,
    whose scales are a pure function of the data.
    """

    shape: torch.Size
    orig_dtype: torch.dtype
    fp8_dtype: torch.dtype
    rowwise: Operand | None = None
    columnwise: Operand | None = None
    scale: torch.Tensor | None = None

    def operand(self, usage: str) -> Operand:
        """The ``"rowwise"`` or ``"columnwise"`` copy, or a clear error if it was not cast."""
        op = self.rowwise if usage == "rowwise" else self.columnwise if usage == "columnwise" else None
        if usage not in ("rowwise", "columnwise"):
            raise ValueError(f"usage must be 'rowwise' or 'columnwise', got {usage!r}")
        if op is None:
            raise RuntimeError(
                f"this QuantizedTensor (shape {tuple(self.shape)}) has no {usage} copy; "
                f"quantize with {usage}=True"
            )
        return op

    def dequantize(self, usage: str = "rowwise", dtype: torch.dtype | None = None) -> torch.Tensor:
        """High-precision values of the logical tensor from the chosen copy."""
        op = self.operand(usage)
        out = op.dequantize()
        if usage == "columnwise":
            out = out.t()
        return out.to(dtype or self.orig_dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of all FP8 data and scales held (what saving this object costs)."""
        return sum(op.nbytes for op in (self.rowwise, self.columnwise) if op is not None)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this object holds (for save_for_backward and accounting)."""
        out: list[torch.Tensor] = []
        for op in (self.rowwise, self.columnwise):
            if op is not None:
                out += [op.data, op.scale_inv]
        if self.scale is not None:
            out.append(self.scale)
        return out
