"""The SDPA core attention of our Megatron specs (``megatron_fp8.megatron.attention``), on CPU
through torchrun (``dist_workers/attention_worker.py``, TP=2, gloo): equal to megatron-core's
``DotProductAttention`` within 1e-5 (FP32: out and the q/k/v grads; causal and padding masks;
GQA and MHA); ``linear_proj``'s input *is* the output SDPA saved (storage identity); and with
``save_original_input`` on ``linear_proj`` the model's saved-activation bytes drop by exactly
each layer's columnwise FP8 copy of that input, per recipe, loss and grads bitwise unchanged."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.dist_workers.launch import worker_report

pytest.importorskip("megatron.core")

@pytest.fixture(scope="module")
def report() -> dict:
    return worker_report("attention_worker.py")


@pytest.mark.distributed
@pytest.mark.megatron
def test_sdpa_core_matches_megatron_dot_product_attention(report: dict) -> None:
    assert report["counts"]["core"] == 2 * 2 * 4 * report["world"]  # (MHA, GQA) x (causal, padding) x 4
    assert report["max_rel"]["core"] <= 1e-5
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_linear_proj_reads_the_output_sdpa_saved(report: dict) -> None:
    assert report["counts"]["view"] == 3 * report["world"]  # the count, then one check per layer
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_flag_on_linear_proj_saves_exactly_the_columnwise_copy(report: dict) -> None:
    assert report["counts"]["bytes"] >= 3 * 2 * report["world"]
    assert report["failures"] == 0


def _core(spec: Any) -> Any:
    attn = spec.submodules.self_attention
    sub = attn.keywords["submodules"] if isinstance(attn, functools.partial) else attn.submodules
    return sub.core_attention


def test_spec_core_attention_choice() -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_fp8.megatron import get_gpt_layer_spec
    from megatron_fp8.megatron.attention import SDPAttention

    assert _core(get_gpt_layer_spec(core_attention="sdpa")) is SDPAttention
    assert _core(get_gpt_layer_spec(core_attention="local")) is DotProductAttention
    assert _core(get_gpt_layer_spec()) is DotProductAttention  # the default without CUDA
    with pytest.raises(ValueError, match="core_attention='flash'.*'sdpa'"):
        get_gpt_layer_spec(core_attention="flash")
