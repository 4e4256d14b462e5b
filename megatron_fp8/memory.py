"""Saved-activation accounting: what autograd keeps for backward, by storage and by module.

``track_saved_tensors()`` hooks ``torch.autograd.graph.saved_tensors_hooks`` for its region and
records every tensor saved for backward. Storages are deduplicated (an input saved by two
modules is counted once, for the first module that saved it), so "the flagged layer adds zero
bytes" is a statement about storages, not tensor objects. Parameters and FP8 copies of
parameters are filed separately from activations.

The tracker holds references to the storages it saw until the region ends; ``live_bytes()``
reads their *current* size, so a storage freed by ``resize_(0)`` (output-discarding recompute)
shows as gone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["SavedTensor", "SavedTensors", "track_saved_tensors", "audit"]


@dataclass
class SavedTensor:
    """One unique storage saved for backward."""

    storage: torch.UntypedStorage
    nbytes: int
    module: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_parameter: bool


def keeps_saved_tensors(pack: Any) -> Any:
    """Mark a saved-tensor pack hook of ours that hands autograd the tensor itself (it only
    looks): a per-layer CUDA graph may capture under it (``ops.graphed``), not under another's
    (activation checkpointing, offloading), whose saves a capture cannot hold."""
    pack.keeps_saved_tensors = True
    return pack


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, a view of one (``F.linear`` saves ``weight.t()``), or an FP8 copy of one."""
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter) or bool(getattr(t, "_mf_param_derived", False))


@dataclass
class SavedTensors:
    """Records of one region. ``total_bytes``: every unique storage; ``activation_bytes``:
    those that are not parameters (nor FP8 copies of parameters)."""

    records: list[SavedTensor] = field(default_factory=list)
    _seen: dict[int, SavedTensor] = field(default_factory=dict)

    def add(self, t: torch.Tensor, module: str) -> None:
        st = t.untyped_storage()
        # Identity of the storage itself (held below, so never reused while recorded): an address
        # is not, once a recorded storage is freed by resize_(0) and its memory handed out again.
        key = st._cdata
        if key in self._seen:
            return
        rec = SavedTensor(st, st.nbytes(), module, tuple(t.shape), t.dtype, _is_parameter(t))
        self._seen[key] = rec
        self.records.append(rec)

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    @property
    def activation_bytes(self) -> int:
        return sum(r.nbytes for r in self.records if not r.is_parameter)

    @property
    def parameter_bytes(self) -> int:
        return sum(r.nbytes for r in self.records if r.is_parameter)

    def live_bytes(self, activations_only: bool = True) -> int:
        """Current bytes of the recorded storages (a storage resized to 0 counts 0)."""
        return sum(r.storage.nbytes() for r in self.records if not (activations_only and r.is_parameter))

    def by_module(self, activations_only: bool = False) -> dict[str, int]:
        """``{module qualified name (or class name): bytes}`` of the storages it saved first."""
        out: dict[str, int] = {}
        for r in self.records:
            if activations_only and r.is_parameter:
                continue
            out[r.module] = out.get(r.module, 0) + r.nbytes
        return out

    def table(self) -> str:
        rows = [f"{'module':40s} {'shape':>22s} {'dtype':>16s} {'bytes':>12s}  kind"]
        for r in self.records:
            kind = "param" if r.is_parameter else "activation"
            rows.append(f"{r.module:40s} {str(r.shape):>22s} {str(r.dtype):>16s} {r.nbytes:12d}  {kind}")
        return "\n".join(rows)


@contextlib.contextmanager
def track_saved_tensors(model: nn.Module | None = None) -> Iterator[SavedTensors]:
    """Record what autograd saves inside the block.

    ``model``: names modules by their qualified name in it; without it, by class name. Tensors
    saved outside any module (plain functions) are filed under ``"<no module>"``.
    """
    saved = SavedTensors()
    names: dict[int, str] = {}
    if model is not None:
        names = {id(m): (n or type(m).__name__) for n, m in model.named_modules()}
    stack: list[str] = []

    def pre(mod: nn.Module, args: object) -> None:
        stack.append(names.get(id(mod), type(mod).__name__))

    def post(mod: nn.Module, args: object, out: object) -> None:
        if stack:
            stack.pop()

    @keeps_saved_tensors
    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(t, stack[-1] if stack else "<no module>")
        return t

    h1 = nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = nn.modules.module.register_module_forward_hook(post, always_call=True)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield saved
    finally:
        h1.remove()
        h2.remove()


def audit(model: nn.Module, step: Any) -> Any:
    """Where ``save_original_input`` and output-discarding recompute pay or cost in ``model``:
    ``megatron_fp8.audit.audit`` (run ``step()``, one forward+backward, once)."""
    from .audit import audit as _audit  # the audit builds on this module

    return _audit(model, step)
