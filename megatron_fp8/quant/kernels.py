"""Device dispatch for the casts: the torch reference on CPU, fused compiled casts on CUDA.

On CUDA each cast (rowwise and columnwise copies together) is one ``torch.compile``-d graph of
the very reference functions in ``reference.py``, so the GPU computes the same arithmetic in
one pass over the input instead of several eager kernels; the tests check the two bitwise.
``MEGATRON_FP8_COMPILE_CASTS=0`` forces the eager reference everywhere.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from . import reference as ref

Pair = tuple[torch.Tensor, torch.Tensor]


def _tensorwise(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rowwise: bool,
                columnwise: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    row = ref.cast_to_fp8(x, scale, dtype) if rowwise else None
    if not columnwise:
        col = None
    elif row is not None:
        col = row.t().contiguous()  # elementwise cast: transposing the data is exact
    else:
        col = ref.cast_to_fp8(x.t(), scale, dtype).contiguous()
    return row, col


def _blocks_1d(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool, block: int,
               pow2: bool, eps: float, name: str) -> tuple[Pair | None, Pair | None]:
    kw: dict[str, Any] = dict(block=block, power_2_scale=pow2, amax_epsilon=eps)
    row = ref.cast_blocks_1d(x, dtype, what=f"{name} (rowwise 1x{block})", **kw) if rowwise else None
    col = (
        ref.cast_blocks_1d(x.t(), dtype, what=f"{name} (columnwise 1x{block} along dim 0)", **kw)
        if columnwise else None
    )
    return row, col


def _blocks_2d(x: torch.Tensor, dtype: torch.dtype, block: int, pow2: bool, eps: float,
               name: str) -> Pair:
    return ref.cast_blocks_2d(x, dtype, block=block, power_2_scale=pow2, amax_epsilon=eps, what=name)


def _mx(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool, block: int,
        name: str) -> tuple[Pair | None, Pair | None]:
    row = ref.cast_mx(x, dtype, block=block, what=f"{name} (rowwise 1x{block})") if rowwise else None
    col = (
        ref.cast_mx(x.t(), dtype, block=block, what=f"{name} (columnwise 1x{block} along dim 0)")
        if columnwise else None
    )
    return row, col


def compile_enabled() -> bool:
    return os.environ.get("MEGATRON_FP8_COMPILE_CASTS", "1") != "0"


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    return torch.compile(fn)  # automatic dynamic shapes: one recompile, then any size


def _dispatch(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(x: torch.Tensor, *args: Any) -> Any:
        if x.is_cuda and compile_enabled():
            _check_shapes(fn, x, args)
            return _compiled(fn)(x, *args)
        return fn(x, *args)

    return run


def _check_shapes(fn: Callable[..., Any], x: torch.Tensor, args: tuple[Any, ...]) -> None:
    """Raise the reference's clear shape errors before compiling (not a compiler trace)."""
    if fn is _tensorwise:
        return
    with torch.device("meta"):
        fn(torch.empty(x.shape, dtype=x.dtype), *args)


cast_tensorwise = _dispatch(_tensorwise)
cast_blocks_1d_both = _dispatch(_blocks_1d)
cast_blocks_2d = _dispatch(_blocks_2d)
cast_mx_both = _dispatch(_mx)
