"""Launch a torchrun worker from a test and collect its JSON report (tests/dist_workers)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
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
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        code, out = proc.returncode, stdout + stderr
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop(proc)
        code = -1
        out = f"TIMEOUT after {timeout}s\n" + _text(stdout) + _text(stderr)
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


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``): torchrun starts each worker in a session of
    its own, out of reach of a signal to torchrun's process group."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parents.items() if p in frontier]
        found += kids
        frontier = kids
    return found


def _stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """End a timed-out torchrun and its workers (which would otherwise keep spinning in a
    collective and slow every later test): SIGTERM, which torchrun passes on to its workers,
    then SIGKILL to whatever is left."""
    workers = _descendants(proc.pid)
    proc.terminate()
    try:
        return proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        for pid in [*workers, *_descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return proc.communicate()


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b
