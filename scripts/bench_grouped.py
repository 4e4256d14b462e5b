"""Grouped (MoE expert) GEMM benchmark (GPU): BF16 ``torch._grouped_mm`` vs our FP8
``GroupedLinear`` per recipe, forward and forward+backward, casts included; TFLOP/s table + PNG.

    python scripts/bench_grouped.py [--experts 8] [--tokens 2048] [--recipes current blockwise ...] \\
        [--splits even router] [--graphed-only] [--out DIR]

Shapes (issue 5): 8 experts x 2048 tokens each, (K=4096, N=2048) and (K=2048, N=7168); each with
even splits and with the same rows split as a top-2 router hands them out (``--splits``: uneven,
mostly not multiples of 16 or 128, as a real MoE step sees them).
FLOPs: forward 2*M*N*K, forward+backward 6*M*N*K, M = experts * tokens.
BF16 baseline: ``torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)`` forward; backward as two
explicit grouped calls (dgrad ``dy @ w``, wgrad ``dy.T @ x`` grouped along the tokens).
Our FP8 path: one launch casts every expert's input (per-expert scales), one launch per GEMM
(``gemm_grouped.grouped_gemm_cat`` / ``grouped_wgrad``: the Triton grouped kernels by default, cuBLAS
per expert while a CUDA graph is captured, ``MEGATRON_FP8_GROUPED_GEMM`` picks others); the
rowwise ``torch._scaled_grouped_mm`` GEMM-only forward is shown as a peer. "weights cached":
the FP8 weights cast once and reused (``is_first_microbatch=False``: the later micro-batches of
a gradient-accumulation step); ``--microbatches N`` adds a graphed iteration of N micro-batches
whose first casts the weights, per micro-batch. "fwd" runs under ``no_grad`` (no columnwise casts); "fwd+bwd" is the
training step (x requires grad: fprop, dgrad and wgrad, as the BF16 baseline runs; before
2026-12-02 x did not, so earlier FP8 fwd+bwd figures lacked dgrad), the number the targets are
about. "(CUDA graph)" rows replay the same step from a captured graph
(``megatron_fp8.testing.capture_step``), compared with the BF16 step graphed the same way:
what the GPU does once the host's launch cost is gone (Megatron's CUDA-graph options).
"""

from __future__ import annotations

import argparse
import os

import torch
from benchlib import bar_chart, markdown_table, median_ms, write_outputs

from megatron_fp8 import fp8_autocast
from megatron_fp8.modules.grouped import GroupedLinear
from megatron_fp8.recipe import PRESETS
from megatron_fp8.testing import capture_step, router_splits

SHAPES = [(4096, 2048), (2048, 7168)]  # (K, N)
GRAPHED = ("current", "blockwise")  # stateless recipes: a replayed step is the eager step


def _bf16_grouped(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor):
    """Forward and forward+backward closures of the BF16 grouped GEMMs (w ``[E, N, K]``)."""

    def fwd() -> None:
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    def fwd_bwd() -> None:
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        torch._grouped_mm(dy, w, offs=offs)  # dgrad [M, K]
        torch._grouped_mm(dy.t(), x, offs=offs)  # wgrad [E, N, K]

    return fwd, fwd_bwd


def _rowwise_grouped_gemm_only(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor):
    """Forward of ``torch._scaled_grouped_mm`` on pre-cast rowwise FP8 operands (a peer)."""
    f8 = torch.float8_e4m3fn
    xs = x.float().abs().amax(1).clamp(min=1e-12) / 448.0
    ws = w.float().abs().amax(2).clamp(min=1e-12) / 448.0  # [E, N]
    xq = (x.float() / xs[:, None]).to(f8)
    wq = (w.float() / ws[:, :, None]).to(f8)  # [E, N, K]

    def fwd() -> None:
        torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), xs, ws, offs=offs, out_dtype=torch.bfloat16)

    return fwd


def _fp8_grouped(layer: GroupedLinear, x: torch.Tensor, dy: torch.Tensor, splits: list[int], recipe,
                 cached: bool = False):
    """Forward (no graph) and forward+backward closures of the FP8 layer. ``cached``: weights
    cast once and reused (``is_first_microbatch=False``, later micro-batches of a step)."""
    first = False if cached else None
    if cached:  # cast the weights once, with their columnwise copies
        with fp8_autocast(fp8_recipe=recipe):
            layer(x, splits, is_first_microbatch=True).backward(dy)

    def fwd() -> None:
        with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
            layer(x, splits, is_first_microbatch=first)

    def fwd_bwd() -> None:
        _fp8_pass(layer, x, dy, splits, recipe, first)

    return fwd, fwd_bwd


def _fp8_pass(layer: GroupedLinear, x: torch.Tensor, dy: torch.Tensor, splits: list[int], recipe,
              first: bool | None) -> None:
    """One forward+backward of the FP8 layer, the grads of ``x`` and the weights reset first (no
    accumulation kernels, which the BF16 baseline does not run either)."""
    x.grad = None
    for w in layer.weights:
        w.grad = None
    with fp8_autocast(fp8_recipe=recipe):
        y = layer(x, splits, is_first_microbatch=first)
    y.backward(dy)


def _fp8_iteration(layer: GroupedLinear, x: torch.Tensor, dy: torch.Tensor, splits: list[int], recipe,
                   microbatches: int):
    """A gradient-accumulation iteration of ``microbatches`` forward+backward passes, Megatron's way:
    the FP8 weights cast in the first (``is_first_microbatch=True``) and reused by the others,
    each pass as a single-step row's (``_fp8_pass``)."""
    def iteration() -> None:
        for i in range(microbatches):
            _fp8_pass(layer, x, dy, splits, recipe, i == 0)

    return iteration


def expert_splits(kind: str, experts: int, tokens: int) -> list[int]:
    """``even``: ``tokens`` rows per expert; ``router``: the same total as a top-2 router over
    random tokens hands it out (uneven, mostly not multiples of 16 or 128)."""
    if kind == "even":
        return [tokens] * experts
    return router_splits(experts * tokens, experts, 2)


def bench_shape(experts: int, tokens: int, k: int, n: int, recipes: list[str], graphed_only: bool = False,
                microbatches: int = 0, split_kind: str = "even") -> list[list[object]]:
    m = experts * tokens
    splits = expert_splits(split_kind, experts, tokens)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # dgrad is part of the step
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    offs = torch.tensor(splits, device="cuda").cumsum(0).to(torch.int32)
    fl_f, fl_fb = 2 * m * n * k, 6 * m * n * k
    rows: list[list[object]] = []

    def add(name: str, t_f: float, t_fb: float | None, note: str = "") -> None:
        fb = [t_fb, fl_fb / t_fb / 1e9] if t_fb else ["-", "-"]
        rows.append([name, t_f, fl_f / t_f / 1e9, *fb, note])
        print(rows[-1], flush=True)

    fwd, fwd_bwd = _bf16_grouped(x.detach(), w, dy, offs)
    base_f, base_fb = median_ms(fwd), median_ms(fwd_bwd)
    add("bf16 _grouped_mm", base_f, base_fb)
    graph_f, graph_fb = median_ms(capture_step(fwd)[0].replay), median_ms(capture_step(fwd_bwd)[0].replay)
    add("bf16 _grouped_mm (CUDA graph)", graph_f, graph_fb)
    try:
        add("fp8 rowwise _scaled_grouped_mm (GEMM only)", median_ms(_rowwise_grouped_gemm_only(x.detach(), w, offs)),
            None, "pre-cast operands, no casts")
    except Exception as e:  # report, never hide
        rows.append(["fp8 rowwise _scaled_grouped_mm", "-", "-", "-", "-", f"failed: {type(e).__name__}: {e}"[:100]])
    for name in recipes:
        for flag, cached, graphed in ((False, False, False), (True, False, False), (False, True, False),
                                      (False, False, True), (True, False, True), (False, True, True)):
            if (graphed and name not in GRAPHED) or (graphed_only and not graphed):
                continue
            layer = GroupedLinear(experts, k, n, bias=False, params_dtype=torch.bfloat16, device="cuda",
                                  save_original_input=flag)
            f, fb = _fp8_grouped(layer, x, dy, splits, PRESETS[name], cached)
            if graphed:  # the same step replayed from a graph: the host's launch cost taken away
                try:
                    f, fb = capture_step(f)[0].replay, capture_step(fb)[0].replay
                except Exception as e:  # a failed capture leaves the CUDA RNG in capture mode: stop here
                    cause = e.__context__ or e  # capture_end's error hides the one raised inside the capture
                    raise SystemExit(f"fp8 {name} (CUDA graph): capture failed: {type(cause).__name__}: {cause}; "
                                     f"the process's CUDA state is no longer usable for the remaining rows") from e
            t_f, t_fb = median_ms(f), median_ms(fb)
            ref_f, ref_fb = (graph_f, graph_fb) if graphed else (base_f, base_fb)
            add(f"fp8 {name} flag={'on' if flag else 'off'}{' weights cached' if cached else ''}"
                f"{' (CUDA graph)' if graphed else ''}", t_f, t_fb,
                f"{ref_fb / t_fb:.2f}x BF16{' graphed' if graphed else ''} fwd+bwd, {ref_f / t_f:.2f}x fwd")
            del layer
        if microbatches > 1 and name in GRAPHED:  # per micro-batch of a graphed iteration
            layer = GroupedLinear(experts, k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
            t_it = median_ms(capture_step(_fp8_iteration(layer, x, dy, splits, PRESETS[name], microbatches))[0].replay)
            t_mb = t_it / microbatches
            rows.append([f"fp8 {name} flag=off, iteration of {microbatches} micro-batches (CUDA graph), "
                         "per micro-batch", "-", "-", t_mb, fl_fb / t_mb / 1e9,
                         f"{graph_fb / t_mb:.2f}x BF16 graphed fwd+bwd; weights cast in the first only"])
            print(rows[-1], flush=True)
            del layer
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per expert")
    p.add_argument("--recipes", nargs="*", default=["current", "blockwise", "delayed"])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--graphed-only", action="store_true",
                   help="only the graphed FP8 rows (recipes current and blockwise): quicker A/B runs")
    p.add_argument("--microbatches", type=int, default=0,
                   help="also time a graphed iteration of this many micro-batches (weights cast in the first "
                        "only, Megatron's is_first_microbatch), per micro-batch")
    p.add_argument("--splits", nargs="*", choices=("even", "router"), default=["even", "router"],
                   help="rows per expert: even, and/or as a top-2 router hands them out (same total)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_grouped.py needs CUDA (run it on the device machine)")
    header = ["shape", "path", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s", "note"]
    table, series, groups = [], {}, []
    for (k, n), split_kind in ((shape, kind) for shape in SHAPES for kind in args.splits):
        shape = f"{args.experts}x{args.tokens} K={k} N={n}{' router splits' if split_kind == 'router' else ''}"
        groups.append(shape)
        for row in bench_shape(args.experts, args.tokens, k, n, args.recipes, args.graphed_only, args.microbatches,
                               split_kind):
            table.append([shape, *row])
            if isinstance(row[4], float):
                series.setdefault(str(row[0]), []).append(row[4])
    md = markdown_table(header, table)
    print(md)
    os.makedirs(args.out, exist_ok=True)
    write_outputs("bench_grouped", "Grouped GEMM: BF16 _grouped_mm vs FP8 GroupedLinear (casts included)", md,
                  args.out)
    bar_chart(os.path.join(args.out, "bench_grouped.png"), groups,
              {k_: v for k_, v in series.items() if len(v) == len(groups)}, "TFLOP/s (fwd+bwd)",
              "MoE grouped linear, forward+backward (casts included)")


if __name__ == "__main__":
    main()
