"""YAML configs: recipes by preset or field by field, per-layer flags by glob, clear errors."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import megatron_fp8 as mf
from megatron_fp8.config import apply_layer_flags, load_config, parse_config
from megatron_fp8.recipe import DelayedScaling, Float8BlockScaling, Format, MXFP8BlockScaling

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")


def _model() -> nn.Module:
    return nn.ModuleDict({
        "attention": nn.ModuleDict({"qkv": mf.Linear(128, 384), "proj": mf.Linear(128, 128)}),
        "mlp": nn.ModuleDict({"fc1": mf.Linear(128, 256), "act": nn.GELU(), "fc2": mf.Linear(256, 128)}),
    })


def test_shipped_configs_load() -> None:
    assert load_config(os.path.join(CONFIGS, "tp_block.yaml")).recipe() == Float8BlockScaling()
    d = load_config(os.path.join(CONFIGS, "delayed.yaml")).recipe()
    assert d == DelayedScaling(margin=0, fp8_format=Format.HYBRID, amax_history_len=16)


def test_recipe_spec_and_flags_by_glob() -> None:
    cfg = parse_config({
        "fp8": {"recipe": {"kind": "mxfp8"}},
        "layers": [{"match": "*proj", "save_original_input": True},
                   {"match": "mlp.fc*", "save_original_input": True},
                   {"match": "mlp.fc2", "save_original_input": False}],
    })
    assert cfg.recipe() == MXFP8BlockScaling()
    model = _model()
    applied = apply_layer_flags(model, cfg)
    assert applied == {"attention.proj": True, "mlp.fc1": True, "mlp.fc2": False}  # later rules win
    assert model["attention"]["proj"].save_original_input and not model["attention"]["qkv"].save_original_input
    with cfg.autocast() as st:
        assert st.enabled and st.recipe == MXFP8BlockScaling()


@pytest.mark.parametrize("data, match", [
    ({"fp8": {"recipe": "fp4"}}, r"fp8\.recipe.*unknown recipe preset 'fp4'"),
    ({"fp8": {"recipe": {"kind": "blockwise", "margin": 2}}}, r"\['margin'\] do not apply to kind 'blockwise'"),
    ({"fp8": {"recipe": {"kind": "delayed", "amax_history_len": 0}}}, r"amax_history_len=0 is invalid"),
    ({"fp8": {"enabled": True, "recipes": "blockwise"}}, r"fp8\.recipes: Extra inputs are not permitted"),
    ({"layers": [{"match": "*proj", "save_original_input": "maybe"}]}, r"layers\.0\.save_original_input"),
])
def test_bad_config_names_the_key(data, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_config(data, "test.yaml")


def test_rules_that_match_nothing_or_non_linears_fail() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"layers\[0\]\.match='\*\.out_proj' matches no module"):
        apply_layer_flags(model, parse_config({"layers": [{"match": "*.out_proj", "save_original_input": True}]}))
    with pytest.raises(ValueError, match=r"matches mlp\.act \(GELU\), which has no save_original_input"):
        apply_layer_flags(model, parse_config({"layers": [{"match": "mlp.*", "save_original_input": True}]}))


def test_flags_from_config_keep_numbers() -> None:
    cfg = parse_config({"fp8": {"recipe": "blockwise"},
                        "layers": [{"match": "*", "save_original_input": True}]})
    x = torch.randn(256, 128)
    outs = []
    for flag in (False, True):
        torch.manual_seed(0)
        model = mf.Linear(128, 128)
        if flag:
            apply_layer_flags(nn.ModuleDict({"l": model}), cfg)
        with cfg.autocast():
            outs.append(model(x))
    assert torch.equal(*outs)
