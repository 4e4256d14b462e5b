"""Probe (GPU): does cuBLASLt have a faster kernel than the one torch gets for the blocks wgrad?

    cd scripts && CUBLASLT_WORKSPACE_SIZE=0 python probe_cublaslt_algos.py [--experts 8] [--tokens 2048]

Why: in the graphed blocks step (K=4096, N=2048) the wgrad, both operands 1x128 along the
tokens, takes 37.3 us an expert against 29.5 for the dgrad (1x128 x 128x128) of the same
shape and FLOPs (docs/benchmarks.md run X). torch's ``scaled_mm`` takes cuBLASLt's first
heuristic answer. This script calls cuBLASLt itself (ctypes on the ``libcublasLt`` torch
loaded), for the experts' operands as ``GroupedLinear`` casts them (``probe_gemm_streams.
gemm_sets``): it lists the heuristic's answers, then every configuration around them (other
tiles, cluster shapes, custom options, swizzles, stages) that ``cublasLtMatmulAlgoCheck``
accepts without a workspace, and times each as a CUDA graph of the experts' GEMMs (a short pass
for all, then ``do_bench``'s median for the fastest). Every row says whether its outputs equal
torch's bit for bit, and its relative difference from them. Prints one table per GEMM and shape.
Measured on an H200 (docs/benchmarks.md run Y): torch already gets the fastest wgrad kernel;
nothing around it that needs no workspace runs faster.

``--host`` instead measures host time per GEMM, the package's ``gemm`` (torch's ``scaled_mm``)
against a bare cuBLASLt loop with its descriptors built once: ~32-67 us against ~11-20 us on the
H200 (run Y), the same kernels and bits.

cuBLASLt is column-major: ``out[m, n] = a @ b.T`` (a ``[m, k]``, b ``[n, k]``, both K-major) is
``D[n, m] = op(A) @ B`` with A = b's bytes seen as ``[k, n]`` (transposed), B = a's as ``[k, m]``,
A's scales b's and B's a's, in the layouts ``gemm._block_scale_layout`` hands torch.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from probe_gemm_streams import SHAPES, Pair, gemm_sets, on_streams

from megatron_fp8.gemm import _block_scale_layout

# the structs and enum values shared with the package's direct cuBLASLt call (kernels/cublaslt.py)
from megatron_fp8.kernels.cublaslt import (
    COMPUTE_32F,
    DESC_A_SCALE_MODE,
    DESC_A_SCALE_POINTER,
    DESC_B_SCALE_MODE,
    DESC_B_SCALE_POINTER,
    DESC_TRANSA,
    DESC_TRANSB,
    DTYPES,
    OP_N,
    OP_T,
    PREF_MAX_WORKSPACE_BYTES,
    R_32F,
    Algo,
    Heuristic,
)
from megatron_fp8.quant.formats import ScaleLayout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib

SCALE_MODES = {ScaleLayout.TENSOR: 0, ScaleLayout.BLOCK_1x128: 4, ScaleLayout.BLOCK_128x128: 5}  # + SCALAR_32F
CAP_SWIZZLING, CAP_TILE_IDS, CAP_CUSTOM_OPTION_MAX, CAP_STAGES_IDS = 2, 6, 7, 13
CFG = {"id": (0, 4), "tile": (1, 4), "splitk": (2, 4), "reduction": (3, 4), "swizzle": (4, 4), "custom": (5, 4),
       "stages": (6, 4), "inner": (7, 2), "cluster": (8, 2)}
CLUSTERS = range(0, 17)  # cublasLtClusterShape_t values; AlgoCheck refuses the ones an algorithm lacks


def _library() -> ctypes.CDLL:
    """The libcublasLt torch already loaded (found in this process's memory map)."""
    torch.ones(16, 16, device="cuda") @ torch.ones(16, 16, device="cuda")  # loads cuBLAS(Lt)
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcublasLt" in line}
    if not paths:
        raise SystemExit("probe_cublaslt_algos: torch has not loaded libcublasLt")
    return ctypes.CDLL(sorted(paths)[0])


class Lt:
    """The few cuBLASLt calls this probe needs; every status checked."""

    def __init__(self) -> None:
        self.lib = _library()
        self.handle = ctypes.c_void_p()
        self.ok(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")

    @staticmethod
    def ok(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what}: cuBLAS status {status}")

    def set_desc(self, desc: ctypes.c_void_p, attr: int, value: ctypes._SimpleCData) -> None:
        self.ok(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                f"desc attribute {attr}")

    def layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        lay = ctypes.c_void_p()
        self.ok(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, ctypes.c_uint64(rows),
                                                    ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
        return lay

    def cap(self, algo: Algo, attr: int) -> list[int]:
        written = ctypes.c_size_t()
        self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(written))
        n = max(written.value // 4, 1)
        buf = (ctypes.c_uint32 * n)()
        self.ok(self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, buf, 4 * n,
                                                           ctypes.byref(written)), f"cap {attr}")
        return list(buf)[: written.value // 4]

    def config(self, algo: Algo) -> dict[str, int]:
        out = {}
        for name, (attr, size) in CFG.items():
            buf, written = ctypes.c_uint64(0), ctypes.c_size_t()
            self.ok(self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(buf), size,
                                                                  ctypes.byref(written)), f"config {name}")
            out[name] = buf.value
        return out

    def set_config(self, algo: Algo, name: str, value: int) -> bool:
        attr, size = CFG[name]
        buf = (ctypes.c_uint32 if size == 4 else ctypes.c_uint16)(value)
        return self.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(buf), size) == 0


@dataclass
class Problem:
    """One GEMM shape of the experts: a descriptor per expert (its scale pointers) and the four
    layouts, shared."""

    lt: Lt
    pairs: Sequence[Pair]
    descs: list[ctypes.c_void_p]
    layouts: tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # A, B, D (C = D)
    keep: list[torch.Tensor]
    types: tuple[int, int]

    @classmethod
    def build(cls, lt: Lt, pairs: Sequence[Pair]) -> Problem:
        a0, b0, _ = pairs[0]
        (m, k), (n, _) = a0.shape, b0.shape
        keep, descs = [], []
        for a, b, _ in pairs:
            desc = ctypes.c_void_p()
            lt.ok(lt.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, R_32F), "desc")
            lt.set_desc(desc, DESC_TRANSA, ctypes.c_int32(OP_T))
            lt.set_desc(desc, DESC_TRANSB, ctypes.c_int32(OP_N))
            lt.set_desc(desc, DESC_A_SCALE_MODE, ctypes.c_int32(SCALE_MODES[b.layout]))
            lt.set_desc(desc, DESC_B_SCALE_MODE, ctypes.c_int32(SCALE_MODES[a.layout]))
            sa, sb = (_block_scale_layout(o) if o.layout is not ScaleLayout.TENSOR else o.scale_inv for o in (b, a))
            keep += [sa, sb]
            lt.set_desc(desc, DESC_A_SCALE_POINTER, ctypes.c_void_p(sa.data_ptr()))
            lt.set_desc(desc, DESC_B_SCALE_POINTER, ctypes.c_void_p(sb.data_ptr()))
            descs.append(desc)
        types = (DTYPES[b0.data.dtype], DTYPES[a0.data.dtype])
        lay = (lt.layout(types[0], k, n, k), lt.layout(types[1], k, m, k), lt.layout(DTYPES[torch.bfloat16], n, m, n))
        return cls(lt, pairs, descs, lay, keep, types)

    def heuristics(self, count: int = 64) -> list[Heuristic]:
        pref = ctypes.c_void_p()
        self.lt.ok(self.lt.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        ws = ctypes.c_uint64(0)
        self.lt.ok(self.lt.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                                    8), "workspace")
        res, got = (Heuristic * count)(), ctypes.c_int()
        a, b, d = self.layouts
        self.lt.ok(self.lt.lib.cublasLtMatmulAlgoGetHeuristic(self.lt.handle, self.descs[0], a, b, d, d, pref, count,
                                                              res, ctypes.byref(got)), "heuristic")
        return [res[i] for i in range(got.value) if res[i].state == 0]

    def check(self, algo: Algo) -> Heuristic | None:
        res = Heuristic()
        a, b, d = self.layouts
        st = self.lt.lib.cublasLtMatmulAlgoCheck(self.lt.handle, self.descs[0], a, b, d, d, ctypes.byref(algo),
                                                 ctypes.byref(res))
        return res if st == 0 and res.workspace == 0 else None

    def configs(self, seeds: Sequence[Algo], limit: int) -> list[Algo]:
        """Configurations around the heuristic's answers that AlgoCheck accepts with no
        workspace (split-K off), up to ``limit``: each answer with every tile, cluster shape,
        custom option and swizzle its algorithm offers (its stages kept), then with every
        stages id (its tile kept)."""
        found: dict[tuple[int, ...], Algo] = {}
        for seed in seeds:
            cfg = self.lt.config(seed)
            tiles = self.lt.cap(seed, CAP_TILE_IDS) or [cfg["tile"]]
            stages = self.lt.cap(seed, CAP_STAGES_IDS) or [cfg["stages"]]
            swz = [0, 1] if (self.lt.cap(seed, CAP_SWIZZLING) or [0])[0] else [cfg["swizzle"]]
            custom = range((self.lt.cap(seed, CAP_CUSTOM_OPTION_MAX) or [0])[0] + 1)
            if seed is seeds[0]:
                print(f"  first answer {cfg}: tiles {tiles}, stages {stages}, swizzle {list(swz)}, "
                      f"custom options {len(custom)}", flush=True)
            grid = [{"tile": t, "cluster": c, "custom": o, "swizzle": w}
                    for t, c, o, w in itertools.product(tiles, CLUSTERS, custom, swz)]
            grid += [{"stages": st} for st in stages]
            for change in grid:
                algo = Algo()
                ctypes.memmove(ctypes.byref(algo), ctypes.byref(seed), ctypes.sizeof(Algo))
                if not all(self.lt.set_config(algo, key, v) for key, v in change.items()):
                    continue
                key = tuple(self.lt.config(algo).values())
                if key not in found and self.check(algo) is not None:
                    found[key] = algo
                    if len(found) >= limit:
                        return list(found.values())
        return list(found.values())

    def runner(self, algo: Algo) -> Callable[[], None]:
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        a_lay, b_lay, d_lay = self.layouts

        def run() -> None:
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            for desc, (a, b, out) in zip(self.descs, self.pairs):
                self.lt.ok(self.lt.lib.cublasLtMatmul(
                    self.lt.handle, desc, ctypes.byref(one), ctypes.c_void_p(b.data.data_ptr()), a_lay,
                    ctypes.c_void_p(a.data.data_ptr()), b_lay, ctypes.byref(zero), ctypes.c_void_p(out.data_ptr()),
                    d_lay, ctypes.c_void_p(out.data_ptr()), d_lay, ctypes.byref(algo), None, ctypes.c_size_t(0),
                    stream), "cublasLtMatmul")

        return run


def quick_us(graph: torch.cuda.CUDAGraph, n: int = 20) -> float:
    """Median of ``n`` single replays, us (events; the first-pass ranking)."""
    times = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1000)
    return sorted(times)[n // 2]


def host_table(lt: Lt, experts: int, tokens: int) -> str:
    """Host and device microseconds per GEMM, each set of the experts' GEMMs enqueued 20 times
    back to back: the package's ``gemm`` (torch's ``scaled_mm``) against this probe's bare
    cuBLASLt loop (first heuristic answer, descriptors built once per expert), for current
    scaling and blocks. Host at or above device: the GEMMs are launch-bound."""
    from benchlib import host_and_device_ms, markdown_table

    from megatron_fp8.testing import same_bits

    rows = []
    for k, n in SHAPES:
        for recipe in ("current", "blockwise"):
            sets, _ = gemm_sets(recipe, experts, tokens, k, n, torch.device("cuda"))
            for what, pairs in sets.items():
                prob = Problem.build(lt, pairs)
                heur = prob.heuristics(1)
                if not heur:
                    rows.append([f"K={k} N={n}", recipe, what, "no cuBLASLt answer", *[""] * 4])
                    continue
                times, outs = [], []
                for run in (on_streams(pairs, []), prob.runner(heur[0].algo)):
                    run()
                    outs.append([o.clone() for _, _, o in pairs])
                    times += [t * 1e3 / len(pairs) for t in host_and_device_ms(run)]
                equal = same_bits(outs[1], outs[0])
                rows.append([f"K={k} N={n}", recipe, what, *times, "equal" if equal else "DIFFER"])
                print(rows[-1], flush=True)
    return markdown_table(["shape", "recipe", "GEMM", "torch host us", "torch device us", "cuBLASLt host us",
                           "cuBLASLt device us", "bits"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--gemms", nargs="*", default=["wgrad", "dgrad"])
    p.add_argument("--limit", type=int, default=400, help="configurations timed per GEMM and shape")
    p.add_argument("--limit-other", type=int, default=120, help="the same for the dgrad and fprop")
    p.add_argument("--host", action="store_true", help="host vs device time per GEMM instead of the search")
    p.add_argument("--top", type=int, default=8, help="configurations re-timed with do_bench")
    args = p.parse_args()
    from benchlib import environment, markdown_table, median_ms, rel_error

    from megatron_fp8.testing import capture_step, same_bits

    lt = Lt()
    if args.host:
        table = host_table(lt, args.experts, args.tokens)
        print(f"\n{environment()}\n\n{table}")
        return
    tables = []
    for k, n in SHAPES:
        sets, _ = gemm_sets("blockwise", args.experts, args.tokens, k, n, torch.device("cuda"))
        for what in args.gemms:
            pairs = sets[what]
            prob = Problem.build(lt, pairs)
            graph, _ = capture_step(on_streams(pairs, []))  # torch's scaled_mm per expert, as the package runs it
            graph.replay()
            torch.cuda.synchronize()
            ref = [o.clone() for _, _, o in pairs]
            flops = 2.0 * sum(a.shape[0] * b.shape[0] * a.shape[1] for a, b, _ in pairs)
            rows = [["torch scaled_mm", "-", median_ms(graph.replay), "ref", 0.0]]
            heur = prob.heuristics()
            ids = sorted({lt.config(h.algo)["id"] for h in heur})
            limit = args.limit if what == "wgrad" else args.limit_other
            cands = [("heuristic", i, h.algo) for i, h in enumerate(heur)]
            t0 = time.perf_counter()
            cands += [("search", j, a) for j, a in enumerate(prob.configs([h.algo for h in heur], limit))]
            print(f"  search took {time.perf_counter() - t0:.1f} s", flush=True)
            print(f"K={k} N={n} {what}: {len(heur)} heuristic answers, algorithm ids {ids}, "
                  f"{len(cands) - len(heur)} configurations found", flush=True)
            timed = []
            for src, i, algo in cands:
                run = prob.runner(algo)
                for _, _, o in pairs:
                    o.fill_(float("nan"))
                try:
                    g, _ = capture_step(run, warmup=1)
                except RuntimeError as exc:
                    print(f"  {src} {i}: {exc}", flush=True)
                    continue
                g.replay()
                torch.cuda.synchronize()
                equal = same_bits([o for _, _, o in pairs], ref)
                diff = max(rel_error(o, r) for (_, _, o), r in zip(pairs, ref))
                timed.append((quick_us(g), src, i, algo, g, equal, diff))
            timed.sort(key=lambda t: t[0])
            shown = timed[: args.top] + [t for t in timed[args.top:] if t[1] == "heuristic" and t[2] == 0]
            for _us, src, i, algo, g, equal, diff in shown:
                cfg = lt.config(algo)
                rows.append([f"{src} {i}", " ".join(f"{key}={v}" for key, v in cfg.items()), median_ms(g.replay),
                             "equal" if equal else "differ", diff])
            for r in rows:
                r.insert(3, flops / (r[2] * 1e-3) / 1e12)
            title = f"K={k} N={n} {what} ({args.experts} experts x {args.tokens} tokens; {len(timed)} timed)"
            tables.append(title + "\n\n" + markdown_table(["kernel", "config", "ms", "TFLOP/s", "bits vs torch",
                                                           "rel. diff"], rows))
            print(f"  fastest: {rows[1][:3]}", flush=True)
    print(f"\n{environment()}\n")
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
