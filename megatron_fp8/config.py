"""YAML -> validated FP8 config: the recipe, and per-layer flags matched by module-name glob.

Example (``configs/tp_block.yaml``)::

    fp8:
      enabled: true
      recipe: blockwise                 # a preset name, or {kind: delayed, margin: 0, ...}
    layers:
      - match: "*.attention.proj"       # fnmatch glob over qualified module names
        save_original_input: true

Unknown keys, bad values, and rules that match no layer are errors naming the key and the fix.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch.distributed as dist
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from torch import nn

from .autocast import FP8State, fp8_autocast
from .recipe import (
    PRESETS,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    Recipe,
)

__all__ = ["RecipeSpec", "LayerRule", "FP8Config", "load_config", "parse_config", "apply_layer_flags"]

_KINDS: dict[str, type] = {
    "delayed": DelayedScaling,
    "current": Float8CurrentScaling,
    "blockwise": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RecipeSpec(_Strict):
    """A recipe written out: ``kind`` plus that recipe's fields (see megatron_fp8.recipe)."""

    kind: Literal["delayed", "current", "blockwise", "mxfp8"]
    fp8_format: Literal["E4M3", "HYBRID"] | None = None
    margin: int | None = None
    amax_history_len: int | None = None
    amax_compute_algo: Literal["max", "most_recent"] | None = None
    power_2_scale: bool | None = None
    amax_epsilon: float | None = None

    def build(self) -> Recipe:
        cls = _KINDS[self.kind]
        fields = self.model_dump(exclude={"kind"}, exclude_none=True)
        allowed = set(cls.__dataclass_fields__)
        wrong = sorted(set(fields) - allowed)
        if wrong:
            raise ValueError(f"fp8.recipe: {wrong} do not apply to kind '{self.kind}'; its fields: {sorted(allowed)}")
        if "fp8_format" in fields:
            fields["fp8_format"] = Format(fields["fp8_format"])
        return cls(**fields)


class LayerRule(_Strict):
    """Flags for every layer whose qualified name matches ``match`` (an fnmatch glob)."""

    match: str = Field(min_length=1)
    save_original_input: bool


class FP8Section(_Strict):
    enabled: bool = True
    recipe: str | RecipeSpec = "blockwise"

    @field_validator("recipe")
    @classmethod
    def _known_preset(cls, v: str | RecipeSpec) -> str | RecipeSpec:
        if isinstance(v, str) and v not in PRESETS:
            raise ValueError(f"unknown recipe preset {v!r}; choose one of {sorted(PRESETS)} or give {{kind: ...}}")
        return v


class FP8Config(_Strict):
    """The whole file: the FP8 section and the per-layer rules (applied in order)."""

    fp8: FP8Section = FP8Section()
    layers: list[LayerRule] = []

    def recipe(self) -> Recipe:
        r = self.fp8.recipe
        return PRESETS[r] if isinstance(r, str) else r.build()

    def autocast(self, fp8_group: dist.ProcessGroup | None = None) -> AbstractContextManager[FP8State]:
        """``fp8_autocast`` with this config's ``enabled`` and recipe."""
        return fp8_autocast(enabled=self.fp8.enabled, fp8_recipe=self.recipe(), fp8_group=fp8_group)


def parse_config(data: dict[str, Any] | None, source: str = "<config>") -> FP8Config:
    """Validate a parsed YAML mapping; errors name the source and the offending key."""
    try:
        cfg = FP8Config.model_validate(data or {})
        cfg.recipe()  # recipe fields are checked by the recipe's own __post_init__
        return cfg
    except ValidationError as e:
        lines = [f"  {'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise ValueError(f"{source}: invalid FP8 config\n" + "\n".join(lines)) from None
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last one
    silently: a second ``recipe:`` would override the first without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice in one mapping (YAML would keep the last)",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | os.PathLike[str]) -> FP8Config:
    """Read and validate a YAML config file; an empty (or comment-only) file and a key given
    twice are errors, not defaults."""
    with open(path) as f:
        try:
            data = yaml.load(f, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        raise ValueError(f"{path}: the file is empty (or only comments); write the fp8: section and/or the "
                         f"layers: rules, e.g. `fp8: {{enabled: true, recipe: blockwise}}`")
    return parse_config(data, str(path))


def apply_layer_flags(model: nn.Module, config: FP8Config, *, names: dict[str, str] | None = None,
                      unmatched: Callable[[str], None] | None = None) -> dict[str, bool]:
    """Set ``save_original_input`` on the layers each rule matches; return ``{name: flag}``.

    ``names``: the name each module's rules match (by its own name in ``model``), e.g. the whole
    model's name of a pipeline stage's layer. A rule that matches no module is an error naming the
    rule and what names look like, or, with ``unmatched``, handed to it (a pipeline stage holds only
    some layers); a rule that matches a module without the flag (not one of our linears) is an error.
    """
    modules = dict(model.named_modules())
    shown = names if names is not None else {n: n for n in modules}
    local = {shown.get(n, n): n for n in modules if n}
    plan: dict[str, bool] = {}
    for i, rule in enumerate(config.layers):  # validate every rule before touching the model
        matched = [n for n in local if fnmatch.fnmatchcase(n, rule.match)]
        if not matched:
            said = (f"layers[{i}].match={rule.match!r} matches no module; module names look like "
                    f"{sorted(local)[:5]}")
            if unmatched is None:
                raise ValueError(said)
            unmatched(said)
        for name in matched:
            module = modules[local[name]]
            if not hasattr(module, "save_original_input"):
                raise ValueError(
                    f"layers[{i}].match={rule.match!r} matches {name} ({type(module).__name__}), which "
                    f"has no save_original_input flag; narrow the glob to megatron_fp8 linears"
                )
            plan[name] = rule.save_original_input  # later rules win
    for name, flag in plan.items():
        modules[local[name]].save_original_input = flag
    return plan
