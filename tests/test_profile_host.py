"""``scripts/profile_host.py`` (the eager host-cost table) on CPU: it prints every row of the
issue's table from fresh processes (``--processes``), its uneven splits are uneven and cover
every token, and sizes the block recipes cannot take are refused by name."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import profile_host  # noqa: E402 - a script, found through the path set above


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPTS / "profile_host.py"), *args], capture_output=True, text=True,
                          timeout=300)


def test_table_from_two_processes(tmp_path: Path) -> None:
    out = _run("--tokens", "128", "--k", "128", "--n", "128", "--experts", "2", "--calls", "2", "--rounds", "2",
               "--processes", "2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "median of 2 process(es) of 2 rounds" in out.stdout
    assert (tmp_path / "profile_host.md").read_text().count("| our Linear,") == 11  # the table, for ab_env.py
    for label in ("BF16 nn.Linear", "our Linear, FP8 off", "our Linear, current", "our Linear, blockwise",
                  "our Linear, blockwise HYBRID", "our Linear, delayed", "our Linear, current, general path",
                  "our Linear, blockwise, general path", "our Linear, delayed, general path",
                  "our Linear, current, weight cast reused", "our Linear, blockwise, weight cast reused",
                  "our Linear, delayed, weight cast reused",
                  "our GroupedLinear, FP8 off, even splits",
                  "our GroupedLinear, current, even splits", "our GroupedLinear, blockwise, even splits",
                  "our GroupedLinear, current, router splits", "our GroupedLinear, blockwise, router splits",
                  "our GroupedLinear, current, even splits, general path",
                  "our GroupedLinear, blockwise, even splits, general path",
                  "our GroupedLinear, current, router splits, general path",
                  "our GroupedLinear, blockwise, router splits, general path"):
        row = re.search(rf"^\| {re.escape(label)} \| (\d+) \|", out.stdout, re.M)
        assert row and int(row.group(1)) > 0, f"{label} missing or zero:\n{out.stdout}"


def test_router_splits_cover_every_token_and_change_every_step() -> None:
    for tokens, experts in ((256, 8), (128, 4), (2048, 64)):
        steps = profile_host._routed(tokens, experts)
        assert all(sum(splits) == tokens * experts and len(set(splits)) > 1 for splits in steps)
        assert len({tuple(splits) for splits in steps}) == len(steps)
        assert any(s % 16 for splits in steps for s in splits)


def test_ratios_are_taken_within_each_process() -> None:
    """A host that ran slower in one process: each row is compared with the reference measured in
    its own process, and the range over the processes is printed beside the median."""
    runs = [[("BF16 nn.Linear", 100.0, 1.0), ("our Linear, current", 300.0, 1.0)],
            [("BF16 nn.Linear", 200.0, 1.0), ("our Linear, current", 400.0, 1.0)],
            [("BF16 nn.Linear", 150.0, 1.0), ("our Linear, current", 390.0, 1.0)]]
    table = profile_host._table(runs)
    row = re.search(r"^\| our Linear, current \| (\d+) \| .* \| (.+) \|$", table, re.M)
    assert row, table
    assert row.group(1) == "390"  # the median host time
    assert row.group(2) == "2.60x (2.00-3.00)"  # per-process ratios 3.0, 2.0, 2.6 (ratio of medians: 2.60 too)
    runs[2] = [("BF16 nn.Linear", 120.0, 1.0), ("our Linear, current", 390.0, 1.0)]
    assert "3.00x (2.00-3.25)" in profile_host._table(runs)  # not 390 / 120 = 3.25x of the medians
    one = profile_host._table(runs[:1])
    assert "3.00x |" in one and "(" not in one.split("our Linear, current")[1]


def test_sizes_the_block_recipes_refuse_are_named() -> None:
    out = _run("--k", "100")
    assert out.returncode != 0 and "--k=100" in out.stderr and "multiple of 128" in out.stderr


def test_rounds_pair_each_row_with_its_reference_of_the_same_round() -> None:
    """The ratio of a row measured in rounds: the median of its per-round ratios to the reference
    of the same round (a host that slowed down in round 2 slows both), rounds without a reading
    skipped; the order rotates by a share of the rows each round."""
    host = {"BF16 nn.Linear": [100.0, 300.0, 110.0], "our Linear, current": [300.0, 900.0, float("nan")],
            "BF16 torch._grouped_mm (8 experts)": [50.0, 50.0, 50.0],
            "our GroupedLinear, current, even splits": [200.0, 100.0, 150.0]}
    ratios = profile_host.round_ratios(host)
    assert ratios["our Linear, current"] == 3.0  # 3.0 in both rounds it was read; not 600 / 110 of the medians
    assert ratios["our GroupedLinear, current, even splits"] == 3.0  # median of 4, 2, 3 against _grouped_mm
    assert ratios["BF16 nn.Linear"] == 1.0
    labels = ["a", "b", "c", "d", "e", "f"]
    orders = [profile_host._order(labels, turn, 3) for turn in range(3)]
    assert orders == [labels, ["c", "d", "e", "f", "a", "b"], ["e", "f", "a", "b", "c", "d"]]
    runs = [[("BF16 nn.Linear", 110.0, 1.0, 1.0), ("our Linear, current", 600.0, 1.0, 3.0)]]
    assert "3.00x |" in profile_host._table(runs)  # the process's own ratio, not 600 / 110


def test_rounds_must_fit_the_calls() -> None:
    out = _run("--rounds", "0")
    assert out.returncode != 0 and "--rounds=0" in out.stderr


def test_graph_rows_are_timed_last_and_a_failed_capture_ends_only_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """``measure`` with stand-in steps: the plain rows' rounds first, then the CUDA-graph rows in
    rounds of their own beside the reference timed again; a graph row whose capture fails in the
    second round leaves the readings taken so far and nan after, and every other row complete."""
    g1 = "our Linear, current, CUDA graphs (MEGATRON_FP8_GRAPHS=1)"
    g2 = "our Linear, current, CUDA graphs, weight cast reused"
    labels = ["BF16 nn.Linear", "our Linear, current", g1, g2]
    timed: list[str] = []
    host_us = {"BF16 nn.Linear": 100.0, "our Linear, current": 300.0, g1: 200.0, g2: 150.0}

    def fake_steps(args: argparse.Namespace) -> list[tuple[str, object]]:
        return [(lab, lab) for lab in labels]

    def fake_time(step: str, calls: int) -> tuple[float, float]:
        if step == g2 and timed.count(g2) == 1:
            raise RuntimeError("capture failed")
        timed.append(step)
        return host_us[step], 1.0

    monkeypatch.setattr(profile_host, "_steps", fake_steps)
    monkeypatch.setattr(profile_host, "_host_device_us", fake_time)
    rows = profile_host.measure(argparse.Namespace(calls=30, rounds=3))
    plain_part, graph_part = timed[:6], timed[6:]
    assert sorted(plain_part) == sorted(labels[:2] * 3)  # every plain round before any graph row
    assert graph_part == ["BF16 nn.Linear", g1, g2, "BF16 nn.Linear", g1]  # the failure ended the rounds
    got = {r[0]: r for r in rows}
    assert got["our Linear, current"][3] == 3.0 and got[g1][3] == 2.0 and got[g2][3] == 1.5
    assert got[g1][1] == 200.0 and got[g2][1] == 150.0
