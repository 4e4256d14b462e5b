"""GEMM benchmark (GPU): BF16 matmul vs each FP8 path of our GEMM core vs torch called directly.

Our core's time includes its per-call work (backend choice, scale-layout preparation); the
direct call (torch's ``scaled_mm``) gets pre-laid-out scales. HYBRID block rows (an E5M2
operand, which torch refuses): ours runs cuBLASLt directly, "direct" is our Triton GEMM.
Prints a TFLOP/s table, writes ``bench_gemm.md`` and
``bench_gemm.png`` under ``$OUT`` (or ``--out``).

    python scripts/bench_gemm.py [--shapes 8192,8192,8192 ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from benchlib import bar_chart, markdown_table, median_ms, write_outputs

from megatron_fp8 import gemm as core
from megatron_fp8.quant import make_quantizer
from megatron_fp8.quant.formats import ScaleLayout
from megatron_fp8.recipe import Float8BlockScaling, Float8CurrentScaling, Format, TensorRole

SHAPES = [(8192, 8192, 8192), (16384, 14336, 4096), (16384, 4096, 14336), (16384, 7168, 2048)]


def _rowwise(x: torch.Tensor) -> core.Operand:
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = 448.0 / amax
    return core.Operand((x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.reciprocal(),
                        ScaleLayout.ROW)


def paths(m: int, n: int, k: int) -> dict[str, tuple]:
    """{path: (ours, direct)} callables for one shape (fprop orientation, BF16 output)."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    out: dict[str, tuple] = {"bf16": (lambda: a @ b.t(), None)}

    cur = Float8CurrentScaling()
    at = make_quantizer(cur, TensorRole.INPUT).quantize(a).rowwise
    bt = make_quantizer(cur, TensorRole.WEIGHT).quantize(b).rowwise
    out["fp8 tensorwise"] = (
        lambda: core.gemm(at, bt, torch.bfloat16, fast_accum=True),
        lambda: torch._scaled_mm(at.data, bt.data.t(), scale_a=at.scale_inv, scale_b=bt.scale_inv,
                                 out_dtype=torch.bfloat16, use_fast_accum=True),
    )
    ar, br = _rowwise(a), _rowwise(b)
    br_scale = br.scale_inv.t()
    out["fp8 rowwise"] = (
        lambda: core.gemm(ar, br, torch.bfloat16, fast_accum=True),
        lambda: torch._scaled_mm(ar.data, br.data.t(), scale_a=ar.scale_inv, scale_b=br_scale,
                                 out_dtype=torch.bfloat16, use_fast_accum=True),
    )
    blk = Float8BlockScaling()
    ab = make_quantizer(blk, TensorRole.INPUT).quantize(a).rowwise
    bb = make_quantizer(blk, TensorRole.WEIGHT).quantize(b).rowwise
    sa, sb = core._block_scale_layout(ab), core._block_scale_layout(bb)
    st = F.ScalingType
    out["fp8 block 1x128x128x128"] = (
        lambda: core.gemm(ab, bb, torch.bfloat16),
        lambda: F.scaled_mm(ab.data, bb.data.t(), sa, st.BlockWise1x128, sb, st.BlockWise128x128,
                            swizzle_a=F.SwizzleType.NO_SWIZZLE, swizzle_b=F.SwizzleType.NO_SWIZZLE,
                            output_dtype=torch.bfloat16),
    )
    xb = make_quantizer(blk, TensorRole.INPUT).quantize(b).rowwise  # 1x128 along K, as a wgrad operand
    sx = core._block_scale_layout(xb)
    out["fp8 block 1x128x1x128"] = (
        lambda: core.gemm(ab, xb, torch.bfloat16),
        lambda: F.scaled_mm(ab.data, xb.data.t(), sa, st.BlockWise1x128, sx, st.BlockWise1x128,
                            swizzle_a=F.SwizzleType.NO_SWIZZLE, swizzle_b=F.SwizzleType.NO_SWIZZLE,
                            output_dtype=torch.bfloat16),
    )
    # HYBRID blocks: an E5M2 operand (dgrad's and wgrad's gradient), which torch refuses; ours runs
    # it on cuBLASLt directly, the "direct" column on our Triton GEMM (the fallback)
    hyb = Float8BlockScaling(fp8_format=Format.HYBRID)
    g = make_quantizer(hyb, TensorRole.GRAD_OUTPUT).quantize(a).rowwise
    for label, other in (("1x128(E5M2)x128x128", bb), ("1x128(E5M2)x1x128", xb)):
        out[f"fp8 block hybrid {label}"] = (
            lambda other=other: core.gemm(g, other, torch.bfloat16),
            lambda other=other: core._triton_blocks(g, other, torch.bfloat16, fast_accum=False),
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="*", default=None, help="M,N,K triples")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    rows, series = [], {}
    for m, n, k in shapes:
        flops = 2 * m * n * k
        bf16_ms = None
        for name, (ours, direct) in paths(m, n, k).items():
            t_ours = median_ms(ours)
            t_direct = median_ms(direct) if direct is not None else None
            bf16_ms = bf16_ms or t_ours
            tf = flops / t_ours / 1e9
            rows.append([f"{m}x{n}x{k}", name, tf,
                         flops / t_direct / 1e9 if t_direct else "-",
                         f"{t_direct / t_ours:.3f}" if t_direct else "-", f"{bf16_ms / t_ours:.2f}x"])
            series.setdefault(name, []).append(tf)
            print(" | ".join(str(v if not isinstance(v, float) else round(v, 1)) for v in rows[-1]), flush=True)
        torch.cuda.empty_cache()
    rows.append(["any", "fp8 MXFP8 1x32", "not native on SM90: emulated (dequantize + FP32 matmul)", "-", "-", "-"])
    header = ["M x N x K", "path", "ours TFLOP/s", "direct TFLOP/s", "ours / direct", "vs BF16"]
    md = markdown_table(header, rows)
    print(md)
    write_outputs("bench_gemm", "GEMM core vs BF16 and direct scaled_mm", md, args.out)
    bar_chart(os.path.join(args.out, "bench_gemm.png"), [f"{m}x{n}x{k}" for m, n, k in shapes], series,
              "TFLOP/s", "GEMM core (ours) per path")


if __name__ == "__main__":
    main()
