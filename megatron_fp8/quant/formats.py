"""FP8 element formats and scale layouts: the vocabulary shared by casts and GEMMs."""

from __future__ import annotations

import enum
import os

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{dtype} is not an FP8 dtype; expected one of {FP8_DTYPES}")
    return float(torch.finfo(dtype).max)


def cast_clamp() -> bool:
    """Whether the GPU cast kernels clamp to +-FP8_MAX before converting to FP8
    (``MEGATRON_FP8_CAST_CLAMP``: ``0``, the default, or ``1``; anything else raises).

    The reference clamps, then rounds (``reference.quantize``). On the GPU the conversion
    (``cvt.rn.satfinite``) gives the same bits without the clamp: +-inf and values past FP8_MAX
    become +-FP8_MAX, NaN stays NaN. Leaving the clamp out takes 3 instructions a value off
    the casts (~250 a thread), measured faster on an H200 (docs/benchmarks.md run W). Under
    the Triton interpreter the conversion is torch's on the CPU, which turns E5M2 overflow into
    inf, so the clamp is always kept there. The cast modules (``triton_cast``, ``cuda_cast``) read
    it once, when they are imported."""
    v = os.environ.get("MEGATRON_FP8_CAST_CLAMP", "0").strip()
    if v not in ("0", "1"):
        raise ValueError(f"MEGATRON_FP8_CAST_CLAMP={v!r}; allowed: '0' (leave saturation to the GPU's "
                         "conversion, the default) or '1' (clamp before it)")
    return v == "1" or os.environ.get("TRITON_INTERPRET") == "1"


def check_high_precision(x: torch.Tensor, what: str) -> None:
    """Reject inputs a cast cannot take, naming the tensor and the allowed dtypes."""
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"{what} has dtype {x.dtype}; FP8 casts take {', '.join(map(str, HIGH_PRECISION_DTYPES))}"
        )


class ScaleLayout(enum.Enum):
    """How scales tile a 2-D operand ``[rows, k]`` whose last dim is contracted.

    ``TENSOR``: one FP32 scale. ``ROW``: one per row. ``BLOCK_1x128``: one per 128 consecutive
    elements of a row. ``BLOCK_128x128``: one per 128x128 block. ``MX_1x32``: one E8M0 exponent
    per 32 consecutive elements of a row.
    """

    TENSOR = "tensor"
    ROW = "row"
    BLOCK_1x128 = "1x128"
    BLOCK_128x128 = "128x128"
    MX_1x32 = "mx1x32"

    @property
    def block(self) -> tuple[int, int]:
        """(rows, cols) one scale covers; 0 means the whole extent."""
        return {
            ScaleLayout.TENSOR: (0, 0),
            ScaleLayout.ROW: (1, 0),
            ScaleLayout.BLOCK_1x128: (1, 128),
            ScaleLayout.BLOCK_128x128: (128, 128),
            ScaleLayout.MX_1x32: (1, 32),
        }[self]

    @property
    def token_multiple(self) -> int:
        """Rows a columnwise copy in this layout needs to be a multiple of (its blocks run along
        the tokens: 128 for 1x128, 32 for MXFP8; 1 where no scale spans part of a column)."""
        rows, cols = self.block
        return cols if rows == 1 and cols else 1


E8M0_BIAS = 127
