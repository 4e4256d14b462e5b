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
from collections.abc import Callable

import gluon_wgrad as gw
import torch
from benchlib import environment, markdown_table, median_ms
from probe_gemm_streams import SHAPES, gemm_sets, on_streams

from megatron_fp8 import gemm_grouped as gg
from megatron_fp8 import triton_grouped as tg
from megatron_fp8.quant.kernels import segment_offsets


def _buffers(pairs: list, splits: list[int], n: int, k: int) -> tuple[torch.Tensor, ...]:
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    got = gg._triton_grouped_starts(a, b, gg._first(a), gg._first(b), torch.bfloat16, splits, True,
                                    ("tokens", "tokens"), (n, k))
    if got is None:
        raise SystemExit("probe_gluon_wgrad: the wgrad operands are not in one buffer each")
    (a_buf, sa), (b_buf, sb) = gg._buffers(a, got[1]), gg._buffers(b, got[2])
    return a_buf, b_buf, sa, sb, segment_offsets(splits, a_buf.device)


def _graphed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return median_ms(g.replay)


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    got, want = got.float(), want.float()
    rel = ((got - want).norm() / want.norm()).item()
    return rel, ((got - want).abs().max() / want.abs().max()).item()


def run_shape(experts: int, tokens: int, k: int, n: int, configs: list[tuple[int, ...]]) -> list[list[object]]:
    sets, _ = gemm_sets("blockwise", experts, tokens, k, n, torch.device("cuda"))
    pairs = sets["wgrad"]
    splits = [tokens] * experts
    a_buf, b_buf, sa, sb, off = _buffers(pairs, splits, n, k)
    flops = 2.0 * experts * tokens * n * k
    cublas = on_streams(pairs, [])
    ms = _graphed(cublas)
    want = torch.stack([o for _, _, o in pairs])
    rows: list[list[object]] = [[f"K={k} N={n}", "cuBLAS per expert", round(ms, 4), round(flops / ms / 1e9), "-", "-"]]
    tri = tg.grouped_kgroup(a_buf, b_buf, sa, sb, off, n, k, torch.bfloat16, blocked=True)
    ms = _graphed(lambda: tg.grouped_kgroup(a_buf, b_buf, sa, sb, off, n, k, torch.bfloat16, blocked=True))
    rows.append([f"K={k} N={n}", "Triton kgroup", round(ms, 4), round(flops / ms / 1e9),
                 *(f"{e:.2e}" for e in _errors(tri, want))])
    for config in configs:
        fn, name = _runner(config, a_buf, b_buf, sa, sb, off, n, k)
        try:
            out = fn()
            torch.cuda.synchronize()
        except Exception as exc:  # a config that does not compile or launch: say so, go on
            rows.append([f"K={k} N={n}", name, "failed", str(exc).splitlines()[0][:80], "-", "-"])
            continue
        ms = _graphed(fn)
        rows.append([f"K={k} N={n}", name, round(ms, 4), round(flops / ms / 1e9),
                     *(f"{e:.2e}" for e in _errors(out, want))])
        print(rows[-1], flush=True)
    return rows


def _runner(config: tuple[int, ...], a_buf: torch.Tensor, b_buf: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
            off: torch.Tensor, n: int, k: int) -> tuple[Callable[[], torch.Tensor], str]:
    """The kernel call a config names: ``(stages, wn, unroll, scaled)`` for the cp.async kernel,
    ``(0, stages, unroll)`` for the TMA one, ``(1, stages, unroll)`` for the TMA one launched per
    expert, ``(2, stages, unroll)`` for that one warp-specialized."""
    if config[0] in (1, 2):
        stages, unroll, ws = config[1], config[2], config[0] == 2
        splits = torch.diff(off).tolist()
        return (lambda: gw.grouped_wgrad_tma_experts(a_buf, b_buf, sa, sb, splits, n, k, torch.bfloat16,
                                                     stages=stages, unroll=unroll, ws=ws)), _name(config)
    if config[0] == 0:
        stages, unroll = config[1], config[2]
        return (lambda: gw.grouped_wgrad_tma(a_buf, b_buf, sa, sb, off, n, k, torch.bfloat16, stages=stages,
                                             unroll=unroll)), _name(config)
    stages, wn, unroll, scaled = config
    return (lambda: gw.grouped_wgrad_1d1d(a_buf, b_buf, sa, sb, off, n, k, torch.bfloat16, stages=stages, wn=wn,
                                          unroll=unroll, scaled=bool(scaled))), _name(config)


def _name(config: tuple[int, ...]) -> str:
    if config[0] in (1, 2):
        ws = " warp-specialized" if config[0] == 2 else ""
        return f"Gluon TMA per expert{ws} stages={config[1]} unroll={config[2]}"
    if config[0] == 0:
        return f"Gluon TMA stages={config[1]} unroll={config[2]}"
    stages, wn, unroll, scaled = config
    return f"Gluon stages={stages} wn={wn} unroll={unroll}" + ("" if scaled else " UNSCALED (timing only)")


def unequal(k: int, n: int, config: tuple[int, ...]) -> list[list[object]]:
    """Unequal splits, zeros included, against cuBLAS per expert."""
    rows = []
    for splits in ([256, 0, 1920, 2176, 128, 0, 384, 1408], [0, 4096, 128, 0]):
        sets, _ = gemm_sets_splits(splits, k, n)
        pairs = sets
        a_buf, b_buf, sa, sb, off = _buffers(pairs, splits, n, k)
        on_streams(pairs, [])()
        want = torch.stack([o for _, _, o in pairs])
        out = _runner(config, a_buf, b_buf, sa, sb, off, n, k)[0]()
        zero_ok = all(bool((out[e] == 0).all()) for e, s in enumerate(splits) if s == 0)
        rows.append([str(splits), f"K={k} N={n}", *(f"{e:.2e}" for e in _errors(out, want)), zero_ok])
    return rows


def gemm_sets_splits(splits: list[int], k: int, n: int, device: str = "cuda") -> tuple[list, None]:
    """The wgrad pairs of ``probe_gemm_streams.gemm_sets`` for unequal splits."""
    from probe_gemm_streams import _packed

    from megatron_fp8.recipe import PRESETS, TensorRole

    recipe = PRESETS["blockwise"]
    m = sum(splits)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    _, x_c = _packed(recipe, TensorRole.INPUT, x, splits)
    _, dy_c = _packed(recipe, TensorRole.GRAD_OUTPUT, dy, splits)
    return [(dy_c[e], x_c[e], torch.zeros(n, k, device=device, dtype=torch.bfloat16)) for e in range(len(splits))], None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--configs", nargs="*",
                   default=["4,1,2", "1,4,2", "2,4,2", "2,4,4", "2,5,4", "2,6,4", "2,3,2", "2,5,2"])
    args = p.parse_args()
    configs = [(*(int(v) for v in c.split(",")), 1)[:4] for c in args.configs]
    rows = []
    for k, n in SHAPES:
        rows += run_shape(args.experts, args.tokens, k, n, configs)
    print(environment())
    print(markdown_table(["shape", "path", "ms per 8 GEMMs", "TFLOP/s", "rel. error vs cuBLAS",
                          "max diff / max"], rows))
    for config in configs[:1] + [c for c in configs if c[0] == 2][:1]:
        print(_name(config))
        print(markdown_table(["splits", "shape", "rel. error vs cuBLAS", "max diff / max", "zero experts zero"],
                             unequal(4096, 2048, config)))


if __name__ == "__main__":
    main()
