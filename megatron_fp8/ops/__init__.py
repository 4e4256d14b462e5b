"""Autograd functions: what to cast and what to save for backward; nothing else."""

from .linear import LinearQuantizers, linear

__all__ = ["LinearQuantizers", "linear"]
