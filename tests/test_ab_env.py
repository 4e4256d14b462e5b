"""``scripts/probes/ab_env.py`` (A/B of environment settings over fresh benchmark processes) on CPU, with a
stand-in benchmark that writes a table from its environment: the settings alternate round by
round, every reading is kept, and medians and ratios come from the readings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "probes"))
import ab_env  # noqa: E402 - a script, found through the path set above

FAKE = '''
import argparse, os, pathlib
p = argparse.ArgumentParser()
p.add_argument("--out")
p.add_argument("--scale", type=float, default=1.0)
a = p.parse_args()
ms = float(os.environ["FAKE_MS"]) * a.scale
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(os.environ["FAKE_MS"] + "\\n")
pathlib.Path(a.out, "fake.md").write_text(
    "## fake\\n\\nCPU\\n\\n| shape | path | fwd+bwd ms | note |\\n|---|---|---|---|\\n"
    f"| s1 | a (CUDA graph) | {ms} | x |\\n| s1 | b | {2 * ms} | - |\\n| s1 | c | - | no number |\\n")
'''


def _run(tmp_path: Path, *extra: str) -> tuple[str, list[str]]:
    fake = tmp_path / "fake_bench.py"
    fake.write_text(FAKE)
    log = tmp_path / "order.log"
    env = {**os.environ, "FAKE_LOG": str(log)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "probes" / "ab_env.py"), "--set", "FAKE_MS=1",
                           "--set", "FAKE_MS=1.5", "--rounds", "2", *extra, "--", str(fake), "--scale", "2"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout, log.read_text().split()


def _final_rows(out: str) -> list[str]:
    """The table printed after the last round (one is printed after every round)."""
    return [ln for ln in out.split("2 of 2 rounds")[-1].splitlines() if ln.startswith("| s1")]


def test_settings_alternate_and_readings_summarize(tmp_path: Path) -> None:
    out, order = _run(tmp_path, "--match", "CUDA graph")
    assert order == ["1", "1.5", "1", "1.5"]  # A B A B, one process each
    assert _final_rows(out) == ["| s1 | a (CUDA graph) | 2 / 2 | 2 | 3 / 3 | 3 | 1.500 |"]
    first = out.split("1 of 2 rounds")[1].split("2 of 2 rounds")[0]  # the table after round 1
    assert "| s1 | a (CUDA graph) | 2 | 2 | 3 | 3 | 1.500 |" in first


def test_without_match_every_numeric_row(tmp_path: Path) -> None:
    out, _ = _run(tmp_path)
    rows = _final_rows(out)
    assert [r.split(" | ")[1] for r in rows] == ["a (CUDA graph)", "b"]  # c has no number
    assert rows[1].endswith("| 4 / 4 | 4 | 6 / 6 | 6 | 1.500 |")


def test_parsers() -> None:
    assert ab_env.parse_setting("A=1, B=x") == {"A": "1", "B": "x"}
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        ab_env.parse_setting("A")
    table = ab_env.parse_table("## t\n\n| k | v |\n|---|---|\n| x | 1 |\n| bad |\n\nafter\n| y | 2 |\n")
    assert table == [{"k": "x", "v": "1"}]  # the first table only; a short row dropped
