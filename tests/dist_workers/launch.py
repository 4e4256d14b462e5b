"""Launch a torchrun worker from a test and collect its JSON report (tests/dist_workers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest

WORKERS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(WORKERS))
REPORT_TAG = "TP_WORKER_REPORT "


@dataclass
class WorkerRun:
    nproc: int
    returncode: int
    output: str
    report: dict[str, Any] | None

    def fail_if_broken(self) -> dict[str, Any]:
        """The report, or fail the test with the workers' output."""
        if self.returncode != 0 or self.report is None:
            pytest.fail(f"torchrun with {self.nproc} workers exited {self.returncode}; output tail:\n"
                        f"{self.output[-15000:]}", pytrace=False)
        return self.report


def run_workers(script: str, nproc: int, *args: str, timeout: float = 600.0) -> WorkerRun:
    """``python -m torch.distributed.run --standalone --nproc_per_node nproc script args`` with
    gloo on CPU; a timeout counts as a failure (the output so far is kept)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(WORKERS, script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code = -1
        out = f"TIMEOUT after {timeout}s\n" + _text(e.stdout) + _text(e.stderr)
    report = None
    for line in out.splitlines():
        if line.startswith(REPORT_TAG):
            report = json.loads(line[len(REPORT_TAG):])
    return WorkerRun(nproc, code, out, report)


def worker_report(script: str, *args: str, nproc: int = 2, timeout: float = 300.0) -> dict[str, Any]:
    """The JSON report of ``script`` run under torchrun (``run_workers``); the calling test fails
    with the workers' output if they did not finish or report (use it in a module-scoped fixture:
    one launch per test module)."""
    return run_workers(script, nproc, *args, timeout=timeout).fail_if_broken()


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b
