"""Shared test fixtures: deterministic seeds and the recipe list."""

from __future__ import annotations

import pytest
import torch

from megatron_fp8.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

RECIPES = {
    "delayed": DelayedScaling(amax_history_len=16),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


@pytest.fixture(params=list(RECIPES), ids=list(RECIPES))
def recipe(request: pytest.FixtureRequest):
    return RECIPES[request.param]
