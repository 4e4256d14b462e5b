"""Probe (GPU): do CUTLASS's blockwise-scaled FP8 kernels beat cuBLAS on the grouped blocks step?

    cd scripts && CUBLASLT_WORKSPACE_SIZE=0 python probe_cutlass_blockwise.py --cutlass DIR [--build OUT]

Why: the graphed blocks step (8 experts x 2048 tokens) sits at ~1.28x the BF16 step against
issue 5's 1.3x, and its GEMMs are four fifths of it; the wgrad (both operands 1x128 along the
tokens) runs at ~850 TFLOP/s against ~1010-1130 for the dgrad of the same FLOPs (docs/benchmarks.md
runs X-Z). cuBLAS holds no faster kernel for it (run Y) and our Triton and Gluon kernels are
slower (run Z). CUTLASS 4 has its own SM90 blockwise-scaled kernels, a cooperative one and a
ping-pong one (two consumer warpgroups, each with its own 64-row tile, one's scaling and
epilogue overlapping the other's MMAs): this times them.

``scripts/cutlass_blockwise.cu`` is built once per configuration (tile, cluster, schedule, the
weight's scale granularity) with ``nvcc`` against CUTLASS's headers (``--cutlass``: the folder
holding ``include`` and ``tools/util/include``; the ``nvidia-cutlass`` wheel has them under
``cutlass_library/source``) into one shared library loaded with ctypes. Each configuration runs
the experts' GEMMs as ``GroupedLinear`` casts their operands (``probe_gemm_streams.gemm_sets``),
one CUTLASS call per expert, replayed from a CUDA graph and timed (``do_bench`` median, L2
flushed), against torch's ``scaled_mm`` per expert (cuBLAS) in the same form. Every row says
whether its outputs equal cuBLAS's bit for bit and their relative difference.

On the H200 (docs/benchmarks.md run AB; ``device_run.sh cutlass`` builds it there) every build's
bits equal cuBLAS's and none is faster: cooperative 1-8% slower on fprop and dgrad and 6-20% on
the wgrad, ping-pong 26-41% slower.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib
from benchlib import rel_error
from probe_gemm_streams import SHAPES, Pair, gemm_sets, on_streams

from megatron_fp8.gemm import _block_scale_layout
from megatron_fp8.quant.formats import ScaleLayout

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Config:
    """One build of ``cutlass_blockwise.cu``."""

    gemms: str  # "wgrad" (B 1x128) or "rows" (fprop and dgrad: B 128x128)
    pingpong: bool
    cluster: tuple[int, int]

    @property
    def name(self) -> str:
        kind = "pp" if self.pingpong else "coop"
        return f"{self.gemms}_{kind}_c{self.cluster[0]}x{self.cluster[1]}"

    @property
    def tile(self) -> tuple[int, int]:
        return (64, 128) if self.pingpong else (128, 128)

    def defines(self) -> list[str]:
        return [f"-DMFP8_NAME={self.name}", f"-DMFP8_TILE_M={self.tile[0]}", f"-DMFP8_TILE_N={self.tile[1]}",
                f"-DMFP8_CLUSTER_M={self.cluster[0]}", f"-DMFP8_CLUSTER_N={self.cluster[1]}",
                f"-DMFP8_PINGPONG={int(self.pingpong)}", f"-DMFP8_GN={1 if self.gemms == 'wgrad' else 128}",
                "-DMFP8_A_E5M2=0"]


CONFIGS = [Config(g, pp, c) for g in ("wgrad", "rows") for pp in (False, True) for c in ((1, 1), (2, 1), (1, 2))]


def build(cutlass: str, out: str, configs: Sequence[Config] = CONFIGS, jobs: int = 2) -> str:
    """Compile every configuration (``jobs`` at a time) and link them into ``out``/libcb.so."""
    os.makedirs(out, exist_ok=True)
    src = os.path.join(HERE, "cutlass_blockwise.cu")
    flags = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
             "-Xcompiler", "-fPIC", "-DNDEBUG", f"-I{cutlass}/include", f"-I{cutlass}/tools/util/include"]

    def one(c: Config) -> str:
        obj = os.path.join(out, c.name + ".o")
        if not os.path.exists(obj):
            subprocess.run(["nvcc", *flags, *c.defines(), "-c", src, "-o", obj], check=True)
        print(f"built {c.name}", flush=True)
        return obj

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        objs = list(pool.map(one, configs))
    lib = os.path.join(out, "libcb.so")
    subprocess.run(["nvcc", "-shared", "-o", lib, *objs], check=True)
    return lib


def _contiguous(a: torch.Tensor) -> None:
    if not a.is_contiguous():
        raise SystemExit("probe_cutlass_blockwise: an operand is not contiguous")


def _scales(op: object) -> torch.Tensor:
    """The operand's scales in CUTLASS's M/N-major layout: ``(row_block) + (k_block) * row_blocks``."""
    if op.layout is ScaleLayout.BLOCK_1x128:
        s = _block_scale_layout(op)  # (rows, k/128), strides (1, rows)
        if s.stride(0) != 1 or s.stride(1) != s.shape[0]:
            raise SystemExit("probe_cutlass_blockwise: unexpected 1x128 scale strides")
        return s
    return op.scale_inv.t().contiguous()  # (k/128, rows/128)


def cutlass_runner(fn: Callable[..., int], pairs: Sequence[Pair], outs: Sequence[torch.Tensor]) -> Callable[[], None]:
    """A closure running one CUTLASS call per expert into ``outs``; raises on a refused call."""
    calls = []
    for (a, b, _), o in zip(pairs, outs):
        _contiguous(a.data)
        _contiguous(b.data)
        sa, sb = _scales(a), _scales(b)
        calls.append((a.data, b.data, sa, sb, o, a.data.shape[0], b.data.shape[0], a.data.shape[1]))

    def run() -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        for a, b, sa, sb, o, m, n, k in calls:
            rc = fn(ctypes.c_void_p(a.data_ptr()), ctypes.c_void_p(b.data_ptr()), ctypes.c_void_p(sa.data_ptr()),
                    ctypes.c_void_p(sb.data_ptr()), ctypes.c_void_p(o.data_ptr()), m, n, k, stream)
            if rc:
                raise RuntimeError(f"CUTLASS call refused ({rc}) for {m}x{n}x{k}")

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cutlass", help="folder with CUTLASS's include and tools/util/include (to build)")
    p.add_argument("--build", default=None, help="build folder (default: a temporary one)")
    p.add_argument("--lib", default=None, help="a libcb.so built before (skips the build)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    args = p.parse_args()
    if not args.lib and not args.cutlass:
        p.error("--cutlass DIR is needed to build (or --lib a libcb.so built before)")
    lib_path = args.lib or build(args.cutlass, args.build or tempfile.mkdtemp(), jobs=args.jobs)
    if not torch.cuda.is_available():
        print(f"built {lib_path}; timing needs CUDA")
        return
    from benchlib import environment, markdown_table, median_ms

    from megatron_fp8.testing import capture_step, same_bits

    lib = ctypes.CDLL(lib_path)
    rows = []
    for k, n in SHAPES:
        sets, _ = gemm_sets("blockwise", args.experts, args.tokens, k, n, torch.device("cuda"))
        for what, pairs in sets.items():
            flops = 2 * sum(a.data.shape[0] * b.data.shape[0] * a.data.shape[1] for a, b, _ in pairs)
            ref_graph, _ = capture_step(on_streams(pairs, []))
            ref_graph.replay()
            torch.cuda.synchronize()
            ref = [o.clone() for _, _, o in pairs]
            base = median_ms(ref_graph.replay)
            rows.append([f"K={k} N={n}", what, "cuBLAS (torch)", base, f"{flops / base / 1e9:.0f}", "1.000", "ref", ""])
            print(rows[-1], flush=True)
            for c in CONFIGS:
                if (c.gemms == "wgrad") != (what == "wgrad"):
                    continue
                outs = [torch.empty_like(o) for _, _, o in pairs]
                try:
                    graph, _ = capture_step(cutlass_runner(getattr(lib, c.name), pairs, outs))
                except RuntimeError as e:
                    rows.append([f"K={k} N={n}", what, c.name, "-", "-", "-", str(e)[:40], ""])
                    print(rows[-1], flush=True)
                    continue
                graph.replay()
                torch.cuda.synchronize()
                ms = median_ms(graph.replay)
                err = max(rel_error(o, r) for o, r in zip(outs, ref))
                rows.append([f"K={k} N={n}", what, c.name, ms, f"{flops / ms / 1e9:.0f}", f"{ms / base:.3f}",
                             "equal" if same_bits(outs, ref) else "differ", f"{err:.2e}"])
                print(rows[-1], flush=True)
    print(f"\n{environment()}\n")
    print(markdown_table(["shape", "GEMMs", "kernel", "ms / 8", "TFLOP/s", "vs cuBLAS", "bits", "rel. diff"], rows))


if __name__ == "__main__":
    main()
