"""Replaying the forward's environment for a recompute: RNG (CPU, CUDA, Megatron's tracker), the
FP8 region, torch autocast, and the delayed-scaling scales the forward cast with."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..autocast import FP8State, current_fp8_state, fp8_step, resume_region
from ..modules.base import FP8Module
from ..quant.quantizers import DelayedScalingQuantizer


def _megatron_rng_tracker() -> Any:
    """Megatron's CUDA RNG tracker, when Megatron is in use (already imported: no import cost)."""
    mod = sys.modules.get("megatron.core.tensor_parallel.random")
    return mod.get_cuda_rng_tracker() if mod is not None else None


@dataclass
class _RngState:
    cpu: torch.Tensor
    cuda: dict[int, torch.Tensor]
    tracker: dict[str, Any] | None

    @classmethod
    def capture(cls, devices: set[int]) -> _RngState:
        cuda = {d: torch.cuda.get_rng_state(d) for d in devices}
        tracker = _megatron_rng_tracker() if devices else None
        return cls(torch.get_rng_state(), cuda, dict(tracker.get_states()) if tracker else None)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for d, s in self.cuda.items():
            torch.cuda.set_rng_state(s, d)
        tracker = _megatron_rng_tracker() if self.tracker is not None else None
        if tracker is not None:
            tracker.set_states(dict(self.tracker))


def _cuda_devices(args: Sequence[Any]) -> set[int]:
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return set()
    devs = {a.device.index for a in args if isinstance(a, torch.Tensor) and a.is_cuda}
    return {d for d in devs if d is not None} | {torch.cuda.current_device()}


def _amp_devices() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


@dataclass
class _Environment:
    """Everything besides the inputs that decides ``fn``'s output."""

    rng: _RngState
    cuda_devices: set[int]
    fp8: FP8State | None
    amp: dict[str, tuple[bool, torch.dtype]]
    amp_cache: bool
    delayed_scales: list[tuple[DelayedScalingQuantizer, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def capture(cls, args: Sequence[Any]) -> _Environment:
        devices = _cuda_devices(args)
        amp = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _amp_devices()}
        return cls(_RngState.capture(devices), devices, current_fp8_state(), amp,
                   torch.is_autocast_cache_enabled())

    def record_delayed_scales(self, modules: list[nn.Module]) -> None:
        """Remember the scale each delayed-scaling input/weight quantizer of ``fn`` used."""
        seen: set[int] = set()
        for m in modules:
            if not isinstance(m, FP8Module):
                continue
            for lq in m._quantizers.values():
                for q in (lq.input, lq.weight):
                    if isinstance(q, DelayedScalingQuantizer) and id(q) not in seen:
                        seen.add(id(q))
                        self.delayed_scales.append((q, q.scale))

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_replayed_rng(self.rng, self.cuda_devices))
            stack.enter_context(resume_region(self.fp8))
            stack.enter_context(_frozen_delayed_scales(self.delayed_scales))
            for dev, (enabled, dtype) in self.amp.items():
                stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.amp_cache))
            yield


@contextlib.contextmanager
def _replayed_rng(state: _RngState, devices: set[int]) -> Iterator[None]:
    """Run with the forward's RNG state, then continue the caller's RNG stream untouched."""
    now = _RngState.capture(devices)
    state.restore()
    try:
        yield
    finally:
        now.restore()


@contextlib.contextmanager
def _frozen_delayed_scales(scales: list[tuple[DelayedScalingQuantizer, torch.Tensor]]) -> Iterator[None]:
    """Cast with the forward's scales, record amaxes into a throwaway history, roll nothing."""
    saved = [(q, q.scale, q.amax_history, q.step) for q, _ in scales]
    for q, scale in scales:
        q.scale, q.amax_history, q.step = scale, q.amax_history.clone(), fp8_step()
    try:
        yield
    finally:
        for q, scale, hist, step in saved:
            q.scale, q.amax_history, q.step = scale, hist, step
