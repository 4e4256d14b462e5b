"""Grouped (MoE expert) GEMM benchmark (GPU): BF16 ``torch._grouped_mm`` vs our FP8
``GroupedLinear`` per recipe, forward and backward, casts included; TFLOP/s table + PNG.

    python scripts/bench_grouped.py [--experts 8] [--tokens 2048] [--recipes current block ...] [--out DIR]

Shapes (issue 5): 8 experts x 2048 tokens each, (K=4096, N=2048) and (K=2048, N=7168).
FLOPs: forward 2*M*N*K, backward 4*M*N*K (dgrad + wgrad), M = experts * tokens.
BF16 baseline: ``torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)`` forward; backward as two
explicit grouped calls (dgrad ``dy @ w``, wgrad ``dy.T @ x`` grouped along the tokens).
Our FP8 path runs one native ``scaled_mm`` per expert (per-tensor / block scales:
``torch._scaled_grouped_mm`` takes rowwise scales only, which no recipe of ours uses).
"""

from __future__ import annotations

import argparse
import os

import torch
from benchlib import bar_chart, markdown_table, median_ms, write_outputs

from megatron_fp8 import fp8_autocast
from megatron_fp8.modules.grouped import GroupedLinear
from megatron_fp8.recipe import PRESETS

SHAPES = [(4096, 2048), (2048, 7168)]  # (K, N)


def _bf16_grouped(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor):
    """Forward and backward closures of the BF16 grouped GEMMs (w ``[E, N, K]``)."""

    def fwd() -> None:
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    def bwd() -> None:
        torch._grouped_mm(dy, w, offs=offs)  # dgrad [M, K]
        torch._grouped_mm(dy.t(), x, offs=offs)  # wgrad [E, N, K]

    return fwd, bwd


def _fp8_grouped(layer: GroupedLinear, x: torch.Tensor, dy: torch.Tensor, splits: list[int], recipe):
    """Forward (no graph) and forward+backward closures of the FP8 layer."""

    def fwd() -> None:
        with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
            layer(x, splits)

    def fwd_bwd() -> None:
        for w in layer.weights:
            w.grad = None
        with fp8_autocast(fp8_recipe=recipe):
            y = layer(x, splits)
        y.backward(dy)

    return fwd, fwd_bwd


def bench_shape(experts: int, tokens: int, k: int, n: int, recipes: list[str]) -> list[list[object]]:
    m = experts * tokens
    splits = [tokens] * experts
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * tokens
    fl_f, fl_b = 2 * m * n * k, 4 * m * n * k
    rows = []
    fwd, bwd = _bf16_grouped(x, w, dy, offs)
    t_f, t_b = median_ms(fwd), median_ms(bwd)
    rows.append(["bf16 _grouped_mm", t_f, fl_f / t_f / 1e9, t_b, fl_b / t_b / 1e9])
    base = fl_f / t_f / 1e9
    for name in recipes:
        layer = GroupedLinear(experts, k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
        f, fb = _fp8_grouped(layer, x, dy, splits, PRESETS[name])
        t_f, t_fb = median_ms(f), median_ms(fb)
        t_b = max(t_fb - t_f, 1e-6)
        rows.append([f"fp8 {name}", t_f, fl_f / t_f / 1e9, t_b, fl_b / t_b / 1e9])
    for r in rows:
        r.append(r[2] / base)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per expert")
    p.add_argument("--recipes", nargs="*", default=["delayed", "current", "blockwise", "mxfp8"])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_grouped.py needs CUDA (run it on the device machine)")
    header = ["shape", "path", "fwd ms", "fwd TFLOP/s", "bwd ms", "bwd TFLOP/s", "fwd vs bf16"]
    table, series, groups = [], {}, []
    for k, n in SHAPES:
        shape = f"{args.experts}x{args.tokens} K={k} N={n}"
        groups.append(shape)
        for row in bench_shape(args.experts, args.tokens, k, n, args.recipes):
            table.append([shape, *row])
            series.setdefault(f"{row[0]} fwd", []).append(row[2])
            series.setdefault(f"{row[0]} bwd", []).append(row[4])
    md = markdown_table(header, table)
    print(md)
    os.makedirs(args.out, exist_ok=True)
    write_outputs("bench_grouped", "Grouped GEMM: BF16 _grouped_mm vs FP8 GroupedLinear (casts included)", md,
                  args.out)
    bar_chart(os.path.join(args.out, "bench_grouped.png"), groups, series, "TFLOP/s",
              "MoE grouped GEMM, forward / backward (casts included)")


if __name__ == "__main__":
    main()
