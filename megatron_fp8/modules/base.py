"""FP8Module: per-layer quantizers for the active recipe, the FP8 weight cache, extra state.

A layer builds its quantizers when it first runs under a recipe and keeps them while the recipe
stays the same (delayed scaling's history lives in them). ``get_extra_state`` /
``set_extra_state`` carry that state through ``state_dict`` so a checkpoint restores it. Loading
replaces the layer's state whole (its quantizers and cached FP8 weights go; the loaded state waits
for the next forward, which refuses it, naming both recipes, only where it holds delayed-scaling
history for another recipe), so a checkpoint computes the same in a used layer as in a fresh one.

``is_first_microbatch`` is also an attribute, as on Megatron's Transformer Engine layers:
Megatron's ``set_is_first_microbatch()`` sets it to True on every module that has it at the
first micro-batch of a step; a forward that gets no ``is_first_microbatch`` argument uses the
attribute and then sets it to False, so the next micro-batches reuse the FP8 weights. Left at
None (the default, and what plain PyTorch loops see) the weights are cast on every forward.
"""

from __future__ import annotations

import io
import math
import warnings
from typing import Any

import torch
from torch import nn

from ..autocast import current_fp8_state
from ..ops.linear import LinearQuantizers, cast_weight
from ..quant.quantizers import make_quantizer
from ..quant.tensor import QuantizedTensor
from ..quant.tensor_scaling import check_delayed_state
from ..recipe import Recipe, TensorRole

_ROLE_WORDS = {TensorRole.INPUT: "input", TensorRole.WEIGHT: "weight", TensorRole.GRAD_OUTPUT: "output gradient"}


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A uint8 tensor's bytes without NumPy (which is not a dependency): FP8 extra state blobs."""
    return bytes(t.detach().cpu().reshape(-1).tolist())


def encode_state(state: dict[str, Any]) -> torch.Tensor:
    """An FP8 extra-state dict as the uint8 tensor ``state_dict`` carries (``torch.save``'s bytes)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def decode_state(blob: torch.Tensor, where: str) -> Any:
    """``encode_state``'s input back, read onto the CPU (a GPU checkpoint loads without a GPU); a
    ValueError naming ``where`` (the layer and its state_dict key) where the bytes are not ours."""
    try:
        return torch.load(io.BytesIO(tensor_bytes(blob)), weights_only=True, map_location="cpu")
    except Exception as e:
        raise ValueError(f"{where} is not megatron_fp8 FP8 state ({type(e).__name__}: {e})") from None


def _states(q: LinearQuantizers) -> dict[str, Any]:
    """The saved state of a weight's three quantizers, its tensors on the CPU."""
    return {role: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                   for k, v in getattr(q, role).state_dict().items()}
            for role in ("input", "weight", "grad_output")}


def default_init(w: torch.Tensor) -> None:
    """``nn.Linear``'s weight initialisation (used when no ``init_method`` is given)."""
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))


def _before_load(module: FP8Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Checkpoints without FP8 state load (``nn.Linear``'s, or Megatron's own layers, which write
    ``_extra_state=None``); remember the key for errors about the state."""
    module._extra_state_key = f"{prefix}_extra_state"
    state_dict.setdefault(module._extra_state_key, None)


class FP8Module(nn.Module):
    """Base of every FP8 layer: recipe-bound quantizers and the cached FP8 weights."""

    def __init__(self) -> None:
        super().__init__()
        self._fp8_recipe: Recipe | None = None
        self._quantizers: dict[str, LinearQuantizers] = {}
        self._w_cache: dict[str, QuantizedTensor] = {}
        self._pending_state: dict[str, Any] | None = None
        self.is_first_microbatch: bool | None = None  # Megatron's attribute (module docstring)
        self._extra_state_key = "_extra_state"  # where load_state_dict found our FP8 state (errors name it)
        self._fp8_mode: Any = ()  # the recipe of the last forward (None: FP8 off); () before the first
        # a plain function, given the module: a bound method kept in the module's own hook dict
        # would make every layer a reference cycle, its GPU memory freed only by the cyclic GC
        self.register_load_state_dict_pre_hook(_before_load)

    def microbatch_flag(self, is_first_microbatch: bool | None) -> bool | None:
        """The forward's ``is_first_microbatch``: the argument where given, else the attribute,
        which then turns False (a step's later micro-batches reuse the cached FP8 weights)."""
        if is_first_microbatch is not None:
            return is_first_microbatch
        flag = self.is_first_microbatch
        if flag:
            self.is_first_microbatch = False
        return flag

    def fp8_mode_changed(self, recipe: Recipe | None, group: Any) -> None:
        """Called at the first forward and whenever the recipe changes (None: FP8 off), before
        the layer runs with it; parallel layers check that their peers agree."""

    def no_fp8_region(self) -> None:
        """Called when the layer runs outside every FP8 region (FP8 off); subclasses that know
        FP8 was asked for (Megatron's ``config.fp8``) raise here instead of running silently in
        high precision."""

    def fp8_quantizers(self, key: str = "weight") -> LinearQuantizers | None:
        """Quantizers of weight ``key`` under the active region's recipe (None with FP8 off)."""
        state = current_fp8_state()
        mode = state.recipe if state is not None and state.enabled else None
        previous = self._fp8_mode
        if mode is not previous:  # identity first: a region's recipe object is usually the same
            if mode != self._fp8_mode:
                self.fp8_mode_changed(mode, state.group if state is not None else None)
            self._fp8_mode = mode
        if state is None:
            if isinstance(previous, Recipe) and torch._C._current_graph_task_id() != -1:
                raise RuntimeError(
                    f"{self._fp8_owner()}: its forward runs again inside a backward pass outside every FP8 region, "
                    f"after running under {previous.describe()}: an activation checkpoint's recompute (e.g. "
                    f"torch.utils.checkpoint), which would compute the gradients in high precision. Checkpoint "
                    f"with megatron_fp8.recompute.checkpoint_layers, which recomputes in the forward's FP8 state")
            self.no_fp8_region()
            return None
        if not state.enabled:
            return None
        if state.recipe is not self._fp8_recipe and state.recipe != self._fp8_recipe:
            if any(s for q in self._quantizers.values() for s in (q.input.state_dict(),)):
                warnings.warn(
                    f"{type(self).__name__}{f'({self.name})' if getattr(self, 'name', None) else ''}: the FP8 "
                    f"recipe changed from {self._fp8_recipe.describe()} to {state.recipe.describe()}; "
                    f"its delayed-scaling history is dropped (checkpoint it first to keep it)",
                    RuntimeWarning, stacklevel=3)
            self._fp8_recipe, self._quantizers, self._w_cache = state.recipe, {}, {}
        q = self._quantizers.get(key)
        if q is None:
            name = self._fp8_owner() + ("" if key == "weight" else f" expert {key[6:]}" if key[6:].isdigit()
                                        else f" {key}")
            device = getattr(self, key).device
            q = LinearQuantizers(*(
                make_quantizer(state.recipe, role, name=f"{name} {_ROLE_WORDS[role]}", device=device)
                for role in (TensorRole.INPUT, TensorRole.WEIGHT, TensorRole.GRAD_OUTPUT)
            ))
            self._restore_pending(key, q)  # raises (keeping the loaded state) under another recipe
            self._quantizers[key] = q
        for quantizer in (q.input, q.grad_output):  # the weight is never sharded along tokens
            if hasattr(quantizer, "group"):
                quantizer.group = state.group  # type: ignore[attr-defined]
        return q

    def fp8_weight(self, key: str, q: LinearQuantizers, is_first_microbatch: bool | None) -> QuantizedTensor:
        """Cast weight ``key`` rowwise and columnwise; reuse the cast while
        ``is_first_microbatch`` is False (Megatron's micro-batch convention)."""
        if is_first_microbatch is False and key in self._w_cache:
            return self._w_cache[key]
        return self._cache_fp8_weight(key, cast_weight(q.weight, getattr(self, key)), is_first_microbatch)

    def _cache_fp8_weight(self, key: str, value: Any, is_first_microbatch: bool | None) -> Any:
        """Keep ``value`` under ``key`` for the next micro-batches, or drop what is kept there when
        ``is_first_microbatch`` is None (no micro-batch reuse)."""
        if is_first_microbatch is None:
            self._w_cache.pop(key, None)
        else:
            self._w_cache[key] = value
            if isinstance(value, QuantizedTensor):
                value.cached = True
        return value

    # ---- checkpointing of FP8 state (delayed-scaling histories) ----
    def get_extra_state(self) -> torch.Tensor:
        pending = self._pending_state or {}
        quantizers = dict(pending.get("quantizers", {}))  # loaded, not yet claimed by a forward
        recipe = pending.get("recipe")
        current = self._fp8_recipe.describe() if self._fp8_recipe is not None else None
        if quantizers and current is not None and current != recipe:
            # the loaded state waits for its own recipe (a forward under this one refused it): it
            # stays under its own label; state this recipe made since is not the checkpoint's
            if any(entry for q in self._quantizers.values() for entry in _states(q).values()):
                warnings.warn(f"{self._fp8_owner()}: the FP8 state loaded for {recipe} is still unclaimed, so "
                              f"get_extra_state saves it and leaves out the state made since under {current}",
                              RuntimeWarning, stacklevel=2)
        else:
            quantizers.update({key: _states(q) for key, q in self._quantizers.items()})
            recipe = current if current is not None else recipe
        return encode_state({"recipe": recipe, "quantizers": quantizers})

    def set_extra_state(self, state: Any) -> None:
        """Load the FP8 state ``get_extra_state`` wrote, replacing the layer's own: the quantizers
        made so far and the cached FP8 weights go, and the next forward restores the loaded state
        (or refuses it there, naming both recipes, when it runs under another recipe and the state
        holds any: only delayed scaling keeps some). A checkpoint without FP8 state (None, an empty
        tensor: ``nn.Linear``'s, megatron-core's own layers', one saved before any FP8 step) leaves
        the layer as a fresh one is. The blob is read onto the CPU (a GPU checkpoint loads on a
        machine without one); the quantizers move it to their device."""
        if state is not None and not (isinstance(state, torch.Tensor) and state.numel() == 0):
            state = self._read_state(state)
        else:
            state = None
        self._quantizers, self._w_cache, self._fp8_recipe = {}, {}, None
        self._pending_state = state

    def _read_state(self, state: Any) -> dict[str, Any] | None:
        """The checked contents of an extra-state blob, without the quantizers that keep no state
        (None where none keeps any); a ValueError naming the layer and key where it is not ours."""
        where = f"{self._fp8_owner()}: state_dict key {self._extra_state_key!r}"
        if isinstance(state, torch.Tensor):
            state = decode_state(state, where)
        if not isinstance(state, dict) or not isinstance(state.get("quantizers"), dict):
            raise ValueError(f"{where}: unrecognised FP8 extra state {type(state).__name__}; expected the dict "
                             f"that get_extra_state writes")
        kept = {}
        for key, roles in state["quantizers"].items():
            for role, entry in roles.items():
                if entry:  # per-tensor delayed scaling's history and scale (other recipes keep none)
                    check_delayed_state(entry, f"{where}, quantizer {key}:{role}")
            if any(roles.values()):
                kept[key] = roles
        return {**state, "quantizers": kept} if kept else None

    def _fp8_owner(self) -> str:
        layer = getattr(self, "name", None)
        return f"{type(self).__name__}({layer})" if layer else type(self).__name__

    def adopt_name(self, name: str) -> None:
        """Name a layer built without a name after its place in a model (the Megatron plug-in
        passes its module path, ``decoder.layers.0.self_attention.linear_qkv``), so that its
        warnings and errors say which layer; quantizers made already are renamed too. A layer
        that has a name keeps it."""
        if getattr(self, "name", None) or not name:
            return
        old = self._fp8_owner()
        self.name = name
        new = self._fp8_owner()
        if hasattr(self, "_owner"):  # the name its own messages use (parallel and grouped layers)
            self._owner = new
        for q in self._quantizers.values():
            for t in (q.input, q.weight, q.grad_output):
                if t.name.startswith(old):
                    t.name = new + t.name[len(old):]

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``nn.Module._apply`` (``.to()``, ``.cuda()``, ``.half()``...): the cached FP8 weights
        were cast from the parameters before the move, so they go."""
        self._w_cache = {}
        return super()._apply(fn, recurse)

    def _restore_pending(self, key: str, q: LinearQuantizers) -> None:
        """Load saved quantizer state once a quantizer of the same recipe exists."""
        st = self._pending_state
        if not st or key not in st["quantizers"]:
            return
        if self._fp8_recipe is not None and st["recipe"] != self._fp8_recipe.describe():
            raise ValueError(
                f"{self._fp8_owner()}: the FP8 state loaded from {self._extra_state_key!r} is for {st['recipe']}, "
                f"but the layer now runs {self._fp8_recipe.describe()}; run it under the checkpoint's recipe to "
                f"resume (the loaded state is kept until then), or load the checkpoint with that state removed"
            )
        for role in ("input", "weight", "grad_output"):
            getattr(q, role).load_state_dict(st["quantizers"][key][role])
        del st["quantizers"][key]
