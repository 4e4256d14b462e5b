"""RoPE on q and k of one attention layer (GPU): megatron-core's unfused chain against our one-pass
kernel (``megatron/rope.py``), forward plus backward. Checks the bits first, then prints a table:
GPU time (CUDA events, median) and host time per call (wall time of issuing 200 calls back to
back without synchronising, which is what an eager, host-bound step pays).

    PYTHONPATH=.megatron_lm:$PYTHONPATH python scripts/probes/rope_speed.py
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib
from benchlib import markdown_table, median_ms
from megatron.core.models.common.embeddings import rope_utils

from megatron_fp8.megatron import rope
from megatron_fp8.testing import bits

# name, sequence, batch, heads, head dim: dense-8b's q and k (GQA 8), dense-1b's q
CASES = [("dense-8b q", 4096, 1, 32, 128), ("dense-8b k", 4096, 1, 8, 128), ("dense-1b q", 4096, 1, 16, 128)]


def _freqs(s: int, d: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device="cuda") / d))
    f = torch.arange(s, dtype=torch.float32, device="cuda")[:, None] * inv
    return torch.cat((f, f), dim=-1)[:, None, None, :]


def _step(fn, t: torch.Tensor, freqs: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    t.grad = None
    y = fn(t, freqs)
    y.backward(g)
    return y


def _host_us(fn, t: torch.Tensor, freqs: torch.Tensor, g: torch.Tensor, calls: int = 200) -> float:
    for _ in range(10):
        _step(fn, t, freqs, g)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        _step(fn, t, freqs, g)
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    def unfused(t: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        return rope_utils._apply_rotary_pos_emb_bshd(t, f, rotary_interleaved=False)

    def fused(t: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        return rope.fused_apply_rotary_pos_emb(t, f)

    rows = []
    for name, s, b, h, d in CASES:
        torch.manual_seed(0)
        mixed = torch.randn(s, b, h, 3 * d, device="cuda", dtype=torch.bfloat16)
        t = mixed[..., :d].detach().requires_grad_()  # a leaf: the view's strides are what count here
        freqs = _freqs(s, d)
        g = torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16)
        ys = [_step(fn, t, freqs, g).detach() for fn in (unfused, fused)]
        same = torch.equal(bits(ys[0]), bits(ys[1]))
        gpu = [median_ms(functools.partial(_step, fn, t, freqs, g)) * 1e3 for fn in (unfused, fused)]
        host = [_host_us(fn, t, freqs, g) for fn in (unfused, fused)]
        rows.append([name, f"{s}x{b}x{h}x{d}", same, gpu[0], gpu[1], host[0], host[1]])
    print(markdown_table(["tensor", "shape", "bits equal", "unfused GPU us", "fused GPU us", "unfused host us",
                          "fused host us"], rows))


if __name__ == "__main__":
    main()
