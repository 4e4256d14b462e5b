"""Every code block in README.md, docs/ and examples/ READMEs that claims to run does: Python
blocks run in a fresh process, YAML blocks load as megatron_fp8 configs, shell blocks run, are
the README's two commands (which CI runs verbatim: checked here against ``.ci/run``), or say on
their first line what they need (``# needs: ...``) and are left to the user."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_fp8.config import load_config

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("examples/**/README.md"))]


def _blocks(lang: str) -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for block in re.findall(rf"```{lang}\n(.*?)```", doc.read_text(), re.S):
            out.append((f"{doc.relative_to(REPO)}:{len(out)}", block))
    return out


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


@pytest.mark.parametrize("where, code", _blocks("python"), ids=lambda v: v if ":" in str(v) else "")
def test_python_blocks_run(where: str, code: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=_env())
    assert proc.returncode == 0, f"{where}:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("where, text", _blocks("yaml"), ids=lambda v: v if ":" in str(v) else "")
def test_yaml_blocks_are_valid_configs(where: str, text: str, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    load_config(path)


def test_shell_blocks_run_are_ci_commands_or_say_what_they_need(tmp_path: Path) -> None:
    ci = (REPO / ".ci" / "run").read_text()
    ran = 0
    for where, block in _blocks("bash"):
        first = block.strip().splitlines()[0]
        if first.startswith("# needs:"):
            continue
        if "train_tp.py" in block or "pytest -q tests" in block:  # the README's two commands
            assert block.strip() in ci or block.strip().split("&&")[-1].strip() in ci, where
            continue
        if block.strip() == "pip install torch==2.13.0 && pip install -e .":
            assert block.strip() in ci, where  # the install step of the first command
            continue
        proc = subprocess.run(["bash", "-c", block.replace("python ", f"{sys.executable} -W ignore ")],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env())
        assert proc.returncode == 0, f"{where}:\n{proc.stderr[-3000:]}"
        ran += 1
    assert ran >= 1  # the audit command


def test_readme_is_for_users() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < 200
    assert not re.search(r"\d\s*(us|µs)\b", text)  # no microsecond figures: internals go to docs/
    assert "../shared" not in text  # the project does not point outside itself
