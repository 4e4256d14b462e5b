"""Tensor-parallel Column/RowParallelLinear vs the TP=1 Linear, under torchrun (gloo, CPU).

One torchrun launch per world size runs every case (tests/dist_workers/tp_worker.py: column and
row x SP on/off x bias on/off x FP8 off + every recipe x save_original_input on/off) and reports
per-category counts; the tests below check one category each.

Exact (bitwise) vs TP=1: column fprop shard, column wgrad/bias-grad shards, row dgrad and wgrad
shards, row bias grad without SP, gather_output, and flag on == flag off for everything.
Within RTOL = 1e-5 (relative to max |ref|; measured <= 6e-7): column dgrad (all-reduce /
reduce-scatter over TP), row fprop (all-reduce / reduce-scatter), row bias grad under SP.
"""

from __future__ import annotations

import pytest

from tests.dist_workers.launch import WorkerRun, run_workers

pytestmark = pytest.mark.distributed

N_CONFIGS = 2 * 2 * 5  # SP x bias x (FP8 off + 4 recipes), per layer kind
_runs: dict[int, WorkerRun] = {}


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def report(request: pytest.FixtureRequest) -> dict:
    nproc = request.param
    if nproc not in _runs:
        _runs[nproc] = run_workers("tp_worker.py", nproc)
    return _runs[nproc].fail_if_broken()


def _steps_total() -> int:
    return 2 * 2 * (4 + 2)  # SP x bias x (1 step for off/current/block/mxfp8 + 2 for delayed)


def _category(report: dict, cat: str, per_rank: int) -> None:
    world = report["world"]
    assert report["counts"].get(cat, 0) == per_rank * world, (
        f"{cat}: {report['counts'].get(cat, 0)} checks ran, expected {per_rank * world}")
    assert report["failures"] == 0, f"{report['failures']} checks failed (see the worker output)"


def test_column_parallel_matches_tp1(report: dict) -> None:
    # bitwise: out shard, dw shard (+ db shard with bias) per step; close: dx per step
    steps = _steps_total()
    _category(report, "column", 2 * steps + steps // 2)
    _category(report, "column_dgrad_reduced", steps)
    assert report["max_rel"]["column_dgrad_reduced"] <= 1e-5


def test_row_parallel_matches_tp1(report: dict) -> None:
    # bitwise: dx, dw shards per step (+ db without SP); close: out per step, db under SP
    steps = _steps_total()
    _category(report, "row", 2 * steps + steps // 4)
    _category(report, "row_fprop_reduced", steps)
    _category(report, "row_bias_sp_reduced", steps // 4)
    assert report["max_rel"].get("row_fprop_reduced", 0.0) <= 1e-5


def test_save_original_input_is_bitwise_on_every_rank(report: dict) -> None:
    _category(report, "flag", 2 * _steps_total() * 4)  # both kinds x steps x (out, dx, dw, db)


def test_sequence_parallel_saves_local_shard_only(report: dict) -> None:
    _category(report, "saved", 5 * 2 * 3)  # recipes x flag x 3 checks


def test_bad_inputs_raise_clear_errors(report: dict) -> None:
    _category(report, "errors", 10)


def test_gather_output_and_unsplit_row_input(report: dict) -> None:
    _category(report, "extras", 6)
    _category(report, "extras_reduced", 2)
