"""Guards for discarded outputs: the tensor subclass that refuses reads, the module pre-hook
that records consumers (and their ``save_original_input`` flag), the shared status, the errors."""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


class DiscardedOutputError(RuntimeError):
    """A discarded output was read before its recompute."""


class MissingSaveOriginalInputError(RuntimeError):
    """A consumer of a to-be-discarded output saves its own copy (``save_original_input=False``)."""


class _State(enum.Enum):
    CHECKPOINTED = "checkpointed"  # outputs live, consumers being recorded
    DISCARDED = "discarded"  # storage freed, waiting for the hook
    RECOMPUTED = "recomputed"  # storage refilled
    RELEASED = "released"  # no recompute will ever happen (no hook needed grad / graph freed)


@dataclass(eq=False)
class _Status:
    """Shared by a checkpoint and its output tensors (holds no tensors: cannot leak memory)."""

    name: str
    state: _State = _State.CHECKPOINTED
    # (class name, extra_repr, its name or "") of consumers that saved their own copy (save_original_input False)
    copying_consumers: list[tuple[str, str, str]] = field(default_factory=list)

    def check_readable(self, what: str) -> None:
        if self.state is _State.DISCARDED:
            raise DiscardedOutputError(
                f"{what} reads the output of '{self.name}', which was discarded by "
                f"CheckpointWithoutOutput.discard_output_and_register_recompute and is not recomputed "
                f"yet. Fix: only read the output before the discard (move the discard after its last "
                f"consumer), or hook the recompute on a tensor downstream of every consumer."
            )
        if self.state is _State.RELEASED:
            raise DiscardedOutputError(
                f"{what} reads the output of '{self.name}', which was discarded and will never be "
                f"recomputed (no hook tensor needed grad, or its graph was freed). Fix: do not keep "
                f"using an output after discard_output_and_register_recompute."
            )


# ---- the output tensor subclass: refuses reads while discarded ----

_METADATA_OPS = frozenset({
    "__get__", "__hash__", "untyped_storage", "size", "stride", "storage_offset", "dim",
    "numel", "data_ptr", "is_contiguous", "element_size", "register_hook", "nelement",
})


def _func_name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", None) or repr(func)


class _DiscardableTensor(torch.Tensor):
    """An output of ``CheckpointWithoutOutput.checkpoint``: a plain tensor until discarded.

    Every op first checks it is readable, then runs on a plain alias of it and returns plain
    tensors, except views (which share the storage that will be freed): they stay guarded. The
    guard therefore covers forward reads; backward reads are ordered by the hook placement.
    """

    _mf_status: _Status

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        name = _func_name(func)
        guarded = [a for a in _flat_items(args, kwargs) if isinstance(a, _DiscardableTensor)]
        if name in _METADATA_OPS or not guarded:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        for a in guarded:
            a._mf_status.check_readable(f"torch op '{name}'")
        with torch._C.DisableTorchFunctionSubclass():
            # plain aliases (same storage, same autograd history): no kernel, compiled function or
            # autograd.Function ever sees the subclass, and what consumers save is a plain tensor
            out = func(*_unwrapped(args), **dict(zip(kwargs, _unwrapped(list(kwargs.values())))))
        return _guard_views(out, guarded)


def _plain(a: Any) -> Any:
    return a.as_subclass(torch.Tensor) if isinstance(a, _DiscardableTensor) else a


def _unwrapped(args: Sequence[Any]) -> list[Any]:
    return [type(a)(_plain(x) for x in a) if isinstance(a, (list, tuple)) else _plain(a) for a in args]


def _flat_items(args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> Iterator[Any]:
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _wrap(t: torch.Tensor, status: _Status) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        out = t.as_subclass(_DiscardableTensor)
    out._mf_status = status
    return out


def _guard_views(out: Any, guarded: list[_DiscardableTensor]) -> Any:
    """Re-wrap results that alias a guarded storage (views), so reading them stays checked."""
    if isinstance(out, (tuple, list)):
        return type(out)(_guard_views(o, guarded) for o in out)
    if not isinstance(out, torch.Tensor) or isinstance(out, _DiscardableTensor):
        return out
    with torch._C.DisableTorchFunctionSubclass():
        if out.layout is not torch.strided:
            return out
        key = _storage_key(out)
        owner = next((a for a in guarded if _storage_key(a) == key), None)
    return out if owner is None else _wrap(out, owner._mf_status)


# ---- global module pre-hook: records consumers, names the module reading a discarded output ----


class _ModuleWatch:
    """Global module hooks, installed only while some checkpoint needs them: a forward pre-hook
    (positional inputs, checked before the module reads them) and a forward hook with kwargs
    (PyTorch has no global pre-hook with kwargs; keyword inputs are recorded after the call)."""

    users = 0
    handles: list[Any] = []
    recording: list[list[nn.Module]] = []

    @classmethod
    def acquire(cls) -> None:
        if cls.users == 0:
            cls.handles = [
                nn.modules.module.register_module_forward_pre_hook(_on_module_call),
                nn.modules.module.register_module_forward_hook(_on_module_kwargs, with_kwargs=True),
            ]
        cls.users += 1

    @classmethod
    def release(cls) -> None:
        cls.users -= 1
        if cls.users == 0:
            for h in cls.handles:
                h.remove()
            cls.handles = []


@contextlib.contextmanager
def recording_modules() -> Iterator[list[nn.Module]]:
    """The modules called inside the block, in call order (the global hooks installed meanwhile)."""
    modules: list[nn.Module] = []
    _ModuleWatch.acquire()
    _ModuleWatch.recording.append(modules)
    try:
        yield modules
    finally:
        _ModuleWatch.recording.pop()
        _ModuleWatch.release()


def _on_module_kwargs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    _check_consumer(module, _flat_items((), kwargs))


def _on_module_call(module: nn.Module, args: tuple[Any, ...]) -> None:
    if _ModuleWatch.recording:
        _ModuleWatch.recording[-1].append(module)
    _check_consumer(module, _flat_items(args))


def _check_consumer(module: nn.Module, items: Iterator[Any]) -> None:
    for a in items:
        if not isinstance(a, _DiscardableTensor):
            continue
        status = a._mf_status
        status.check_readable(f"module {type(module).__name__}")
        saves_original = getattr(module, "save_original_input", True)  # the flag as of this forward
        if status.state is _State.CHECKPOINTED and not saves_original:
            status.copying_consumers.append((type(module).__name__, module.extra_repr(),
                                             getattr(module, "name", None) or ""))


_watching: weakref.WeakSet[_Status] = weakref.WeakSet()


def _release_watch(status: _Status | None) -> None:
    """Give back the module watch taken by ``checkpoint`` (once per checkpoint)."""
    if status is not None and status in _watching:
        _watching.discard(status)
        _ModuleWatch.release()


def _release_status(status: _Status) -> None:
    """The checkpoint's graph was freed: a discarded output can never be recomputed now."""
    if status.state is _State.DISCARDED or status.state is _State.CHECKPOINTED:
        status.state = _State.RELEASED
    _release_watch(status)
