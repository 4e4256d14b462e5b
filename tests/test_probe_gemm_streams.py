"""``scripts/probes/probe_gemm_streams.py --check``: the probe's operands (cast by the package in one
launch per tensor, as ``GroupedLinear`` casts them) and its per-expert GEMMs, on small shapes,
each product within FP8 error of its BF16 one. Needs the one-launch casts: CUDA, or Triton's
interpreter on CPU (CI runs this file under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "probes"))
import probe_gemm_streams  # noqa: E402


def test_check_runs_every_set(capsys: pytest.CaptureFixture[str]) -> None:
    probe_gemm_streams.check(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6  # two recipes x fprop, dgrad, wgrad, each checked inside check()
