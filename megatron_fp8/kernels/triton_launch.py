"""Launching Triton kernels without Triton's per-call host cost: ``Launcher(kernel)(grid, *args,
**kwargs)`` is ``kernel[grid](*args, **kwargs)``, with the compiled kernel kept per
specialization after the first launch (the casts in ``triton_cast.py``, the grouped GEMMs
in ``triton_grouped.py``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import triton


def _spec(value: Any, constexpr: bool) -> Any:
    """What Triton specializes a compiled kernel on, for one argument (a superset of its rules:
    tensor dtype and 16-byte alignment; int width, ``== 1`` and divisibility by 16; constexpr
    values themselves). ``Launcher`` inlines the tensor and int cases."""
    if constexpr:
        return value
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return bool, value
    if isinstance(value, int):
        return int, value == 1, value % 16 == 0, -(2**31) <= value < 2**31, value < 2**63
    return type(value)


def _no_hook(hook: Any) -> bool:
    """Whether a Triton launch hook would do nothing: unset, or an empty hook chain (Triton 3.6
    keeps a chain object even when nothing is registered)."""
    return hook is None or (isinstance(getattr(hook, "calls", None), list) and not hook.calls)


class _Kept(NamedTuple):
    """A compiled kernel kept by ``Launcher``. ``direct``: the compiled C launch function, set
    where Triton's Python wrapper around it would add nothing (no scratch buffers to allocate)."""

    kernel: Any
    direct: Any
    cooperative: bool
    pdl: bool


def _keep(kernel: Any) -> _Kept:
    run = kernel.run
    plain = getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
    direct = None if plain else getattr(run, "launch", None)
    return _Kept(kernel, direct, getattr(run, "launch_cooperative_grid", False), getattr(run, "launch_pdl", False))


class Launcher:
    """``kernel[grid](*args, **kwargs)`` without Triton's per-call argument binding.

    Triton's ``JITFunction.run`` costs ~35 us of host time per launch here (argument binding,
    specialization, cache key), more than a cast of a few MB takes on the GPU, so small casts
    and grouped layers were launch-bound. The first launch per specialization goes through
    Triton (compiling if needed) and keeps the compiled kernel under our own key (a superset of
    Triton's specialization, so a kept kernel is only reused where Triton would reuse it); later
    launches call it directly, as ``run`` itself does after its lookup. Where no launch hook is
    registered (a profiler such as proton registers them) and the kernel needs no scratch
    buffers, the call goes straight to the compiled C launch function, skipping Triton's
    per-launch metadata dictionary, its two empty hook-chain calls and its scratch-allocation
    wrapper (~80 Python calls per launch with Triton 3.6). Any mismatch with this Triton's
    launcher API turns the shortcut off for good (plain launches, same results). Triton's
    interpreter always takes the plain path.
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        params = getattr(fn, "params", None) or []  # an interpreted function has none
        self.names = [p.name for p in params]
        self.constexpr = [bool(p.is_constexpr) for p in params]
        self.name_set = frozenset(self.names)
        self.kernels: dict[tuple[Any, ...], _Kept] = {}
        self.fast = bool(params) and os.environ.get("TRITON_INTERPRET") != "1"
        self._stream: Any = None  # the active driver's current-stream function, fetched once

    def _key(self, device: int, values: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """``_spec`` of every argument, with its tensor and int cases inlined (a launch's key is
        built from ~20 arguments; a call per argument cost ~10 us of host time per launch)."""
        opts = [(k, v) for k, v in kwargs.items() if k not in self.name_set]
        tensor = torch.Tensor
        return (device, tuple(sorted(opts)) if len(opts) > 1 else tuple(opts), *[
            v if c
            else (v.dtype, v.data_ptr() % 16 == 0) if isinstance(v, tensor)
            else (int, v == 1, v % 16 == 0, -(2**31) <= v < 2**31, v < 2**63) if type(v) is int
            else _spec(v, False)
            for v, c in zip(values, self.constexpr)
        ])

    def __call__(self, grid: Sequence[int], *args: Any, **kwargs: Any) -> None:
        if not self.fast:
            self.fn[tuple(grid)](*args, **kwargs)
            return
        values = [*args, *[kwargs[name] for name in self.names[len(args):]]]
        device = torch.cuda.current_device()
        key = self._key(device, values, kwargs)
        kept = self.kernels.get(key)
        if kept is None:
            kernel = self.fn[tuple(grid)](*args, **kwargs)
            try:
                self.kernels[key] = _keep(kernel.result() if hasattr(kernel, "result") else kernel)
            except AttributeError:  # another Triton's compiled-kernel API: plain launches from now on
                self.fast = False
            return
        g0, g1, g2 = (*grid, 1, 1)[:3]
        try:
            hooks = triton.knobs.runtime
            enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
            # a launch hook (a profiler): Triton's own launch below, which calls it. Not the
            # compiled kernel's wrapper: a hook's TypeError after the launch would look like an
            # API mismatch here, and the retry would run the kernel twice (an ADD kernel too)
            plain = not (_no_hook(enter) and _no_hook(leave))
            if not plain:
                if self._stream is None:
                    self._stream = triton.runtime.driver.active.get_current_stream
                stream = self._stream(device)
                kernel = kept.kernel
                # both calls bind every argument before they launch: a TypeError or AttributeError
                # here means nothing ran, so the plain launch below does not run the kernel twice
                if kept.direct is not None:
                    kept.direct(g0, g1, g2, stream, kernel.function, kept.cooperative, kept.pdl, None, None,
                                kernel.packed_metadata, None, None, None, *values)
                else:  # scratch buffers: the compiled kernel's wrapper allocates them
                    kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata,
                               kernel.launch_metadata(tuple(grid), stream, *values), enter, leave, *values)
        except (AttributeError, TypeError):  # another Triton's launcher API: plain launches from now on
            self.fast, plain = False, True
        if plain:
            self.fn[tuple(grid)](*args, **kwargs)

    def prepare(self, grid: Sequence[int], leading: int, *args: Any, **kwargs: Any) -> Prepared | None:
        """Launch ``kernel[grid](*args, **kwargs)`` now, as a call does, and return a ``Prepared``
        launch of the same kernel and grid that takes only the first ``leading`` arguments anew:
        for a caller that launches it again and again with arguments of the same specialization
        (tensors of the same dtypes, 16-byte aligned where these were; ints with the same
        properties), which it vouches for instead of a key built per launch. None where launches
        here are not the direct kind (Triton's interpreter, another launcher API, a kernel with
        scratch buffers): the caller then launches through ``__call__``."""
        self(grid, *args, **kwargs)
        if not self.fast:
            return None
        values = [*args, *[kwargs[name] for name in self.names[len(args):]]]
        device = torch.cuda.current_device()
        kept = self.kernels.get(self._key(device, values, kwargs))
        if kept is None or kept.direct is None:
            return None
        return Prepared(kept, tuple(grid), tuple(values[leading:]), device)


class Prepared:
    """A kept kernel's launch with its grid and trailing arguments fixed (``Launcher.prepare``):
    ``p(*leading)`` launches on the current stream of the device it was prepared on. Where a
    launch hook is registered (a profiler), it goes through Triton's wrapper as ``Launcher`` does."""

    __slots__ = ("kept", "grid", "g3", "tail", "device", "stream")

    def __init__(self, kept: _Kept, grid: tuple[int, ...], tail: tuple[Any, ...], device: int) -> None:
        self.kept, self.grid, self.tail, self.device = kept, grid, tail, device
        self.g3 = (*grid, 1, 1)[:3]
        self.stream = triton.runtime.driver.active.get_current_stream

    def __call__(self, *leading: Any) -> None:
        kept, (g0, g1, g2) = self.kept, self.g3
        kernel = kept.kernel
        stream = self.stream(self.device)
        hooks = triton.knobs.runtime
        enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
        if _no_hook(enter) and _no_hook(leave):
            kept.direct(g0, g1, g2, stream, kernel.function, kept.cooperative, kept.pdl, None, None,
                        kernel.packed_metadata, None, None, None, *leading, *self.tail)
            return
        values = (*leading, *self.tail)
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(self.grid, stream, *values), enter, leave, *values)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code (``triton.cdiv`` is a Triton constexpr function: a few us of
    argument unwrapping per call, ~25 calls in a grouped layer's step)."""
    return -(-a // b)
