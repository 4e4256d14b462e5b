"""megatron_fp8: Megatron-style FP8 linear layers on one shared quantized-GEMM core.

Public entry points: ``fp8_autocast`` (the FP8 region), ``recipe`` (the recipes),
``Linear`` / ``GroupedLinear`` (single-device layers), ``memory`` (saved-activation accounting),
``gemm`` (the core).
"""

from . import gemm, memory, recipe
from .autocast import fp8_autocast
from .modules import FP8Module, GroupedLinear, Linear

__all__ = ["fp8_autocast", "recipe", "gemm", "memory", "Linear", "FP8Module", "GroupedLinear"]
__version__ = "0.1.0"
