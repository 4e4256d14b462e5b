"""The torchrun launcher of the distributed tests (``dist_workers/launch.py``): a worker that hangs
(a collective that never completes, say) fails its test at the timeout and leaves no process
behind; torchrun starts each worker in a session of its own, so stopping torchrun alone would
leave them spinning and slow every later test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.dist_workers.launch import run_workers


@pytest.mark.distributed
def test_a_hanging_worker_is_stopped_with_its_children(tmp_path: Path) -> None:
    script = tmp_path / "hang_worker.py"
    script.write_text("import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(0.2)\n")
    run = run_workers(str(script), 2, timeout=10)
    assert run.returncode == -1 and run.output.startswith("TIMEOUT after 10")
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if str(script).encode() in cmdline:
                left.append(entry)
    assert not left, f"processes of the hung worker still alive: {left}"
