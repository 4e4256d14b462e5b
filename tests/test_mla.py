"""Multi-latent attention with megatron_fp8's projections (``megatron_fp8.megatron.mla``), on CPU
through torchrun (``dist_workers/mla_worker.py``, 2 ranks, TP=2 and TP=1): the model builds and
trains; ``save_original_input`` on the q/kv down-projections is bitwise neutral; with layernorm
recompute the live saved bytes drop by exactly the FP8 copies the flags remove (plus what the
recomputed norms no longer save for themselves); the ``mla_up_proj`` recompute keeps the loss
bitwise."""

from __future__ import annotations

import pytest

from tests.dist_workers.launch import worker_report

pytest.importorskip("megatron.core")

@pytest.fixture(scope="module")
def report() -> dict:
    return worker_report("mla_worker.py", timeout=400)


@pytest.mark.distributed
@pytest.mark.megatron
def test_mla_builds_and_trains_at_tp2_and_tp1(report: dict) -> None:
    assert report["counts"]["build"] == 2 * 2 * report["world"]
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_down_projection_flags_bitwise_and_bytes_exact(report: dict) -> None:
    assert report["counts"]["flags"] >= 2 * 20 * report["world"]  # per TP: the loss and every gradient
    assert report["counts"]["bytes"] == 2 * report["world"]
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_mla_up_proj_recompute(report: dict) -> None:
    assert report["counts"]["up_proj"] >= 2 * 20 * report["world"]
    assert report["max_rel"]["up_proj"] <= 1e-5
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_deepseek_layout_mla_with_grouped_experts(report: dict) -> None:
    assert report["counts"]["deepseek"] >= 30 * report["world"]  # TP=1: training, the loss, every gradient
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_mla_with_sequence_parallelism_through_the_plugin(report: dict) -> None:
    # TP=2: norms marked, the loss and every gradient FP8 off and under blocks against the same
    # model without sequence parallelism; DeepSeek's layout (MLA + MoE) trains at TP=2
    assert report["counts"]["sp"] >= 2 * (1 + 1 + 20) * report["world"]
    assert report["max_rel"]["sp"] <= 1e-2
    assert report["failures"] == 0
