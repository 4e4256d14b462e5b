"""The FP8 region from Megatron's FP8 settings: ``fp8_context(config)`` is our
``fp8_autocast`` with the recipe that Megatron's TE path would have built.

Megatron's TE path wraps the forward in Transformer Engine's ``fp8_autocast``; with
megatron_fp8's layers wrap it in ``fp8_context(config)`` (or ``FP8Config.autocast()`` for a YAML
config). ``config`` is a megatron-core ``TransformerConfig`` or Megatron-LM's ``args``; the
fields read (megatron-core 0.16 names):

========================  ==================================================================
field                     mapping
========================  ==================================================================
``fp8``                   None/False: FP8 off; ``"e4m3"`` -> ``Format.E4M3``,
                          ``"hybrid"`` -> ``Format.HYBRID`` (E5M2 gradients)
``fp8_recipe``            ``"delayed"`` -> ``DelayedScaling``; ``"tensorwise"`` ->
                          ``Float8CurrentScaling``; ``"blockwise"`` -> ``Float8BlockScaling``;
                          ``"mxfp8"`` -> ``MXFP8BlockScaling``; ``"custom"``: error (TE only)
``fp8_margin``            ``DelayedScaling.margin``
``fp8_amax_history_len``  ``DelayedScaling.amax_history_len``
``fp8_amax_compute_algo`` ``DelayedScaling.amax_compute_algo`` (``"max"``/``"most_recent"``)
``tp_only_amax_red``      which Megatron amax-reduction group is used (below)
========================  ==================================================================

Settings that megatron_fp8 cannot honour are errors naming the field: ``fp8_param``,
``fp8_dot_product_attention``, ``fp8_multi_head_attention``, ``fp8_output_proj``,
``fp8_wgrad=False``, ``fp4`` beside ``fp8``, and ``first_last_layers_bf16`` in ``fp8_context``
(one region for the whole forward).

``get_fp8_context(config, layer_no, is_init)`` is the drop-in for megatron-core's function of that
name, which Megatron's transformer block calls per layer (or once per forward for delayed
scaling) when ``config.fp8`` is set; the Megatron-LM plug-in (``plugin.py``) installs it where
Megatron looks it up. It honours ``first_last_layers_bf16`` (those layers run in a disabled
region, as Megatron's TE path runs them in BF16).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch.distributed as dist

from ..autocast import FP8State, fp8_autocast
from ..parallel import _mcore
from ..recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    Recipe,
)

__all__ = ["recipe_from_megatron", "fp8_context", "get_fp8_context"]

_FORMATS = {"e4m3": Format.E4M3, "hybrid": Format.HYBRID}
_UNSUPPORTED_ON = {
    "fp8_param": "megatron_fp8 keeps high-precision parameters and casts them per step; set fp8_param=False",
    "fp8_dot_product_attention": "attention runs in high precision with megatron_fp8; set it to False",
    "fp8_multi_head_attention": "attention runs in high precision with megatron_fp8; set it to False",
    "first_last_layers_bf16": "fp8_context is one region for the whole forward; set it to False, or "
                              "run those layers outside the region",
    "fp8_output_proj": "the output layer stays megatron-core's own high-precision linear with megatron_fp8 (the "
                       "FP8 LM head is Transformer Engine's); set it to False",
}


def _name(value: Any) -> str:
    """An enum member's value or a string, lower-cased (``Fp8Recipe.delayed`` -> ``delayed``)."""
    return str(getattr(value, "value", value)).lower()


def recipe_from_megatron(config: Any, *, per_layer: bool = False) -> Recipe | None:
    """Our recipe for Megatron's ``fp8`` / ``fp8_recipe`` / ``fp8_*`` fields; None when
    ``config.fp8`` is unset (FP8 off). ``per_layer``: the caller opens one region per layer
    (``get_fp8_context``), so ``first_last_layers_bf16`` can be honoured."""
    if getattr(config, "quant_recipe", None) is not None:
        raise ValueError("config.quant_recipe (Megatron-LM's --te-precision-config-file) sets per-module precisions "
                         "through Transformer Engine's finish_init, which megatron_fp8's layers do not take: every "
                         "layer of ours would run the --fp8-* recipe; unset it (megatron_fp8's per-layer settings: "
                         "MEGATRON_FP8_CONFIG)")
    fp8 = getattr(config, "fp8", None)
    if not fp8:
        return None
    fmt = _FORMATS.get(_name(fp8))
    if fmt is None:
        raise ValueError(f"config.fp8={fp8!r} is not a Megatron FP8 format; use 'e4m3' or 'hybrid' (or None: off)")
    for key, fix in _UNSUPPORTED_ON.items():
        if per_layer and key == "first_last_layers_bf16":
            continue
        if getattr(config, key, False):
            raise ValueError(f"config.{key}=True is not supported with megatron_fp8 layers: {fix}")
    if getattr(config, "fp4", None):
        raise ValueError(f"config.fp4={config.fp4!r} with config.fp8={fp8!r}: FP4 and FP8 cannot be used together "
                         f"(and megatron_fp8 has no FP4 recipe); unset one of them")
    if per_layer and getattr(config, "first_last_layers_bf16", False):
        _check_bf16_layer_counts(config)
    if not getattr(config, "fp8_wgrad", True):
        raise ValueError("config.fp8_wgrad=False is not supported: megatron_fp8 runs all three GEMMs in FP8; "
                         "set fp8_wgrad=True")
    kind = _name(getattr(config, "fp8_recipe", "delayed"))
    if kind == "delayed" and per_layer and getattr(config, "first_last_layers_bf16", False):
        raise ValueError("config.first_last_layers_bf16=True with fp8_recipe='delayed': megatron-core opens one FP8 "
                         "region for the whole forward under delayed scaling, so the first and last layers would "
                         "train in FP8; use --fp8-recipe tensorwise, blockwise or mxfp8, or unset "
                         "first_last_layers_bf16")
    if kind == "delayed":
        return DelayedScaling(
            margin=int(getattr(config, "fp8_margin", 0)),
            fp8_format=fmt,
            amax_history_len=int(getattr(config, "fp8_amax_history_len", 1)),
            amax_compute_algo=_name(getattr(config, "fp8_amax_compute_algo", "most_recent")),
        )
    if kind == "tensorwise":
        return Float8CurrentScaling(fp8_format=fmt)
    if kind == "blockwise":
        return Float8BlockScaling(fp8_format=fmt)
    if kind == "mxfp8":
        return MXFP8BlockScaling(fp8_format=fmt)
    raise ValueError(f"config.fp8_recipe={kind!r} has no megatron_fp8 equivalent ('custom' is TE's quantizer "
                     f"factory); use 'delayed', 'tensorwise', 'blockwise' or 'mxfp8'")


def _check_bf16_layer_counts(config: Any) -> None:
    """megatron-core's bounds on ``num_layers_at_start_in_bf16`` / ``num_layers_at_end_in_bf16``
    (0 to the layers of one pipeline stage), which its config check applies only with TE."""
    stages = int(getattr(config, "pipeline_model_parallel_size", 1) or 1)
    per_stage = int(getattr(config, "num_layers", 0) or 0) // stages
    for key in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        n = getattr(config, key, 0)
        if n is not None and not 0 <= n <= per_stage:
            raise ValueError(f"config.{key}={n} with first_last_layers_bf16: must be between 0 and the layers of one "
                             f"pipeline stage ({per_stage})")


def _megatron_amax_group(config: Any) -> dist.ProcessGroup | None:
    """Megatron's amax-reduction group (TP x DP x CP, or TP only with ``tp_only_amax_red``)
    when its ``parallel_state`` is initialised, else None (the layers use their TP group)."""
    ps = _mcore.parallel_state()
    if ps is None or not hasattr(ps, "get_amax_reduction_group"):
        return None
    return ps.get_amax_reduction_group(with_context_parallel=True,
                                       tp_only_amax_red=bool(getattr(config, "tp_only_amax_red", False)))


def fp8_context(
    config: Any, *, enabled: bool | None = None, fp8_group: dist.ProcessGroup | None = None
) -> AbstractContextManager[FP8State]:
    """``megatron_fp8.fp8_autocast`` for Megatron's FP8 settings in ``config``.

    ``enabled``: defaults to ``bool(config.fp8)``. ``fp8_group``: where per-tensor recipes
    reduce amaxes; default Megatron's amax-reduction group as its TE path uses (it contains
    the TP group), or the layers' TP group without megatron-core's ``parallel_state``.
    """
    recipe = recipe_from_megatron(config)
    on = recipe is not None if enabled is None else enabled
    if on and recipe is None:
        raise ValueError("fp8_context(enabled=True): config.fp8 is unset, so there is no format/recipe; "
                         "set config.fp8 to 'e4m3' or 'hybrid'")
    if fp8_group is None and on:
        fp8_group = _megatron_amax_group(config)
    return fp8_autocast(enabled=on, fp8_recipe=recipe, fp8_group=fp8_group)


# the config fields that decide get_fp8_context's recipe (cached per their values: Megatron asks
# once per layer and forward, and the layers compare recipes by value when a new one arrives)
_RECIPE_FIELDS = ("fp8", "fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_param",
                  "fp8_dot_product_attention", "fp8_multi_head_attention", "first_last_layers_bf16", "fp8_wgrad",
                  "fp8_output_proj", "fp4")
_recipes: dict[tuple[Any, ...], Recipe | None] = {}


def _cached_recipe(config: Any) -> Recipe | None:
    key = tuple(_name(getattr(config, f, None)) for f in _RECIPE_FIELDS)
    if key not in _recipes:
        _recipes[key] = recipe_from_megatron(config, per_layer=True)
    return _recipes[key]


def _bf16_layer(config: Any, layer_no: int) -> bool:
    """Megatron's rule for the first/last layers kept in BF16 (``first_last_layers_bf16``)."""
    if layer_no < 0 or not getattr(config, "first_last_layers_bf16", False):
        return False
    from megatron.core.fp8_utils import is_first_last_bf16_layer

    return bool(is_first_last_bf16_layer(config, layer_no))


def get_fp8_context(config: Any, layer_no: int = -1, is_init: bool = False) -> AbstractContextManager[Any]:
    """megatron-core's ``fp8_utils.get_fp8_context`` for megatron_fp8's layers: our FP8 region
    with the recipe of ``config``'s ``fp8*`` fields and Megatron's amax-reduction group, a
    disabled region for a layer that ``first_last_layers_bf16`` keeps in BF16, nothing with
    ``config.fp8`` unset. ``is_init`` (Megatron's ``fp8_model_init`` for FP8 parameters) has no
    equivalent: ``fp8_param`` is refused."""
    if is_init:
        if getattr(config, "fp8_param", False):
            recipe_from_megatron(config)  # raises, naming the field and the fix
        return contextlib.nullcontext()
    recipe = _cached_recipe(config)
    if recipe is None:
        return contextlib.nullcontext()
    if _bf16_layer(config, layer_no):
        return fp8_autocast(enabled=False, fp8_recipe=recipe)
    return fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=_megatron_amax_group(config))
