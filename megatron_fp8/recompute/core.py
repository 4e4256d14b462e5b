"""``CheckpointWithoutOutput``: the autograd function, the checkpoint's lifecycle (checkpoint,
discard, recompute in the hook, write back into the discarded storage) and the functional form."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .guard import (
    MissingSaveOriginalInputError,
    Outputs,
    _DiscardableTensor,
    _ModuleWatch,
    _release_status,
    _release_watch,
    _State,
    _Status,
    _storage_key,
    _watching,
    _wrap,
    recording_modules,
)
from .inputs import backprop, replay_arguments, save_arguments
from .replay import _Environment


class _CheckpointFunction(torch.autograd.Function):
    """Runs ``fn`` without a graph, saves its tensor inputs; backward replays and backprops."""

    @staticmethod
    def forward(ctx: Any, ckpt: CheckpointWithoutOutput, anchor: torch.Tensor | None,
                *args: Any) -> Any:
        ctx.ckpt = ckpt
        ckpt._attach(ctx)
        ctx.save_for_backward(*save_arguments(ctx, args))
        ctx.recomputed = None
        return ckpt._run_forward(args)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ckpt: CheckpointWithoutOutput = ctx.ckpt
        if ctx.recomputed is None:
            ckpt._recompute_for_backward(ctx)
        outputs, inputs = ctx.recomputed
        ctx.recomputed = None  # once: the recomputed graph is freed by this backward
        return (None, None, *backprop(outputs, grads, inputs))


def _as_tuple(outputs: Any, name: str) -> tuple[torch.Tensor, ...]:
    if isinstance(outputs, torch.Tensor):
        return (outputs,)
    if isinstance(outputs, (tuple, list)) and outputs and all(isinstance(o, torch.Tensor) for o in outputs):
        return tuple(outputs)
    raise TypeError(f"CheckpointWithoutOutput('{name}'): fn must return a tensor or a tuple of "
                    f"tensors, got {type(outputs).__name__}")


def _may_own_params(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` may use parameters needing grad (then its outputs need grad even when no
    input does). Exact for modules and their bound methods; assumed for other callables."""
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return any(p.requires_grad for p in owner.parameters())
    return True


def _default_name(fn: Callable[..., Any]) -> str:
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class CheckpointWithoutOutput:
    """One output-discarding recompute: ``checkpoint`` once, then
    ``discard_output_and_register_recompute`` once (see the module docstring).

    Args:
        name: how errors name the checkpointed computation (default: ``fn``'s class or name).
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        self._status: _Status | None = None
        self._fn: Callable[..., Any] | None = None
        self._env: _Environment | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()  # plain tensors owning the storages
        self._single = False
        self._ctx: weakref.ref[Any] | None = None
        self._versions: list[int] = []
        self._nbytes: dict[int, int] = {}

    @property
    def state(self) -> str:
        """``"new"``, ``"eager"`` (no grad), ``"checkpointed"``, ``"discarded"``,
        ``"recomputed"`` or ``"released"``."""
        if self._status is None:
            return "eager" if self._fn is not None else "new"
        return self._status.state.value

    # ---- forward ----
    def checkpoint(self, fn: Callable[..., Any], *args: Any) -> Outputs:
        """Run ``fn(*args)`` keeping no graph and saving only ``args``; return its outputs."""
        if self._fn is not None:
            raise RuntimeError(f"CheckpointWithoutOutput('{self.name}') is one-shot: make a new one "
                               f"per forward call")
        self._fn, self.name = fn, self.name or _default_name(fn)
        if not torch.is_grad_enabled():
            return fn(*args)  # evaluation: nothing to recompute, nothing to discard
        self._status = _Status(self.name)
        self._env = _Environment.capture(args)
        needs_anchor = not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        anchor = torch.empty(0, requires_grad=True) if needs_anchor and _may_own_params(fn) else None
        _watching.add(self._status)
        _ModuleWatch.acquire()
        try:
            out = _CheckpointFunction.apply(self, anchor, *args)
        except BaseException:
            self._release()
            raise
        return out

    def _run_forward(self, args: tuple[Any, ...]) -> Outputs:
        """Inside the autograd function: run ``fn`` once, remember what a recompute needs."""
        assert self._fn is not None and self._env is not None and self._status is not None
        with recording_modules() as modules, torch.no_grad():
            raw = self._fn(*args)
        outputs = _as_tuple(raw, self.name or "")
        self._check_no_input_alias(outputs, args)
        self._env.record_delayed_scales(modules)
        self._outputs, self._single = outputs, isinstance(raw, torch.Tensor)
        self._nbytes = {_storage_key(o): o.untyped_storage().nbytes() for o in outputs}
        self._versions = [o._version for o in outputs]
        wrapped = tuple(_wrap(o, self._status) for o in outputs)
        return wrapped[0] if self._single else wrapped

    def _check_no_input_alias(self, outputs: tuple[torch.Tensor, ...], args: tuple[Any, ...]) -> None:
        inputs = {_storage_key(a) for a in args if isinstance(a, torch.Tensor)}
        if any(_storage_key(o) in inputs for o in outputs):
            raise ValueError(
                f"CheckpointWithoutOutput('{self.name}'): an output shares storage with an input "
                f"(fn returned an input or a view of one); discarding it would free the input. "
                f"Checkpoint only the computation that makes new tensors."
            )

    # ---- discard ----
    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Free the outputs' storage; recompute them when the gradient reaches ``hook_tensor``
        (or the first of several), i.e. before the backward of its producer runs.

        ``hook_tensor`` must be produced downstream of every consumer of the outputs (typically
        the consumer's output). Raises ``MissingSaveOriginalInputError`` when a consumer saves
        its own copy of the output, and leaves the outputs in place in that case.
        """
        if self._status is None:
            if self._fn is None:
                raise RuntimeError(f"CheckpointWithoutOutput('{self.name}'): call checkpoint() first")
            return  # eager (no grad): no-op
        if self._status.state is not _State.CHECKPOINTED:
            raise RuntimeError(f"CheckpointWithoutOutput('{self.name}'): discard called twice "
                               f"(state {self._status.state.value})")
        hooks = self._hook_tensors(hook_tensor)
        self._check_consumers()
        self._check_not_modified()
        for storage in self._unique_storages().values():
            storage.resize_(0)
        self._status.state = _State.DISCARDED
        ctx = self._ctx() if self._ctx is not None else None
        hooks = [t for t in hooks if t.requires_grad]
        if not hooks or ctx is None:
            self._release()  # no backward will ever need the outputs: drop the inputs now
            return
        fire = functools.partial(_fire_recompute, self, ctx)
        for t in hooks:
            t.register_hook(fire)

    def _hook_tensors(self, hook_tensor: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
        hooks = [hook_tensor] if isinstance(hook_tensor, torch.Tensor) else list(hook_tensor)
        if not hooks or not all(isinstance(t, torch.Tensor) for t in hooks):
            raise TypeError(f"CheckpointWithoutOutput('{self.name}'): hook_tensor must be a tensor or a "
                            f"non-empty sequence of tensors")
        keys = set(self._nbytes)
        for t in hooks:
            if isinstance(t, _DiscardableTensor) or _storage_key(t) in keys:
                raise ValueError(f"CheckpointWithoutOutput('{self.name}'): hook_tensor is an output of the "
                                 f"checkpoint itself; hook a tensor produced by the consumers instead")
            if t.requires_grad and t.grad_fn is None:
                raise ValueError(f"CheckpointWithoutOutput('{self.name}'): hook_tensor is a leaf; hook a "
                                 f"tensor produced by the consumers of the outputs")
        return hooks

    def _check_consumers(self) -> None:
        assert self._status is not None
        for cls_name, desc, layer in self._status.copying_consumers:
            raise MissingSaveOriginalInputError(
                f"CheckpointWithoutOutput('{self.name}'): its output feeds {cls_name}"
                f"{f'({layer})' if layer else ''} ({desc or 'no repr'}) with save_original_input=False, so "
                f"that layer saved its own FP8 copy of the input and discarding the output frees no memory. "
                f"Fix: build the {cls_name} with save_original_input=True (or set `.save_original_input = "
                f"True` on it before the forward; under Megatron-LM, a MEGATRON_FP8_CONFIG rule turning it off "
                f"conflicts with --recompute-modules: drop one of the two). Checked with FP8 off too."
            )

    def _check_not_modified(self) -> None:
        if [o._version for o in self._outputs] != self._versions:
            raise RuntimeError(
                f"CheckpointWithoutOutput('{self.name}'): an output was modified in place after "
                f"checkpoint(); the recompute could not reproduce it. Use an out-of-place op."
            )

    def _unique_storages(self) -> dict[int, torch.UntypedStorage]:
        return {_storage_key(o): o.untyped_storage() for o in self._outputs}

    # ---- backward ----
    def _fire(self, ctx: Any) -> None:
        """The hook: recompute once, write back into the discarded storages."""
        if self._status is None or self._status.state is not _State.DISCARDED:
            return  # already recomputed this step (a second hook tensor, or a second hook call)
        outputs = self._replay(ctx)
        self._write_back(outputs)
        self._status.state = _State.RECOMPUTED
        self._drop_references()

    def _recompute_for_backward(self, ctx: Any) -> None:
        """The autograd function's backward ran with no recompute done by the hook."""
        state = self._status.state if self._status is not None else None
        if state is _State.CHECKPOINTED:  # never discarded: the outputs are intact, just replay
            self._replay(ctx)
            self._status.state = _State.RECOMPUTED  # type: ignore[union-attr]
            self._drop_references()
            return
        raise RuntimeError(
            f"CheckpointWithoutOutput('{self.name}'): backward reached the checkpoint (state "
            f"{state.value if state else 'eager'}) without the recompute hook having run once for "
            f"this backward; the hook tensor must be downstream of every use of the outputs, and a "
            f"second backward through the same graph (retain_graph) is not supported."
        )

    def _replay(self, ctx: Any) -> tuple[torch.Tensor, ...]:
        assert self._fn is not None and self._env is not None
        saved = ctx.saved_tensors
        inputs = replay_arguments(ctx, saved, [t.requires_grad for t in saved])
        with self._env.replay(), torch.enable_grad():
            outputs = _as_tuple(self._fn(*inputs), self.name or "")
        ctx.recomputed = (outputs, inputs)
        return outputs

    def _write_back(self, recomputed: tuple[torch.Tensor, ...]) -> None:
        """Copy the recomputed values into the original storages (no version bump: the
        consumers' saved tensors stay valid)."""
        for old, new in zip(self._outputs, recomputed):
            same = (old.shape == new.shape and old.dtype == new.dtype and old.stride() == new.stride()
                    and old.storage_offset() == new.storage_offset()
                    and new.untyped_storage().nbytes() == self._nbytes[_storage_key(old)])
            if not same:
                raise RuntimeError(
                    f"CheckpointWithoutOutput('{self.name}'): the recompute returned a tensor laid out "
                    f"differently from the forward's ({tuple(new.shape)}, stride {new.stride()} vs "
                    f"{tuple(old.shape)}, stride {old.stride()}); fn must be deterministic in layout."
                )
        written: set[int] = set()
        with torch.no_grad():
            for old, new in zip(self._outputs, recomputed):
                key = _storage_key(old)
                if key not in written:
                    written.add(key)
                    old.untyped_storage().resize_(self._nbytes[key])
                    old.untyped_storage().copy_(new.untyped_storage())
            for old, new in zip(self._outputs, recomputed):
                _share_storage(new, old)

    # ---- lifetime ----
    def _attach(self, ctx: Any) -> None:
        self._ctx = weakref.ref(ctx)
        weakref.finalize(ctx, _release_status, self._status)

    def _drop_references(self) -> None:
        self._outputs, self._env, self._ctx = (), None, None
        _release_watch(self._status)

    def _release(self) -> None:
        if self._status is not None and self._status.state is not _State.RECOMPUTED:
            self._status.state = _State.RELEASED
        self._drop_references()


def _share_storage(new: torch.Tensor, old: torch.Tensor) -> None:
    """Point the recomputed tensor at the refilled storage (equal bytes), so the recomputed copy
    is freed at once unless the recomputed graph saved it: no second copy lives until backward."""
    with torch.autograd._unsafe_preserve_version_counter(new):
        new.set_(old.untyped_storage(), old.storage_offset(), old.size(), old.stride())


def _fire_recompute(ckpt: CheckpointWithoutOutput, ctx: Any, grad: torch.Tensor) -> None:
    ckpt._fire(ctx)


def recompute_discarding_output(
    fn: Callable[..., Any],
    args: Sequence[Any],
    consumer: Callable[[Any], Any],
    *,
    name: str | None = None,
) -> Any:
    """Functional form: ``consumer(fn(*args))`` with ``fn``'s output discarded after
    ``consumer`` ran and recomputed when the gradient reaches ``consumer``'s tensor outputs.

    ``consumer`` receives ``fn``'s output (a tensor or tuple) and returns a tensor or a
    tuple/list of tensors; every consumer of ``fn``'s output must run inside it.
    """
    ckpt = CheckpointWithoutOutput(name)
    out = ckpt.checkpoint(fn, *args)
    result = consumer(out)
    items = [result] if isinstance(result, torch.Tensor) else list(result)
    hooks = [t for t in items if isinstance(t, torch.Tensor)]
    ckpt.discard_output_and_register_recompute(hooks)
    return result
