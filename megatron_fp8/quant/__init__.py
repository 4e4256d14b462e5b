"""FP8 formats, the QuantizedTensor, per-recipe quantizers and their reference casts."""

from .formats import ScaleLayout, fp8_max
from .quantizers import (
    Block1DQuantizer,
    Block2DQuantizer,
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    MXFP8Quantizer,
    Quantizer,
    make_quantizer,
)
from .tensor import Operand, QuantizedTensor

__all__ = [
    "ScaleLayout", "fp8_max", "Quantizer", "CurrentScalingQuantizer", "DelayedScalingQuantizer",
    "Block1DQuantizer", "Block2DQuantizer", "MXFP8Quantizer", "make_quantizer", "Operand",
    "QuantizedTensor",
]
