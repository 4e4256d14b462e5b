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
``fp8_dot_product_attention``, ``fp8_multi_head_attention``, ``fp8_wgrad=False``,
``first_last_layers_bf16``. Keep ``fp8=None`` on the config that *builds* the model (see
``specs.py``) and pass a config (or ``args``) carrying the FP8 fields here.
"""

from __future__ import annotations

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

__all__ = ["recipe_from_megatron", "fp8_context"]

_FORMATS = {"e4m3": Format.E4M3, "hybrid": Format.HYBRID}
_UNSUPPORTED_ON = {
    "fp8_param": "megatron_fp8 keeps high-precision parameters and casts them per step; set fp8_param=False",
    "fp8_dot_product_attention": "attention runs in high precision with megatron_fp8; set it to False",
    "fp8_multi_head_attention": "attention runs in high precision with megatron_fp8; set it to False",
    "first_last_layers_bf16": "fp8_context is one region for the whole forward; set it to False, or "
                              "run those layers outside the region",
}


def _name(value: Any) -> str:
    """An enum member's value or a string, lower-cased (``Fp8Recipe.delayed`` -> ``delayed``)."""
    return str(getattr(value, "value", value)).lower()


def recipe_from_megatron(config: Any) -> Recipe | None:
    """Our recipe for Megatron's ``fp8`` / ``fp8_recipe`` / ``fp8_*`` fields; None when
    ``config.fp8`` is unset (FP8 off)."""
    fp8 = getattr(config, "fp8", None)
    if not fp8:
        return None
    fmt = _FORMATS.get(_name(fp8))
    if fmt is None:
        raise ValueError(f"config.fp8={fp8!r} is not a Megatron FP8 format; use 'e4m3' or 'hybrid' (or None: off)")
    for key, fix in _UNSUPPORTED_ON.items():
        if getattr(config, key, False):
            raise ValueError(f"config.{key}=True is not supported with megatron_fp8 layers: {fix}")
    if not getattr(config, "fp8_wgrad", True):
        raise ValueError("config.fp8_wgrad=False is not supported: megatron_fp8 runs all three GEMMs in FP8; "
                         "set fp8_wgrad=True")
    kind = _name(getattr(config, "fp8_recipe", "delayed"))
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
