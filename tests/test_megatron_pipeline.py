"""Pipeline parallelism with megatron_fp8's spec through megatron-core's own 1F1B schedule, on CPU
(``dist_workers/pipeline_worker.py``, 2 ranks, gloo; its docstring lists the checks): PP=2, 1F1B
and interleaved, equals PP=1 bit for bit under the stateless recipes."""

from __future__ import annotations

import pytest

from tests.dist_workers.launch import worker_report

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def report() -> dict:
    return worker_report("pipeline_worker.py", timeout=400)


@pytest.mark.distributed
@pytest.mark.megatron
def test_pipeline_parallel_step_equals_one_stage(report: dict) -> None:
    # per schedule (1F1B, interleaved), rank and recipe (4): the stage's gradient and loss counts;
    # the stateless recipes (3) every gradient bitwise (13 or more a rank) and, on the last
    # stage, the 4 losses
    assert report["counts"]["pp"] >= 2 * (4 * report["world"] + 3 * 13 * report["world"] + 4 * 4)
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_stages_without_layers_or_experts_build_and_rules_name_global_layers(report: dict) -> None:
    assert report["counts"]["pp_specs"] == 4 * report["world"]
    assert report["failures"] == 0
