"""What our Triton kernels cost in registers, spills and shared memory on SM90, without a GPU:
each kernel compiled ahead of time for ``sm_90a`` (Triton's own compiler) and its PTX run
through the ``ptxas -v`` that ships with Triton. Prints a table; no device time needed.

    python scripts/kernel_resources.py [--warps 4 8 16]

Needs Triton importable (any machine: it only compiles). A kernel at the 255-register limit
runs one 8-warp block per SM, and spills go to local memory: the first things to look at when
a memory-bound kernel runs below copy speed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib
from benchlib import markdown_table
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_fp8.kernels import triton_cast as tc
from megatron_fp8.kernels import triton_grouped as tg
from megatron_fp8.kernels import triton_persistent as tp

_CAST_ARGS = [("x_ptr", "*bf16"), ("row_ptr", "*fp8e4nv"), ("row_s_ptr", "*fp32"), ("col_ptr", "*fp8e4nv"),
              ("col_s_ptr", "*fp32"), ("tensor_scale_ptr", "*fp32"), ("seg_ptr", "*i32"), ("src_ptr", "*i64"),
              ("part_ptr", "*i32"),
              ("inv_ptr", "*fp32")] + [(n, "i32") for n in ("M", "K", "n_kb", "n_mb", "n_seg", "n_part", "S_PART")]
_PERSISTENT_ARGS = [("x_ptr", "*bf16"), ("row_ptr", "*fp8e4nv"), ("col_ptr", "*fp8e4nv"), ("scale_ptr", "*fp32"),
                    ("inv_ptr", "*fp32"), ("seg_ptr", "*i64"), ("sync_ptr", "*i32")] + [
                        (n, "i32") for n in ("M", "K", "n_kb", "n_seg")]
_ROWS_ARGS = [("a_ptr", "*fp8e4nv"), ("b_ptr", "*fp8e4nv"), ("c_ptr", "*bf16"), ("sa_ptr", "*fp32"),
              ("sb_ptr", "*fp32"), ("off_ptr", "*i32"), ("dst_ptr", "*i32")] + [
                  (n, "i32") for n in ("N", "K", "n_exp", "n_tm", "n_tn")]
_KGROUP_ARGS = [("a_ptr", "*fp8e5"), ("b_ptr", "*fp8e4nv"), ("c_ptr", "*bf16"), ("sa_ptr", "*fp32"),
                ("sb_ptr", "*fp32"), ("off_ptr", "*i32")] + [(n, "i32") for n in ("N", "K", "n_tn", "n_tk", "G")]


def _cast_case(mode: str, row: bool, col: bool, seg: bool = False, fused: bool = True) -> dict[str, Any]:
    return dict(MODE=tc._MODES[mode], DO_ROW=row, DO_COL=col, SEG=seg, ALIGNED=seg, FMAX=448.0, F_EXP=8, F_MANT=3,
                OUT=tl.float8e4nv, T=tc.TILE, FUSED=fused and mode == "tensor", R_AMAX=16, EPS=0.0, POW2=False,
                BP=1024, GATHER=False)


def _persistent_case(row: bool, col: bool, seg: bool) -> dict[str, Any]:
    return dict(DO_ROW=row, DO_COL=col, SEG=seg, FMAX=448.0, OUT=tl.float8e4nv, T=tc.TILE, EPS=0.0, POW2=False, BE=128,
                PHASES=0)


def _rows_case(blocked: bool, imprecise: int | None) -> dict[str, Any]:
    return dict(DST=False, BLOCKED=blocked, BM=128, BN=128, BK=128, GROUP_M=8, IMPRECISE=imprecise, OUT=tl.bfloat16)


# name: (kernel, signature, constexprs, stages)
CASES: dict[str, tuple[Any, list[tuple[str, str]], dict[str, Any], int]] = {
    "cast 1x128 row+col": (tc._cast_tile_kernel, _CAST_ARGS, _cast_case("1x128", True, True), 0),
    "cast 1x128 row": (tc._cast_tile_kernel, _CAST_ARGS, _cast_case("1x128", True, False), 0),
    "cast 1x128 col": (tc._cast_tile_kernel, _CAST_ARGS, _cast_case("1x128", False, True), 0),
    "cast 128x128 row+col": (tc._cast_tile_kernel, _CAST_ARGS, _cast_case("128x128", True, True), 0),
    "cast tensor row+col (fused scale)": (tc._cast_tile_kernel, _CAST_ARGS, _cast_case("tensor", True, True), 0),
    "cast tensor row (fused scale)": (tc._cast_tile_kernel, _CAST_ARGS, _cast_case("tensor", True, False), 0),
    "cast tensor row+col (given scale)": (tc._cast_tile_kernel, _CAST_ARGS,
                                          _cast_case("tensor", True, True, fused=False), 0),
    "cast tensor row+col, experts": (tc._cast_tile_kernel, _CAST_ARGS, _cast_case("tensor", True, True, True), 0),
    "cast tensor row+col, one launch, experts": (tp._current_persistent_kernel, _PERSISTENT_ARGS,
                                                 _persistent_case(True, True, True), 0),
    "cast tensor col, one launch": (tp._current_persistent_kernel, _PERSISTENT_ARGS,
                                    _persistent_case(False, True, False), 0),
    "grouped rows, tensor, fast": (tg._rows_kernel, _ROWS_ARGS, _rows_case(False, None), 3),
    "grouped rows, tensor, promoted": (tg._rows_kernel, _ROWS_ARGS, _rows_case(False, 128), 3),
    "grouped rows, blocks": (tg._rows_kernel, _ROWS_ARGS, _rows_case(True, None), 3),
    "grouped kgroup, tensor, promoted": (tg._kgroup_kernel, _KGROUP_ARGS,
                                         dict(BLOCKED=False, BN=128, BK=128, BT=128, IMPRECISE=128,
                                              OUT=tl.bfloat16, ADD=False, REVERSED=False, PTX_ADD=False), 3),
}


def _ptxas() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def ptxas_report(src: Any, warps: int, options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """Compile ``src`` (an ``ASTSource`` or Gluon's ``GluonASTSource``) ahead of time for
    ``sm_90a`` and run Triton's ``ptxas -v`` on its PTX: the compiled kernel (``asm``,
    ``metadata``) and what ptxas said."""
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps} | (options or {}))
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", ptx, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True, check=True)
    return kernel, out.stdout + out.stderr


def resources(fn: Any, args: list[tuple[str, str]], const: dict[str, Any], warps: int, stages: int) -> list[str]:
    """[registers, spill stores (bytes), stack frame (bytes), shared (bytes)] from ``ptxas -v``."""
    sig = dict(args) | {k: "constexpr" for k in const}
    options: dict[str, Any] = {"num_stages": stages} if stages else {}
    if fn is tp._current_persistent_kernel:  # built as it launches: capped so two programs fit an SM
        options |= tp._register_cap(warps)
    # close to what a JIT launch on the benchmarks' shapes specializes on: 16-byte aligned
    # pointers, M, N, K divisible by 16 (without these no load or store is vectorized); the JIT
    # also marks other integer arguments divisible by 16 and turns those equal to 1 into
    # constants, which this leaves out
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in args
             if t.startswith("*") or n in ("M", "K", "N")}
    kernel, text = ptxas_report(ASTSource(fn, sig, const, attrs), warps, options)
    regs = text.split("Used ")[1].split(" registers")[0] if "Used " in text else "?"
    spills = text.split(" bytes spill stores")[0].rsplit(" ", 1)[-1] if "spill stores" in text else "0"
    stack = text.split(" bytes stack frame")[0].rsplit(" ", 1)[-1] if "stack frame" in text else "0"
    return [regs, spills, stack, str(kernel.metadata.shared)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warps", nargs="*", type=int, default=[4, 8])
    args = p.parse_args()
    rows = []
    for name, (fn, sig, const, stages) in CASES.items():
        for w in args.warps:
            rows.append([name, w, *resources(fn, sig, const, w, stages)])
            print(rows[-1], flush=True)
    print(f"Triton {triton.__version__}, target sm_90a (compiled ahead of time, no GPU)")
    print(markdown_table(["kernel", "warps", "registers", "spill stores B", "stack B", "shared B"], rows))


if __name__ == "__main__":
    main()
