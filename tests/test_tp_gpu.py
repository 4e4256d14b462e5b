"""GPU (skips without CUDA; run on the device machine): the parallel layers under NCCL with
TP=1 (bitwise vs ``megatron_fp8.Linear``, every recipe) and the async collective path of the
column-parallel hooks over a one-rank NCCL group (bitwise vs no communication)."""

from __future__ import annotations

import pytest
import torch

from tests.dist_workers.launch import run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.distributed,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_layers_and_async_path_under_nccl_tp1() -> None:
    report = run_workers("gpu_worker.py", 1, timeout=600).fail_if_broken()
    assert report["counts"].get("layers") == 5 * 2 * 4  # recipes x kinds x (out, dx, dw, db)
    assert report["counts"].get("async") == 2 + 5 * 2 * 2 * 3  # + recipes x SP x flag x (out, dx, dw)
    assert report["failures"] == 0
