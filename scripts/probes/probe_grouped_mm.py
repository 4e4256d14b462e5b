"""What this torch's grouped FP8 GEMM accepts on this GPU, and whether it matches per-expert
``_scaled_mm`` calls: prints one line per probe (GPU only).

    python scripts/probe_grouped_mm.py
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib
from benchlib import median_ms

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _fp8(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.clamp(-400, 400).to(dtype)


def _try(name: str, fn) -> torch.Tensor | None:
    try:
        out = fn()
        torch.cuda.synchronize()
        print(f"OK   {name}: {tuple(out.shape)} {out.dtype}")
        return out
    except Exception as e:  # noqa: BLE001 - a probe reports every refusal
        print(f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        return None


def main() -> None:
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
    print("F.scaled_grouped_mm:", hasattr(F, "scaled_grouped_mm"))
    if hasattr(F, "scaled_grouped_mm"):
        print(inspect.signature(F.scaled_grouped_mm))
    g, m_e, k, n = 8, 2048, 4096, 2048
    dev = "cuda"
    x = torch.randn(g * m_e, k, device=dev) * 4
    w = torch.randn(g, n, k, device=dev) * 4
    offs = torch.arange(1, g + 1, device=dev, dtype=torch.int32) * m_e
    sa = torch.rand(g, device=dev) + 0.5
    sb = torch.rand(g, device=dev) + 0.5
    sa_l, sb_l = [s.clone() for s in sa], [s.clone() for s in sb]  # own allocations: aligned scale pointers
    # per-expert tensorwise scales folded onto a's rows (sa*sb), ones for b's columns
    row_scale = (sa * sb).repeat_interleave(m_e)
    ones = torch.ones(g, n, device=dev)
    for da, db in ((E4, E4), (E5, E4), (E4, E5)):
        a8, b8 = _fp8(x, da), _fp8(w, db)
        out = _try(f"2d x 3d {da} x {db} rowwise",
                   lambda a8=a8, b8=b8: torch._scaled_grouped_mm(a8, b8.transpose(-2, -1), row_scale, ones, offs=offs,
                                                                 out_dtype=torch.bfloat16))
        if out is None:
            continue
        ref = torch.cat([torch._scaled_mm(a8[i * m_e:(i + 1) * m_e], b8[i].t(), scale_a=sa_l[i], scale_b=sb_l[i],
                                          out_dtype=torch.bfloat16) for i in range(g)])
        d = (out.float() - ref.float()).abs()
        print(f"     vs per-expert _scaled_mm: equal={torch.equal(out, ref)} max|d|={d.max().item():.3g} "
              f"frac differing={(d > 0).float().mean().item():.3g}")
        fast = torch._scaled_grouped_mm(a8, b8.transpose(-2, -1), row_scale, ones, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)
        ref_fast = torch.cat([torch._scaled_mm(a8[i * m_e:(i + 1) * m_e], b8[i].t(), scale_a=sa_l[i], scale_b=sb_l[i],
                                               out_dtype=torch.bfloat16, use_fast_accum=True) for i in range(g)])
        d = (fast.float() - ref_fast.float()).abs()
        print(f"     use_fast_accum=True both: equal={torch.equal(fast, ref_fast)} max|d|={d.max().item():.3g} "
              f"frac differing={(d > 0).float().mean().item():.3g}")
        ms = median_ms(lambda a8=a8, b8=b8: torch._scaled_grouped_mm(a8, b8.transpose(-2, -1), row_scale, ones,
                                                                     offs=offs, out_dtype=torch.bfloat16))
        ms_ref = median_ms(lambda a8=a8, b8=b8: [torch._scaled_mm(a8[i * m_e:(i + 1) * m_e], b8[i].t(), scale_a=sa_l[i],
                                                                  scale_b=sb_l[i], out_dtype=torch.bfloat16)
                                                for i in range(g)])
        tf = 2 * g * m_e * k * n / 1e9
        print(f"     grouped {tf / ms:.0f} TFLOP/s, per-expert loop {tf / ms_ref:.0f} TFLOP/s")
    # wgrad form: 2d x 2d, groups along the contraction dim, output [g, n, k]
    dyT = _fp8(torch.randn(n, g * m_e, device=dev) * 4, E4)  # dy columnwise, all experts
    xT = _fp8(torch.randn(k, g * m_e, device=dev) * 4, E4)   # x columnwise, all experts
    out = _try("2d x 2d (wgrad) e4m3 rowwise",
               lambda: torch._scaled_grouped_mm(dyT, xT.t(), sa.repeat_interleave(n), sb.repeat_interleave(k),
                                                offs=offs, out_dtype=torch.bfloat16))
    if out is not None:
        ref = torch.stack([torch._scaled_mm(dyT[:, i * m_e:(i + 1) * m_e].contiguous(),
                                            xT[:, i * m_e:(i + 1) * m_e].contiguous().t(), scale_a=sa_l[i],
                                            scale_b=sb_l[i], out_dtype=torch.bfloat16) for i in range(g)])
        d = (out.float() - ref.float()).abs()
        print(f"     vs per-expert: equal={torch.equal(out, ref)} max|d|={d.max().item():.3g} "
              f"rel={(d.max() / ref.float().abs().max()).item():.3g}")
        ms = median_ms(lambda: torch._scaled_grouped_mm(dyT, xT.t(), sa.repeat_interleave(n), sb.repeat_interleave(k),
                                                       offs=offs, out_dtype=torch.bfloat16))
        print(f"     grouped wgrad {2 * g * m_e * k * n / 1e9 / ms:.0f} TFLOP/s")
    _try("2d x 2d (wgrad) e5m2 x e4m3",
         lambda: torch._scaled_grouped_mm(dyT.view(torch.uint8).view(E5), xT.t(), sa.repeat_interleave(n),
                                          sb.repeat_interleave(k), offs=offs, out_dtype=torch.bfloat16))
    _try("2d x 3d fp32 out", lambda: torch._scaled_grouped_mm(_fp8(x, E4), _fp8(w, E4).transpose(-2, -1),
                                                               torch.ones(g * m_e, device=dev),
                                                               torch.ones(g, n, device=dev), offs=offs,
                                                               out_dtype=torch.float32))
    # unaligned offsets (an expert with 5 tokens)
    offs2 = offs.clone()
    offs2[0] = 5
    _try("2d x 3d offsets not multiples of 16",
         lambda: torch._scaled_grouped_mm(_fp8(x, E4), _fp8(w, E4).transpose(-2, -1), torch.ones(g * m_e, device=dev),
                                          torch.ones(g, n, device=dev), offs=offs2, out_dtype=torch.bfloat16))


if __name__ == "__main__":
    main()
