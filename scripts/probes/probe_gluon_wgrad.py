"""Probe (GPU): the experts' blocks wgrad (both operands 1x128 along the tokens) through our
Gluon kernels (``gluon_wgrad.py``, next to this script) against cuBLAS per expert and the
package's Triton kernel.

    cd scripts && CUBLASLT_WORKSPACE_SIZE=0 python probe_gluon_wgrad.py [--experts 8] [--tokens 2048]
        [--configs 4,1,2 4,1,4 ...]

Why: cuBLAS's kernel for this scale pair is the one part of the graphed blocks step above its
peers (docs/benchmarks.md runs X and Y: 37.3 us an expert against 29.5 for the 1x128 x 128x128
dgrad of the same shape), and it has no faster configuration. The Gluon kernels overlap each
128-token step's FP32 promotion with the next step's MMA. Measured (docs/benchmarks.md run Z):
none beats cuBLAS (at best ~670 TFLOP/s against ~860), so the package keeps cuBLAS.

For each shape: the operands as ``GroupedLinear`` casts them (``probe_gemm_streams.gemm_sets``),
their buffers as ``gemm_grouped.grouped_wgrad`` hands them to the Triton kernel; each path's
outputs against cuBLAS's (relative Frobenius error, and the largest difference in units of the
output's largest value) and its time as a CUDA graph (``do_bench`` median, L2 flushed). A
config is ``stages,warps_along_n,unroll[,scaled]`` for the ``cp.async`` kernel (``scaled`` 0: the
scales left out, wrong results, the pipeline's own time), ``0,stages,unroll`` for the TMA one,
``1,stages,unroll`` for the TMA one launched per expert with descriptors built on the host,
``2,stages,unroll`` for that one warp-specialized (a copier warp, mbarrier hand-offs).
Then unequal splits (zeros included) against cuBLAS.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import gluon_wgrad as gw
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib
from benchlib import environment, markdown_table, median_ms, rel_error
from probe_gemm_streams import SHAPES, gemm_sets, on_streams

from megatron_fp8 import gemm_grouped as gg
from megatron_fp8.kernels import triton_grouped as tg
from megatron_fp8.quant.kernels import segment_offsets
from megatron_fp8.testing import capture_step, same_bits


def _buffers(pairs: list, splits: list[int], n: int, k: int) -> tuple[torch.Tensor, ...]:
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    got = gg._triton_grouped_starts(a, b, gg._first(a), gg._first(b), torch.bfloat16, splits, True,
                                    ("tokens", "tokens"), (n, k))
    if got is None:
        raise SystemExit("probe_gluon_wgrad: the wgrad operands are not in one buffer each")
    (a_buf, sa), (b_buf, sb) = gg._buffers(a, got[1]), gg._buffers(b, got[2])
    return a_buf, b_buf, sa, sb, segment_offsets(splits, a_buf.device)


def _graphed(fn: Callable[[], object]) -> float:
    return median_ms(capture_step(fn)[0].replay)


def _check_out(failures: list[str], what: str, out: torch.Tensor, want: torch.Tensor, scaled: bool = True
               ) -> list[object]:
    """Relative error against cuBLAS and whether the bits are equal; a scaled result off by more
    than FP32 rounding could explain (1e-3) is a bug and recorded."""
    err, equal = rel_error(out, want), same_bits([out], [want])
    if scaled and not err <= 1e-3:  # NaN included
        failures.append(f"{what}: relative error {err:.2e} against cuBLAS")
    return [f"{err:.2e}", equal if scaled else "- (wrong on purpose)"]


def run_shape(experts: int, tokens: int, k: int, n: int, configs: list[tuple[int, ...]], failures: list[str]
              ) -> list[list[object]]:
    sets, _ = gemm_sets("blockwise", experts, tokens, k, n, torch.device("cuda"))
    pairs = sets["wgrad"]
    splits = [tokens] * experts
    bufs = _buffers(pairs, splits, n, k)
    flops = 2.0 * experts * tokens * n * k
    shape = f"K={k} N={n}"
    ms = _graphed(on_streams(pairs, []))
    want = torch.stack([o for _, _, o in pairs])
    rows: list[list[object]] = [[shape, "cuBLAS per expert", round(ms, 4), round(flops / ms / 1e9), "-", "-"]]
    a_buf, b_buf, sa, sb, off = bufs

    def triton() -> torch.Tensor:
        return tg.grouped_kgroup(a_buf, b_buf, sa, sb, off, n, k, torch.bfloat16, blocked=True)

    ms = _graphed(triton)
    rows.append([shape, "Triton kgroup", round(ms, 4), round(flops / ms / 1e9),
                 *_check_out(failures, f"{shape} Triton", triton(), want)])
    for config in configs:
        fn, name = _runner(config, bufs, splits, n, k), _name(config)
        try:
            out = fn()
            torch.cuda.synchronize()
        except Exception as exc:  # a config that does not build or launch: recorded, the others go on
            failures.append(f"{shape} {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            rows.append([shape, name, "failed", "-", "-", "-"])
            continue
        ms = _graphed(fn)
        rows.append([shape, name, round(ms, 4), round(flops / ms / 1e9),
                     *_check_out(failures, f"{shape} {name}", out, want, scaled=_scaled(config))])
        print(rows[-1], flush=True)
    return rows


def _scaled(config: tuple[int, ...]) -> bool:
    return config[0] in (0, 1, 2) or bool(config[3])


def _runner(config: tuple[int, ...], bufs: tuple[torch.Tensor, ...], splits: list[int], n: int, k: int
            ) -> Callable[[], torch.Tensor]:
    """The kernel call a config names: ``(stages, wn, unroll, scaled)`` for the cp.async kernel
    (stages >= 3), ``(0, stages, unroll)`` for the TMA one, ``(1, stages, unroll)`` for the TMA
    one launched per expert, ``(2, stages, unroll)`` for that one warp-specialized."""
    a_buf, b_buf, sa, sb, off = bufs
    out = torch.bfloat16
    if config[0] in (1, 2):
        stages, unroll, ws = config[1], config[2], config[0] == 2
        return lambda: gw.grouped_wgrad_tma_experts(a_buf, b_buf, sa, sb, splits, n, k, out, stages=stages,
                                                    unroll=unroll, ws=ws)
    if config[0] == 0:
        stages, unroll = config[1], config[2]
        return lambda: gw.grouped_wgrad_tma(a_buf, b_buf, sa, sb, off, splits, n, k, out, stages=stages,
                                            unroll=unroll)
    stages, wn, unroll, scaled = config
    return lambda: gw.grouped_wgrad_1d1d(a_buf, b_buf, sa, sb, off, splits, n, k, out, stages=stages, wn=wn,
                                         unroll=unroll, scaled=bool(scaled))


def _name(config: tuple[int, ...]) -> str:
    if config[0] in (1, 2):
        ws = " warp-specialized" if config[0] == 2 else ""
        return f"Gluon TMA per expert{ws} stages={config[1]} unroll={config[2]}"
    if config[0] == 0:
        return f"Gluon TMA stages={config[1]} unroll={config[2]}"
    stages, wn, unroll, scaled = config
    return f"Gluon cp.async stages={stages} wn={wn} unroll={unroll}" + ("" if scaled else ", scales left out")


UNEQUAL = ([256, 0, 1920, 2176, 128, 0, 384, 1408], [0, 4096, 128, 0])  # zeros included


def unequal(k: int, n: int, config: tuple[int, ...], failures: list[str]) -> list[list[object]]:
    """Unequal splits against cuBLAS per expert; an expert without tokens must get zeros."""
    rows = []
    for splits in UNEQUAL:
        sets, _ = gemm_sets("blockwise", len(splits), 0, k, n, torch.device("cuda"), splits=splits)
        pairs = sets["wgrad"]
        for _, _, o in pairs:
            o.zero_()  # cuBLAS leaves an empty expert's output as it found it
        bufs = _buffers(pairs, splits, n, k)
        on_streams(pairs, [])()
        want = torch.stack([o for _, _, o in pairs])
        out = _runner(config, bufs, splits, n, k)()
        zeros = all(bool((out[e] == 0).all()) for e, s in enumerate(splits) if s == 0)
        if not zeros:
            failures.append(f"{_name(config)} {splits}: an expert without tokens got a nonzero gradient")
        rows.append([str(splits), f"K={k} N={n}", *_check_out(failures, f"{_name(config)} {splits}", out, want),
                     zeros])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--configs", nargs="*",
                   default=["4,1,2", "1,4,2", "2,4,2", "2,4,4", "2,5,4", "2,6,4", "2,3,2", "2,5,2"])
    args = p.parse_args()
    configs = [(*(int(v) for v in c.split(",")), 1)[:4] for c in args.configs]
    failures: list[str] = []  # what went wrong: said at the end, and the probe then exits non-zero
    rows = []
    for k, n in SHAPES:
        rows += run_shape(args.experts, args.tokens, k, n, configs, failures)
    print(environment())
    print(markdown_table(["shape", "path", f"ms per {args.experts} GEMMs", "TFLOP/s", "rel. error vs cuBLAS",
                          "bits equal cuBLAS's"], rows))
    k, n = SHAPES[0]
    for config in configs[:1] + [c for c in configs if c[0] == 2][:1]:
        print(_name(config))
        print(markdown_table(["splits", "shape", "rel. error vs cuBLAS", "bits equal cuBLAS's",
                              "zero for empty experts"], unequal(k, n, config, failures)))
    if failures:
        raise SystemExit("probe_gluon_wgrad: " + "; ".join(failures))


if __name__ == "__main__":
    main()
