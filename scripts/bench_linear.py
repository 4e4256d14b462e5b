"""Linear benchmark (GPU): forward+backward TFLOP/s of BF16 nn.Linear, our FP8 Linear per recipe
with save_original_input off and on, torchao's Float8Linear (tensorwise, rowwise; compiled),
and the three block-scaled GEMMs alone (the ceiling for our block Linear).

    python scripts/bench_linear.py [--shapes M,N,K ...] [--recipes current block ...] [--rounds 3] [--out DIR]

Per shape every variant is timed once per round, in a rotated order, and the median of the
rounds is reported with its spread (``benchlib.interleaved_ms``): timed one after another, a
drift of the GPU's clocks
over the run would favour whichever variant ran first.
"(CUDA graph)" rows replay the same step from a captured graph (``megatron_fp8.testing.capture_step``):
the GPU's pace with the host's launch cost gone, against BF16 graphed the same way.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from benchlib import bar_chart, interleaved_ms, markdown_table, train_step, write_outputs

from megatron_fp8 import Linear
from megatron_fp8 import gemm as core
from megatron_fp8.quant import make_quantizer
from megatron_fp8.recipe import PRESETS, Float8BlockScaling, TensorRole
from megatron_fp8.testing import capture_step

GRAPHED = ("current", "blockwise")  # stateless recipes: a replayed step is the eager step
SHAPES = [(8192, 8192, 8192), (16384, 14336, 4096), (16384, 4096, 14336), (16384, 7168, 2048)]


def _block_gemms_only(m: int, n: int, k: int):
    """fprop + dgrad + wgrad of the block recipe on pre-quantized operands."""
    blk = Float8BlockScaling()
    qx, qw, qg = (make_quantizer(blk, r) for r in TensorRole)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    xq, wq, gq = (q.quantize(t, rowwise=True, columnwise=True) for q, t in ((qx, x), (qw, w), (qg, dy)))
    st, sw = F.ScalingType, F.SwizzleType.NO_SWIZZLE
    lay = core._block_scale_layout
    calls = []
    for a, b in ((xq.rowwise, wq.rowwise), (gq.rowwise, wq.columnwise), (gq.columnwise, xq.columnwise)):
        kinds = {core.L.BLOCK_1x128: st.BlockWise1x128, core.L.BLOCK_128x128: st.BlockWise128x128}
        sa, sb, ka, kb = lay(a), lay(b), kinds[a.layout], kinds[b.layout]
        calls.append((a.data, b.data.t(), sa, ka, sb, kb))

    def run() -> None:
        for a, b, sa, ka, sb, kb in calls:
            F.scaled_mm(a, b, sa, ka, sb, kb, swizzle_a=sw, swizzle_b=sw, output_dtype=torch.bfloat16)

    return run


def _torchao(k: int, n: int, recipe_name: str):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    mod = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
    convert_to_float8_training(mod, config=Float8LinearConfig.from_recipe_name(recipe_name))
    return torch.compile(mod)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="*", default=None, help="M,N,K triples")
    ap.add_argument("--recipes", nargs="*", default=["current", "delayed", "blockwise"])
    ap.add_argument("--torchao", nargs="*", default=["tensorwise", "rowwise"], help="torchao recipes ('' for none)")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false",
                    help="skip the CUDA-graph replays of our current/blockwise steps and of BF16")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median reported)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    rows, series = [], {}

    def record(shape: str, name: str, ms: float, flops: float, bf16_ms: float, note: str = "") -> None:
        tf = flops / ms / 1e9
        rows.append([shape, name, ms, tf, f"{bf16_ms / ms:.2f}x", note])
        series.setdefault(name, []).append(tf)
        print(f"{shape} | {name} | {ms:.3f} ms | {tf:.0f} TFLOP/s | {bf16_ms / ms:.2f}x BF16 {note}", flush=True)

    for m, n, k in shapes:
        shape, flops = f"{m}x{n}x{k}", 6 * m * n * k
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
        steps = {"bf16 nn.Linear": train_step(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16),
                                            x, dy)}
        failed = []
        if "blockwise" in args.recipes:
            steps["block GEMMs only"] = _block_gemms_only(m, n, k)
        for rname in args.recipes:
            for flag in (False, True):
                layer = Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda",
                               save_original_input=flag)
                steps[f"ours {rname} flag={'on' if flag else 'off'}"] = train_step(layer, x, dy, PRESETS[rname])
                if args.graphs and rname in GRAPHED:  # same step, replayed: no host launch cost
                    name = f"ours {rname} flag={'on' if flag else 'off'} (CUDA graph)"
                    try:
                        steps[name] = capture_step(train_step(layer, x, dy, PRESETS[rname]))[0].replay
                    except Exception as e:  # report, never hide
                        failed.append([shape, name, "-", "-", "-", f"failed: {type(e).__name__}: {e}"[:120]])
        if args.graphs:
            steps["bf16 nn.Linear (CUDA graph)"] = capture_step(steps["bf16 nn.Linear"])[0].replay
        for ao in args.torchao:
            try:
                steps[f"torchao {ao} (compiled)"] = train_step(_torchao(k, n, ao), x, dy)
            except Exception as e:  # report, never hide
                failed.append([shape, f"torchao {ao}", "-", "-", "-", f"failed: {type(e).__name__}: {e}"[:120]])
        timed = interleaved_ms(steps, args.rounds)
        bf16_ms = timed["bf16 nn.Linear"][0]
        for name, (ms, spread) in timed.items():
            note = f"spread {spread:.1%}"
            if "flag=on" in name:
                note += f"; flag cost {ms / timed[name.replace('flag=on', 'flag=off')][0] - 1:+.1%}"
            elif name == "ours blockwise flag=off" and "block GEMMs only" in timed:
                note += f"; {timed['block GEMMs only'][0] / ms:.0%} of block GEMM-only"
            elif name == "block GEMMs only":
                note += "; 3 scaled_mm, no casts"
            record(shape, name, ms, flops, bf16_ms, note)
        for row in failed:
            rows.append(row)
            print(row, flush=True)
        del x, dy, steps
        torch.cuda.empty_cache()
    header = ["M x N x K", "path", "ms fwd+bwd", "TFLOP/s", "vs BF16", "note"]
    md = markdown_table(header, rows)
    print(md)
    write_outputs("bench_linear", "Linear forward+backward", md, args.out)
    bar_chart(os.path.join(args.out, "bench_linear.png"), [f"{m}x{n}x{k}" for m, n, k in shapes],
              {k_: v for k_, v in series.items() if len(v) == len(shapes)}, "TFLOP/s (fwd+bwd)",
              "Linear forward+backward")


if __name__ == "__main__":
    main()
