"""The memory audit (``mf.memory.audit``, ``python -m megatron_fp8.audit``): it recommends
``save_original_input`` exactly where another module saves the linear's input, says what the flag
costs elsewhere, and its written YAML, applied, saves the predicted bytes to the byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import megatron_fp8 as mf
from megatron_fp8.audit import columnwise_copy_bytes
from megatron_fp8.config import apply_layer_flags, load_config
from megatron_fp8.recipe import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Model(nn.Module):
    """``shared`` reads x, which ``keeper`` (an nn.Linear: it saves its input) reads too;
    ``alone`` reads a tensor nobody else saves (a GELU saves its input, not its output)."""

    def __init__(self) -> None:
        super().__init__()
        self.keeper = nn.Linear(256, 8)
        self.shared = mf.Linear(256, 256)
        self.alone = mf.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.keeper(x).sum() + self.alone(torch.nn.functional.gelu(self.shared(x))).sum()


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling()])
def test_recommends_exactly_where_another_module_saves_the_input(recipe: object, tmp_path: str) -> None:
    torch.manual_seed(0)
    model, x = _Model(), torch.randn(256, 256, dtype=torch.float32)

    def step() -> None:
        with mf.fp8_autocast(fp8_recipe=recipe):
            model(x).backward()

    report = mf.memory.audit(model, step)
    by = {lin.name: lin for lin in report.linears}
    copy = columnwise_copy_bytes(recipe, 256, 256)  # type: ignore[arg-type]
    assert by["shared"].saved_by_others == ["keeper"] and by["shared"].flag_saves == copy
    assert by["alone"].saved_by_others == [] and by["alone"].flag_saves == copy - 256 * 256 * 4  # FP32 input
    assert report.recommend() == {"shared": {"save_original_input": True}}
    path = os.path.join(tmp_path, "flags.yaml")
    report.to_yaml(path)
    apply_layer_flags(model, load_config(path))
    assert model.shared.save_original_input and not model.alone.save_original_input
    after = mf.memory.audit(model, step)
    assert after.activation_bytes == report.with_recommendation  # the predicted saving, to the byte
    assert report.activation_bytes - after.activation_bytes == copy
    data = json.loads(json.dumps(report.to_json()))
    assert set(data) == {"linears", "recompute", "totals", "notes"}
    assert set(data["totals"]) == {"activation_bytes", "with_recommendation", "floor"}
    assert {"name", "input_shape", "input_bytes", "recipe", "flag", "saved_by_others", "shares_input_with",
            "copy_bytes", "flag_saves", "group_saves", "recommended"} == set(data["linears"][0])
    png = os.path.join(tmp_path, "audit.png")
    report.plot(png)
    assert os.path.getsize(png) > 1000


def test_fp8_off_the_flag_changes_nothing() -> None:
    model, x = _Model(), torch.randn(256, 256)
    report = mf.memory.audit(model, lambda: model(x).backward())
    assert all(lin.flag_saves == 0 and lin.recipe == "off" for lin in report.linears)
    assert report.recommend() == {}


def _cli(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_fp8.audit", "--json", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.megatron
def test_megatron_gpt_dense_moe_and_local_attention(tmp_path: str) -> None:
    pytest.importorskip("megatron.core")
    tokens, hidden = 2 * 256, 256  # the command's GPT: seq 256, batch 2, hidden 256, BF16, block scaling
    copy = columnwise_copy_bytes(Float8BlockScaling(), tokens, hidden)
    dense = _cli("--model", "gpt")
    rec = {lin["name"] for lin in dense["linears"] if lin["recommended"]}
    assert rec == {f"decoder.layers.{i}.self_attention.linear_proj" for i in range(2)}
    assert all(lin["flag_saves"] == copy for lin in dense["linears"] if lin["name"] in rec)
    assert all(not lin["saved_by_others"] for lin in dense["linears"] if lin["name"] not in rec)  # never
    local = _cli("--model", "gpt", "--core-attention", "local")  # megatron-core's attention: a fresh copy
    proj = [lin for lin in local["linears"] if lin["name"].endswith("linear_proj")]
    assert proj and all(lin["flag_saves"] == copy - tokens * hidden * 2 and not lin["recommended"] for lin in proj)
    flags = os.path.join(tmp_path, "moe.yaml")
    moe = _cli("--model", "moe", "--write-config", flags)
    rec = {lin["name"] for lin in moe["linears"] if lin["recommended"]}
    assert rec == {f"decoder.layers.{i}.{m}" for i in range(2)
                   for m in ("self_attention.linear_proj", "mlp.shared_experts.linear_fc1")}
    again = _cli("--model", "moe", "--config", flags)
    assert again["totals"]["activation_bytes"] == moe["totals"]["with_recommendation"]
    mla = _cli("--model", "mla")  # the q / kv down-projections read one input: decided together
    rec = {lin["name"] for lin in mla["linears"] if lin["recommended"]}
    downs = {f"decoder.layers.{i}.self_attention.linear_{p}_down_proj" for i in range(2) for p in ("q", "kv")}
    assert rec == downs  # BF16 input kept once vs two FP8 copies: the block scales tip it
    assert all(lin["group_saves"] == 2 * copy - tokens * hidden * 2 for lin in mla["linears"] if lin["name"] in downs)
    norms = {c["name"]: c for c in mla["recompute"]}
    assert norms["decoder.layers.0.input_layernorm"]["frees"] == 2 * copy  # with layernorm recompute: both copies
