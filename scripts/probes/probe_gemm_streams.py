"""Probe (GPU): do the experts' GEMMs of a graphed grouped step run faster spread over streams?

    python scripts/probe_gemm_streams.py [--experts 8] [--tokens 2048] [--streams 1 2 3] [--recipes current blockwise]

Why: the blocks step (1x128 / 128x128, K=4096, N=2048) is bound by its GEMMs since the casts
reached copy speed (docs/benchmarks.md run W: 759 of 960 us, cuBLAS one expert at a time while a
graph is captured). Each expert's GEMM is 256-512 output tiles of 128x128 on 132 SMs, so its
last wave runs partly empty; GEMMs of other experts on another stream could fill it. The
wgrad of both-1x128 operands (37.6 us an expert against 27.8 for the fprop) has the most to
gain, if cuBLAS's kernels leave room. Measured on an H200 (docs/benchmarks.md run X): they do
not; 2 or 3 streams ran each set within +-2% of one stream at K=4096/N=2048 and up to 7% slower
at K=2048/N=7168, so the package keeps one stream.

For each shape and recipe: the experts' operands cast once by the package (one launch each for
x, w and dy, as ``GroupedLinear`` casts them), then their fprop, dgrad and wgrad GEMMs
(``gemm.gemm`` per expert, each into its preallocated output) run on 1, 2 or 3 streams in turn
(expert e on stream e mod s; the side streams fork from and join back into the main one), each
replayed from a CUDA graph. Prints milliseconds per set of 8 GEMMs and each split's ratio to one
stream, and checks every split's outputs against one stream's bit for bit (the same cuBLAS
calls). Run with ``CUBLASLT_WORKSPACE_SIZE=0`` as the benchmarks do (no workspace shared
between the streams).

``--check`` runs the operand and GEMM plumbing once without timing on small shapes (also on CPU
under ``TRITON_INTERPRET=1``, one stream): what CI's smoke test does.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib
from benchlib import rel_error

from megatron_fp8.gemm import gemm
from megatron_fp8.quant import make_quantizer
from megatron_fp8.quant.tensor import Operand, Operands
from megatron_fp8.recipe import PRESETS, TensorRole

SHAPES = [(4096, 2048), (2048, 7168)]  # (K, N), as bench_grouped.py
Pair = tuple[Operand, Operand, torch.Tensor]  # a, b, the output a @ b.T goes into


def _packed(recipe: object, role: TensorRole, t: torch.Tensor, splits: list[int]) -> tuple[Operands, Operands]:
    """Rowwise and columnwise operands of every segment of ``t``, cast in one launch."""
    q = make_quantizer(recipe, role)
    seg = q.quantize_segments_packed(t, splits, peers=[q] * len(splits), rowwise=True, columnwise=True)
    if seg is None or seg.rows is None or seg.cols is None:
        raise SystemExit(f"probe_gemm_streams: no one-launch {role.value} cast here (CUDA or TRITON_INTERPRET=1)")
    return Operands(seg.rows), Operands(seg.cols)


def gemm_sets(recipe_name: str, experts: int, tokens: int, k: int, n: int, device: torch.device,
              splits: Sequence[int] | None = None) -> tuple[dict[str, list[Pair]], dict[str, list[torch.Tensor]]]:
    """The three GEMM sets of a grouped step, per expert: fprop ``x_e @ w_e.T``, dgrad
    ``dy_e @ w_e`` and wgrad ``dy_e.T @ x_e``, operands as ``GroupedLinear`` casts them; and
    the BF16 inputs per expert (``x``, ``w``, ``dy``). ``splits``: the experts' token counts
    (default ``tokens`` each; ``experts`` is then their number)."""
    recipe = PRESETS[recipe_name]
    splits = list(splits) if splits is not None else [tokens] * experts
    experts, m = len(splits), sum(splits)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    w = torch.randn(experts * n, k, device=device, dtype=torch.bfloat16) * 0.02  # experts stacked
    x_r, x_c = _packed(recipe, TensorRole.INPUT, x, splits)
    w_r, w_c = _packed(recipe, TensorRole.WEIGHT, w, [n] * experts)
    dy_r, dy_c = _packed(recipe, TensorRole.GRAD_OUTPUT, dy, splits)

    def out(rows: int, cols: int) -> torch.Tensor:
        return torch.empty(rows, cols, device=device, dtype=torch.bfloat16)

    sets = {
        "fprop": [(x_r[e], w_r[e], out(splits[e], n)) for e in range(experts)],
        "dgrad": [(dy_r[e], w_c[e], out(splits[e], k)) for e in range(experts)],
        "wgrad": [(dy_c[e], x_c[e], out(n, k)) for e in range(experts)],
    }
    return sets, {"x": list(x.split(splits)), "w": list(w.split(n)), "dy": list(dy.split(splits))}


def on_streams(pairs: Sequence[Pair], side: Sequence[torch.cuda.Stream]) -> Callable[[], None]:
    """A closure running ``pairs``' GEMMs, expert e on stream e mod (1 + len(side)): stream 0 is
    the stream current when it runs (a graph's capture stream), the side streams fork from it
    and join back into it."""

    def run() -> None:
        if not side:
            for a, b, o in pairs:
                gemm(a, b, torch.bfloat16, out=o)
            return
        main = torch.cuda.current_stream()
        streams = [main, *side]
        fork = torch.cuda.Event()
        fork.record(main)
        for s in side:
            s.wait_event(fork)
        for e, (a, b, o) in enumerate(pairs):
            with torch.cuda.stream(streams[e % len(streams)]):
                gemm(a, b, torch.bfloat16, out=o)
        for s in side:
            join = torch.cuda.Event()
            join.record(s)
            main.wait_event(join)

    return run


def check(device: torch.device) -> None:
    """The plumbing on small shapes, untimed: every GEMM within FP8 error of its BF16 product
    (which catches an operand in the wrong role or layout). FP8 error of these products: ~4-6%
    (E4M3, E5M2 for dy) with the CPU reference casts; 10-15% under Triton's interpreter, whose
    FP8 conversion rounds more coarsely (README)."""
    tol = 0.2 if os.environ.get("TRITON_INTERPRET") == "1" else 0.1
    for name in ("current", "blockwise"):
        sets, t = gemm_sets(name, 3, 256, 256, 384, device)
        want = {"fprop": [x @ w.T for x, w in zip(t["x"], t["w"])],
                "dgrad": [dy @ w for dy, w in zip(t["dy"], t["w"])],
                "wgrad": [dy.T @ x for dy, x in zip(t["dy"], t["x"])]}
        for what, pairs in sets.items():
            on_streams(pairs, [])()
            for (_, _, o), ref in zip(pairs, want[what]):
                err = rel_error(o, ref)
                assert o.shape == ref.shape and err < tol, (name, what, tuple(o.shape), err)
            print(f"{name} {what}: {len(pairs)} GEMMs, outputs {tuple(pairs[0][2].shape)}, "
                  f"relative error {err:.3f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--streams", type=int, nargs="*", default=[1, 2, 3])
    p.add_argument("--recipes", nargs="*", default=["current", "blockwise"])
    p.add_argument("--check", action="store_true", help="small shapes, untimed (CPU under TRITON_INTERPRET=1 too)")
    args = p.parse_args()
    if args.check:
        check(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        return
    if not torch.cuda.is_available():
        raise SystemExit("probe_gemm_streams.py needs CUDA (or --check)")
    from benchlib import environment, markdown_table, median_ms

    from megatron_fp8.testing import capture_step, same_bits

    side = [torch.cuda.Stream() for _ in range(max(args.streams) - 1)]
    rows = []
    for k, n in SHAPES:
        for name in args.recipes:
            sets, _ = gemm_sets(name, args.experts, args.tokens, k, n, torch.device("cuda"))
            for what, pairs in sets.items():
                base = None
                for s in args.streams:
                    run = on_streams(pairs, side[:s - 1])
                    graph, _ = capture_step(run)
                    graph.replay()
                    torch.cuda.synchronize()
                    outs = [o.clone() for _, _, o in pairs]
                    ms = median_ms(graph.replay)
                    if base is None:
                        base, ref = ms, outs
                    rows.append([f"K={k} N={n}", name, what, s, ms, f"{ms / base:.3f}",
                                 "ref" if s == args.streams[0] else ("equal" if same_bits(outs, ref) else "DIFFER")])
                    print(rows[-1], flush=True)
    print(f"\n{environment()}\n")
    print(markdown_table(["shape", "recipe", "GEMMs", "streams", "ms", "vs first", "bits"], rows))


if __name__ == "__main__":
    main()
