"""nn.Modules on the autograd functions: single-device layers and their FP8 state."""

from .base import FP8Module
from .grouped import GroupedLinear
from .linear import Linear

__all__ = ["FP8Module", "Linear", "GroupedLinear"]
