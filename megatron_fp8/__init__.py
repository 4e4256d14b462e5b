"""megatron_fp8: Megatron-style FP8 linear layers on one shared quantized-GEMM core.

Public entry points: ``fp8_autocast`` (the FP8 region), ``recipe`` (the recipes),
``Linear`` (single-device layer), ``memory`` (saved-activation accounting), ``gemm`` (the core).
"""

from . import gemm, memory, recipe
from .autocast import fp8_autocast
from .modules import FP8Module, Linear

__all__ = ["fp8_autocast", "recipe", "gemm", "memory", "Linear", "FP8Module"]
__version__ = "0.1.0"
