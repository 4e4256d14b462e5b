"""The package's layout holds: no import cycle among its modules (module-level imports, read from
the source, so the GPU-only modules are checked too), every GPU kernel under ``kernels/``, and
``scripts/`` holding only the user-facing benchmarks and profilers."""

from __future__ import annotations

import ast
import os
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "megatron_fp8"


def _module(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """Modules of the package that ``path`` imports at module level (not inside functions):
    ``from pkg import sub`` is an import of the submodule, ``from pkg import name`` of ``pkg``."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in tree.body:
        stmts = [node]
        if isinstance(node, ast.If):  # e.g. TYPE_CHECKING guards: only the runtime branch counts
            stmts = node.orelse if "TYPE_CHECKING" in ast.unparse(node.test) else node.body + node.orelse
        for st in stmts:
            if isinstance(st, ast.Import):
                out |= {a.name for a in st.names if a.name.startswith("megatron_fp8")}
            elif isinstance(st, ast.ImportFrom):
                base = package.split(".")
                if st.level:
                    base = base[: len(base) - st.level + 1]
                    target = ".".join(base + ([st.module] if st.module else []))
                else:
                    target = st.module or ""
                if not target.startswith("megatron_fp8"):
                    continue
                subs = {f"{target}.{a.name}" for a in st.names} & modules
                out |= subs
                if len(subs) < len(st.names):
                    out.add(target)
    return out


def test_no_import_cycles() -> None:
    files = {_module(p): p for p in PKG.rglob("*.py")}
    graph = {m: {i for i in _imports(p, m, set(files)) if i in files and i != m} for m, p in files.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1 and not _init_chain(stack, n):
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def _init_chain(stack: list[str], n: str) -> bool:
    """A package's ``__init__`` reached again through its own submodules is Python's normal import
    order (the package is already in sys.modules), not a cycle."""
    return all(s == n or s.startswith(n + ".") for s in stack[stack.index(n):])


def test_gpu_kernels_live_under_kernels() -> None:
    kernel_markers = ("@triton.jit", "cuLaunchKernel", "__global__")
    outside = [str(p.relative_to(PKG)) for p in PKG.rglob("*") if p.suffix in (".py", ".cu")
               and p.parent.name != "kernels" and any(k in p.read_text() for k in kernel_markers)]
    assert outside == []


def test_scripts_top_level_is_user_facing() -> None:
    scripts = PKG.parent / "scripts"
    top = sorted(f for f in os.listdir(scripts) if (scripts / f).is_file())
    assert len(top) <= 10, top
    assert all(f.startswith(("bench_", "profile_")) or f in ("benchlib.py", "device_run.sh", "trace_step.py")
               for f in top), top
