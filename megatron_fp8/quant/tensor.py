"""QuantizedTensor: the rowwise and/or columnwise FP8 copies of one 2-D tensor, with scales.

For a logical tensor ``t [rows, cols]``:

* the rowwise copy is consumed with ``cols`` as the contraction dim: ``data [rows, cols]``;
* the columnwise copy is consumed with ``rows`` as the contraction dim and is stored
  transposed, ``data [cols, rows]`` (K-major, the layout Hopper FP8 GEMMs require).

Each copy is an ``Operand``: FP8 data whose last dim is contracted plus its scales in the
logical layout of ``ScaleLayout``. The GEMM core only ever sees Operands.

A ``Pack`` is every expert's copy from one segmented (one-launch) cast: one data buffer and one
scale buffer, and the per-expert Operand views of them. Each such Operand carries its pack and
slot, so a grouped GEMM knows in O(1) that a list of them lies as its one-launch kernels read
it (instead of checking every expert's pointers), and a layer saves the two buffers for
backward instead of two views per expert.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

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
    pack: Pack | None = field(default=None, compare=False, repr=False)  # the segmented cast it is a view of
    slot: int = field(default=0, compare=False, repr=False)  # its expert's index in ``pack``

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
    # kept by a layer's micro-batch cache (``FP8Module._cache_fp8_weight``): only such an object
    # is pointed at a per-layer CUDA graph's own copy once copied in (ops/graphed.py)
    cached: bool = field(default=False, compare=False, repr=False)

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


SCALE_STRIDE = 4  # per-expert tensorwise scales sit 16 bytes apart (cuBLAS rejects unaligned scale pointers)


def aligned_scalars(n: int, device: torch.device) -> torch.Tensor:
    """``[n]`` FP32 view whose elements sit ``SCALE_STRIDE`` floats (16 bytes) apart (each
    ``t[i]`` is a valid scale pointer for ``torch._scaled_mm``); a plain ``[1]`` tensor when
    ``n == 1``."""
    if n == 1:
        return torch.empty((1,), dtype=torch.float32, device=device)
    # (one call: a [n, SCALE_STRIDE] buffer sliced to its first column took ~2.5x the host time)
    return torch.empty_strided((n,), (SCALE_STRIDE,), dtype=torch.float32, device=device)


@dataclass(frozen=True, eq=False)
class Pack:
    """Every expert's rowwise (or columnwise) copy from one segmented cast of ``x [M, K]``
    (``splits``: the experts' row counts, ``width``: K), in one data and one scale buffer:

    ========================  ===============================  =====================================
    copy                      ``data``                         ``scale_inv``
    ========================  ===============================  =====================================
    rowwise                   ``[M, K]``                       TENSOR: ``[E]`` 16 bytes apart;
                                                               1x128: ``[K/128 * M]`` (expert e:
                                                               ``[K/128, m_e]`` at ``K/128 * start``);
                                                               128x128: ``[M/128, K/128]``
    columnwise                ``[K * M]`` (expert e: ``[K,     TENSOR: as rowwise; 1x128:
                              m_e]`` at ``K * start``)         ``[M/128, K]``; 128x128: ``[E, K/128,
                                                               m/128]`` (equal splits), or the
                                                               rowwise ``[M/128, K/128]``
    ========================  ===============================  =====================================

    ``grouped``: whether the one-launch grouped GEMMs can read the buffers as they are (all but
    a 128x128 columnwise copy of unequal splits, whose experts' scales are transposed apart).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    splits: tuple[int, ...]
    width: int
    layout: ScaleLayout
    columnwise: bool

    @property
    def grouped(self) -> bool:
        if self.layout is ScaleLayout.TENSOR:
            return len(self.splits) == 1 or self.scale_inv.stride(0) == SCALE_STRIDE
        if self.layout is ScaleLayout.BLOCK_128x128 and self.columnwise:
            return self.scale_inv.dim() == 3 and self.scale_inv.is_contiguous()
        return self.scale_inv.is_contiguous()

    def operands(self) -> list[Operand]:
        """The experts' Operands: views of the two buffers, each tagged with this pack."""
        out, start = [], 0
        for i, n in enumerate(self.splits):
            out.append(self._view(i, start, n))
            start += n
        return out

    def operand(self, i: int) -> Operand:
        """Expert ``i``'s Operand alone (what ``operands()[i]`` holds, as a new object)."""
        return self._view(i, sum(self.splits[:i]), self.splits[i])

    def _view(self, i: int, start: int, n: int) -> Operand:
        """Expert ``i`` (``n`` rows from row ``start``): its data and scales in the two buffers."""
        k, s, layout = self.width, self.scale_inv, self.layout
        data = self.data[k * start : k * (start + n)].view(k, n) if self.columnwise else self.data[start : start + n]
        if layout is ScaleLayout.TENSOR:
            scale = s[i]
        elif layout is ScaleLayout.BLOCK_1x128:
            n_kb = -(-k // 128)
            scale = s[start // 128 : (start + n) // 128].t() if self.columnwise \
                else s[n_kb * start : n_kb * (start + n)].view(n_kb, n).t()
        elif layout is not ScaleLayout.BLOCK_128x128:
            raise ValueError(f"Pack: no segmented casts in {layout}")
        elif not self.columnwise:
            scale = s[start // 128 : (start + n) // 128]
        else:  # equal splits: every expert's transposed blocks in one buffer; else transposed here
            scale = s[i] if s.dim() == 3 else s[start // 128 : (start + n) // 128].t().contiguous()
        return Operand(data, scale, layout, self, i)

    @staticmethod
    def of(ops: Sequence[Operand]) -> Pack | None:
        """The pack ``ops`` are exactly the Operands of, in slot order, where the grouped GEMMs
        can read its buffers; else None."""
        if isinstance(ops, Operands):
            p = ops.pack
            return p if p.grouped and p.data.is_contiguous() else None
        p = ops[0].pack if ops else None
        if p is None or len(ops) != len(p.splits) or not p.grouped or not p.data.is_contiguous():
            return None
        for i, op in enumerate(ops):
            if op.pack is not p or op.slot != i:
                return None
        return p


class Operands(Sequence[Operand]):
    """The experts' Operands of one ``Pack``, made on first use: a grouped GEMM that reads the
    pack's buffers in one launch never needs the per-expert views (``Pack.of`` answers in O(1)
    for this sequence); indexing one expert makes only its view."""

    __slots__ = ("pack", "_ops")

    def __init__(self, pack: Pack) -> None:
        self.pack = pack
        self._ops: list[Operand] | None = None

    def __len__(self) -> int:
        return len(self.pack.splits)

    def __getitem__(self, i: int) -> Operand:  # type: ignore[override]
        if self._ops is None and isinstance(i, int):
            if not -len(self) <= i < len(self):
                raise IndexError(f"expert {i} of {len(self)}")
            return self.pack.operand(i if i >= 0 else i + len(self))
        if self._ops is None:
            self._ops = self.pack.operands()
        return self._ops[i]

    def __iter__(self) -> Iterator[Operand]:
        if self._ops is None:
            self._ops = self.pack.operands()
        return iter(self._ops)
