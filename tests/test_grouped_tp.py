"""Expert TP=2 Column/RowParallelGroupedLinear vs the TP=1 GroupedLinear, under torchrun (gloo).

One torchrun launch runs every case (tests/dist_workers/grouped_tp_worker.py: column and row x
FP8 off + every recipe x save_original_input on/off, splits with an empty and a ragged expert).
Exact (bitwise) vs TP=1: column fprop shard and every expert's wgrad / bias-grad shards, row
dgrad shard and wgrad shards, flag on == off. Within RTOL = 1e-5 of max |ref|: the partial sums
the MoE dispatcher would reduce over TP (column dgrad, row fprop), all-reduced in the worker.
"""

from __future__ import annotations

import pytest

from tests.dist_workers.launch import WorkerRun, run_workers

pytestmark = pytest.mark.distributed

TP = 2
STEPS = 1 + 2 + 1 + 1 + 1  # FP8 off, delayed (2 steps), current, block, mxfp8
EXPERTS = 3
_run: list[WorkerRun] = []


@pytest.fixture(scope="module")
def report() -> dict:
    if not _run:
        _run.append(run_workers("grouped_tp_worker.py", TP))
    return _run[0].fail_if_broken()


def _count(report: dict, cat: str, per_rank: int) -> None:
    got = report["counts"].get(cat, 0)
    assert got == per_rank * report["world"], f"{cat}: {got} checks ran, expected {per_rank * report['world']}"
    assert report["failures"] == 0, f"{report['failures']} checks failed (see the worker output)"


def test_column_grouped_matches_tp1(report: dict) -> None:
    _count(report, "grouped_column", STEPS * (1 + 2 * EXPERTS))  # out shard, dw_i and db_i shards


def test_row_grouped_matches_tp1(report: dict) -> None:
    _count(report, "grouped_row", STEPS * (1 + EXPERTS))  # dx shard, dw_i shards


def test_reduced_partials_are_close(report: dict) -> None:
    _count(report, "grouped_reduced", 2 * STEPS)
    assert report["max_rel"].get("grouped_reduced", 0.0) <= 1e-5


def test_save_original_input_is_bitwise_on_every_rank(report: dict) -> None:
    _count(report, "grouped_flag", 2 * STEPS * (2 + EXPERTS))  # out, dx, dw_i per kind and step


def test_errors_and_per_expert_checkpoint_keys(report: dict) -> None:
    _count(report, "grouped_extras", 8)
