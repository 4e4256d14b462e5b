"""megatron-core interop (skips without megatron-core): our Column/RowParallelLinear vs
Megatron's own tensor_parallel layers (FP8 off; TP=2, gloo, CPU; SP on/off, bias on/off) and
checkpoint round trips. Outputs and grads are required to be *bitwise* equal to Megatron's:
the per-rank math and the collectives are the same.

Checkpoints: ``state_dict``/``load_state_dict`` (weights + delayed-scaling FP8 state, checked
bitwise after a further step), a Megatron-native state dict loading into ours, and
``sharded_state_dict`` through ``megatron.core.dist_checkpointing`` save/load (its writer
needs ``psutil``; that part skips without it).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.dist_workers.launch import WorkerRun, run_workers

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.distributed, pytest.mark.megatron]

_run: dict[str, WorkerRun] = {}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if "r" not in _run:
        ckpt = tmp_path_factory.mktemp("mcore_ckpt")
        _run["r"] = run_workers("mcore_worker.py", 2, str(ckpt), timeout=300)
    return _run["r"].fail_if_broken()


def test_matches_megatron_core_layers_bitwise(report: dict) -> None:
    # per rank: 2 kinds x 2 SP x 2 bias x (weights, 3 attributes, bias-return, out, dx, dw, db)
    assert report["counts"].get("mcore") == 2 * 2 * 2 * 9 * report["world"]
    assert report["failures"] == 0


def test_state_dict_round_trip_restores_weights_and_fp8_state(report: dict) -> None:
    # per rank and kind: weight, bias, next output, 6 FP8 state tensors + key check; + 1 native load
    assert report["counts"].get("ckpt") == (2 * 10 + 1) * report["world"]
    assert report["failures"] == 0


@pytest.mark.skipif(importlib.util.find_spec("psutil") is None,
                    reason="megatron-core's dist_checkpointing writer needs psutil")
def test_sharded_state_dict_dist_checkpointing_round_trip(report: dict) -> None:
    assert report["counts"].get("ckpt_dist") == 2 * 10 * report["world"]
    assert report["failures"] == 0
