"""Recipes: defaults per RECIPES.md, validation errors that name the field, presets, autocast."""

from __future__ import annotations

import pytest
import torch

import megatron_fp8 as mf
from megatron_fp8.autocast import current_fp8_state, fp8_step, is_fp8_enabled
from megatron_fp8.recipe import (
    PRESETS,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    TensorRole,
    recipe_from_name,
)


def test_default_formats_follow_recipes_md() -> None:
    assert DelayedScaling().fp8_format is Format.HYBRID
    assert Float8CurrentScaling().fp8_format is Format.HYBRID
    assert Float8BlockScaling().fp8_format is Format.E4M3
    assert MXFP8BlockScaling().fp8_format is Format.E4M3
    assert DelayedScaling().amax_history_len == 1024
    assert Float8BlockScaling().power_2_scale is True


def test_hybrid_uses_e5m2_for_grads_only() -> None:
    r = Float8CurrentScaling()
    assert r.fp8_dtype(TensorRole.INPUT) == torch.float8_e4m3fn
    assert r.fp8_dtype(TensorRole.WEIGHT) == torch.float8_e4m3fn
    assert r.fp8_dtype(TensorRole.GRAD_OUTPUT) == torch.float8_e5m2
    assert Float8BlockScaling().fp8_dtype(TensorRole.GRAD_OUTPUT) == torch.float8_e4m3fn


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: DelayedScaling(margin=-1), "margin"),
        (lambda: DelayedScaling(amax_history_len=0), "amax_history_len"),
        (lambda: DelayedScaling(amax_compute_algo="mean"), "amax_compute_algo"),
        (lambda: DelayedScaling(fp8_format="E4M3"), "fp8_format"),
        (lambda: Float8CurrentScaling(amax_epsilon=-1.0), "amax_epsilon"),
        (lambda: Float8CurrentScaling(power_2_scale=1), "power_2_scale"),
        (lambda: Float8BlockScaling(block_size=64), "block_size"),
        (lambda: MXFP8BlockScaling(block_size=16), "block_size"),
    ],
)
def test_invalid_field_is_a_value_error_naming_it(make, field: str) -> None:
    with pytest.raises(ValueError, match=rf"\.{field}=.*allowed"):
        make()


def test_recipes_are_frozen() -> None:
    with pytest.raises(AttributeError):
        DelayedScaling().margin = 3  # type: ignore[misc]


def test_presets_by_name() -> None:
    assert recipe_from_name("blockwise") == Float8BlockScaling()
    assert set(PRESETS) >= {"delayed", "current", "blockwise", "mxfp8"}
    with pytest.raises(ValueError, match="choose one of"):
        recipe_from_name("fp4")


def test_autocast_nesting_and_steps() -> None:
    assert current_fp8_state() is None and not is_fp8_enabled()
    step = fp8_step()
    with mf.fp8_autocast(enabled=True, fp8_recipe=Float8BlockScaling(), fp8_group=None) as st:
        assert is_fp8_enabled() and st.recipe == Float8BlockScaling()
        with mf.fp8_autocast(enabled=False):
            assert not is_fp8_enabled()
        with mf.fp8_autocast(fp8_recipe=MXFP8BlockScaling()):
            assert current_fp8_state().recipe == MXFP8BlockScaling()
            assert fp8_step() == step + 1  # nested regions do not start a new step
    assert fp8_step() == step + 1 and current_fp8_state() is None
    with pytest.raises(TypeError, match="recipe"):
        with mf.fp8_autocast(fp8_recipe="blockwise"):  # type: ignore[arg-type]
            pass
