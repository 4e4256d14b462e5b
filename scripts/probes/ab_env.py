"""A/B of environment settings on one benchmark script: every run in a fresh process, the
settings alternated round by round (A B A B ...), each reading kept.

    python scripts/ab_env.py --set MEGATRON_FP8_CUDA_CAST=1 --set MEGATRON_FP8_CUDA_CAST=0 \\
        --rounds 2 --match "CUDA graph" -- bench_grouped.py --recipes blockwise

Why: the same code measured in two processes can differ by ~5% (docs/benchmarks.md, run U), so
one reading per setting cannot separate close numbers; alternating fresh processes spreads
whatever drifts over all settings. The benchmark must take ``--out DIR`` and write its markdown
table there (``benchlib.write_outputs``). Prints one row per row of that table (``--key``
columns, filtered by ``--match``): every reading of ``--column`` per setting, their median, and
each setting's median over the first one's.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib
from benchlib import markdown_table

HERE = Path(__file__).resolve().parent


def parse_setting(text: str) -> dict[str, str]:
    """``"A=1,B=x"`` -> ``{"A": "1", "B": "x"}``."""
    out = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--set {text!r}: expected NAME=VALUE[,NAME=VALUE...]")
        out[name.strip()] = value.strip()
    return out


def parse_table(markdown: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in ``markdown``, as ``{header: cell}``."""
    lines = [ln.strip() for ln in markdown.splitlines()]
    start = next((i for i, ln in enumerate(lines) if ln.startswith("|")), None)
    if start is None:
        return []
    table = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        table.append([c.strip() for c in ln.strip("|").split("|")])
    header, body = table[0], [r for r in table[1:] if not set("".join(r)) <= set("-: ")]
    return [dict(zip(header, r)) for r in body if len(r) == len(header)]


def run_once(command: list[str], setting: dict[str, str]) -> str:
    """Run the benchmark once with ``setting`` added to the environment; its markdown output."""
    script = Path(command[0])
    script = script if script.is_absolute() else HERE / script
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, **setting}
        done = subprocess.run([sys.executable, str(script), *command[1:], "--out", out], env=env,
                              cwd=script.parent, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{script.name} with {setting} failed (rc {done.returncode}):\n{done.stdout[-2000:]}"
                             f"\n{done.stderr[-2000:]}")
        tables = sorted(Path(out).glob("*.md"))
        if not tables:
            raise SystemExit(f"{script.name} wrote no markdown table under --out")
        return "\n".join(t.read_text() for t in tables)


def summarize(readings: list[list[list[dict[str, str]]]], names: list[str], key: list[str], column: str,
              match: str) -> tuple[list[str], list[list[object]]]:
    """``readings[round][setting]``: parsed tables. Header and rows: the key cells, per setting
    the readings and their median, then each later setting's median over the first's."""
    pattern = re.compile(match)
    order: list[tuple[str, ...]] = []
    values: dict[tuple[str, ...], list[list[float]]] = {}
    for per_round in readings:
        for s, table in enumerate(per_round):
            for row in table:
                k = tuple(row.get(c, "") for c in key)
                try:
                    v = float(row.get(column, ""))
                except ValueError:
                    continue
                if not any(pattern.search(cell) for cell in row.values()):
                    continue
                if k not in values:
                    order.append(k)
                    values[k] = [[] for _ in names]
                values[k][s].append(v)
    header = [*key]
    for n in names:
        header += [f"{n}: {column}", f"{n}: median"]
    header += [f"{n} / {names[0]}" for n in names[1:]]
    rows: list[list[object]] = []
    for k in order:
        cells: list[object] = [*k]
        meds = [statistics.median(v) if v else float("nan") for v in values[k]]
        for v, m in zip(values[k], meds):
            cells += [" / ".join(f"{x:.4g}" for x in v) or "-", f"{m:.4g}"]
        cells += [f"{m / meds[0]:.3f}" for m in meds[1:]]
        rows.append(cells)
    return header, rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: ab_env.py --set A=1 --set A=0 [--rounds N] ... -- SCRIPT [ARGS]")
    split = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", action="append", required=True, dest="settings", help="NAME=VALUE[,NAME=VALUE]")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--column", default="fwd+bwd ms")
    p.add_argument("--key", default="shape,path", help="columns that name a row (comma separated)")
    p.add_argument("--match", default="", help="keep rows with a cell matching this regex")
    args = p.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        raise SystemExit("ab_env.py: name the benchmark script after --")
    settings = [parse_setting(s) for s in args.settings]
    names = [",".join(f"{k}={v}" for k, v in s.items()) for s in settings]
    readings = []
    for r in range(args.rounds):
        per_round = []
        for name, setting in zip(names, settings):
            print(f"round {r + 1}/{args.rounds}: {name}", flush=True)
            per_round.append(parse_table(run_once(command, setting)))
        readings.append(per_round)
        # the table so far after every round: a run cut short by a time limit keeps its readings
        header, rows = summarize(readings, names, args.key.split(","), args.column, args.match)
        print(f"\n{' '.join(command)}; {r + 1} of {args.rounds} rounds, settings alternated, one process each\n")
        print(markdown_table(header, rows), flush=True)


if __name__ == "__main__":
    main()
