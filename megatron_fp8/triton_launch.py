"""Launching Triton kernels without Triton's per-call host cost: ``Launcher(kernel)(grid, *args,
**kwargs)`` is ``kernel[grid](*args, **kwargs)``, with the compiled kernel kept per
specialization after the first launch (the casts in ``quant/triton_cast.py``, the grouped GEMMs
in ``triton_grouped.py``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import triton


def _spec(value: Any, constexpr: bool) -> Any:
    """What Triton specializes a compiled kernel on, for one argument (a superset of its rules:
    tensor dtype and 16-byte alignment; int width, ``== 1`` and divisibility by 16; constexpr
    values themselves)."""
    if constexpr:
        return value
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return bool, value
    if isinstance(value, int):
        return int, value == 1, value % 16 == 0, -(2**31) <= value < 2**31, value < 2**63
    return type(value)


class Launcher:
    """``kernel[grid](*args, **kwargs)`` without Triton's per-call argument binding.

    Triton's ``JITFunction.run`` costs ~35 us of host time per launch here (argument binding,
    specialization, cache key), more than a cast of a few MB takes on the GPU, so small casts
    and grouped layers were launch-bound. The first launch per specialization goes through
    Triton (compiling if needed) and keeps the compiled kernel under our own key (a superset of
    Triton's specialization, so a kept kernel is only reused where Triton would reuse it); later
    launches call it directly, as ``run`` itself does after its lookup. Any mismatch with this
    Triton's launcher API turns the shortcut off for good (plain launches, same results).
    Triton's interpreter always takes the plain path.
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        params = getattr(fn, "params", None) or []  # an interpreted function has none
        self.names = [p.name for p in params]
        self.constexpr = [bool(p.is_constexpr) for p in params]
        self.name_set = frozenset(self.names)
        self.kernels: dict[tuple[Any, ...], Any] = {}
        self.fast = bool(params) and os.environ.get("TRITON_INTERPRET") != "1"

    def __call__(self, grid: Sequence[int], *args: Any, **kwargs: Any) -> None:
        if not self.fast:
            self.fn[tuple(grid)](*args, **kwargs)
            return
        n = len(args)
        values = (*args, *(kwargs[name] for name in self.names[n:]))
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.name_set))
        device = torch.cuda.current_device()
        key = (device, options, *(_spec(v, c) for v, c in zip(values, self.constexpr)))
        kernel = self.kernels.get(key)
        if kernel is None:
            kernel = self.fn[tuple(grid)](*args, **kwargs)
            self.kernels[key] = kernel.result() if hasattr(kernel, "result") else kernel
            return
        g = (*grid, 1, 1)
        try:
            stream = triton.runtime.driver.active.get_current_stream(device)
            hooks = triton.knobs.runtime
            kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata,
                       kernel.launch_metadata(tuple(grid), stream, *values), hooks.launch_enter_hook,
                       hooks.launch_exit_hook, *values)
        except (AttributeError, TypeError):  # another Triton's launcher API: plain launches from now on
            self.fast = False
            self.fn[tuple(grid)](*args, **kwargs)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code (``triton.cdiv`` is a Triton constexpr function: a few us of
    argument unwrapping per call, ~25 calls in a grouped layer's step)."""
    return -(-a // b)
