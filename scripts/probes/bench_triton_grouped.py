"""Grouped FP8 GEMM kernels alone (GPU): our Triton grouped kernels (``megatron_fp8.kernels.triton_grouped``)
per tile configuration against BF16 ``torch._grouped_mm``, per-expert ``torch._scaled_mm`` and
``torch._scaled_grouped_mm`` (rowwise), on pre-cast operands; prints TFLOP/s and the relative
error of each Triton result against an FP32 matmul of the dequantized operands.

    python scripts/bench_triton_grouped.py [--experts 8] [--tokens 2048] [--quick]

GEMMs of one expert layer step (issue 5's shapes, x ``[M, K]``, w ``[E, N, K]``, dy ``[M, N]``):
fprop ``x @ w_e.T`` (E4M3 x E4M3), dgrad ``dy @ w_e`` (E5M2 x E4M3 for tensorwise HYBRID,
E4M3 x E4M3 for blocks), wgrad ``dy_e.T @ x_e`` (contracted over each expert's tokens).
Accumulation as the layers ask for it: fast in fprop, FP32-promoted in dgrad and wgrad.
Operands are random FP8 with random positive scales (never zeros), laid out as the one-launch
segment casts leave them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib
from benchlib import environment, markdown_table, median_ms

from megatron_fp8.kernels import triton_grouped as tg

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
# first run (2026-12-02): 128x128 w8 s3 best for rows; w4, 64-row and 256-wide tiles 5-75% slower
ROW_TILES = [tg.Tiles(128, 128, 8, 3), tg.Tiles(128, 128, 8, 4), tg.Tiles(128, 256, 8, 3)]
KGROUP_TILES = [tg.Tiles(128, 128, 8, 3), tg.Tiles(128, 128, 8, 4), tg.Tiles(128, 256, 8, 3), tg.Tiles(256, 128, 8, 3)]


def _fp8(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(shape, device="cuda") * 40).clamp(-400, 400).to(dtype)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


class Problem:
    """One rows problem (``a [M, K]`` against ``b [E, N, K]``) with tensor and 1x128/128x128 scales."""

    def __init__(self, splits: list[int], n: int, k: int, a_dtype: torch.dtype, fast_accum: bool) -> None:
        self.splits, self.n, self.k, self.fast = splits, n, k, fast_accum
        m, g = sum(splits), len(splits)
        self.a, self.b = _fp8((m, k), a_dtype), _fp8((g, n, k), E4)
        self.off = torch.tensor([0, *torch.tensor(splits).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        self.st = torch.rand(g, 4, device="cuda") * 1e-3 + 1e-4  # column 0 used: 16 bytes apart
        self.st2 = torch.rand(g, 4, device="cuda") * 1e-3 + 1e-4
        self.sa = torch.rand(m * k // 128, device="cuda") * 1e-3 + 1e-4  # per segment [K/128, m_e]
        self.sb = torch.rand(g, n // 128, k // 128, device="cuda") * 1e-3 + 1e-4

    def reference(self, blocked: bool) -> torch.Tensor:
        outs, start = [], 0
        for e, m_e in enumerate(self.splits):
            a, b = self.a[start:start + m_e].float(), self.b[e].float()
            if blocked:
                sa = self.sa[start * self.k // 128:(start + m_e) * self.k // 128].view(self.k // 128, m_e)
                a = a * sa.t().repeat_interleave(128, 1)
                b = b * self.sb[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
            else:
                a, b = a * self.st[e, 0], b * self.st2[e, 0]
            outs.append(a @ b.t())
            start += m_e
        return torch.cat(outs)

    def triton(self, blocked: bool, tiles: tg.Tiles) -> torch.Tensor:
        sa, sb = (self.sa, self.sb) if blocked else (self.st, self.st2)
        return tg.grouped_rows(self.a, self.b, sa, sb, self.off, torch.bfloat16, blocked=blocked,
                               fast_accum=self.fast, tiles=tiles)

    def per_expert_scaled_mm(self) -> None:
        start = 0
        for e, m_e in enumerate(self.splits):
            torch._scaled_mm(self.a[start:start + m_e], self.b[e].t(), self.st[e, :1].view(()),
                             self.st2[e, :1].view(()), out_dtype=torch.bfloat16, use_fast_accum=self.fast)
            start += m_e


class KGroupProblem:
    """One wgrad problem: per expert ``a_e [N, m_e]``, ``b_e [K, m_e]`` back to back."""

    def __init__(self, splits: list[int], n: int, k: int, a_dtype: torch.dtype) -> None:
        self.splits, self.n, self.k = splits, n, k
        m, g = sum(splits), len(splits)
        self.a, self.b = _fp8((n * m,), a_dtype), _fp8((k * m,), E4)
        self.off = torch.tensor([0, *torch.tensor(splits).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        self.st = torch.rand(g, 4, device="cuda") * 1e-3 + 1e-4
        self.st2 = torch.rand(g, 4, device="cuda") * 1e-3 + 1e-4
        self.sa = torch.rand(m // 128, n, device="cuda") * 1e-3 + 1e-4
        self.sb = torch.rand(m // 128, k, device="cuda") * 1e-3 + 1e-4

    def _views(self, e: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        start = sum(self.splits[:e])
        m_e = self.splits[e]
        a = self.a[self.n * start:self.n * (start + m_e)].view(self.n, m_e)
        b = self.b[self.k * start:self.k * (start + m_e)].view(self.k, m_e)
        return a, b, start

    def reference(self, blocked: bool) -> torch.Tensor:
        outs = []
        for e, m_e in enumerate(self.splits):
            a, b, start = self._views(e)
            a, b = a.float(), b.float()
            if blocked:
                rows = slice(start // 128, (start + m_e) // 128)
                a = a * self.sa[rows].t().repeat_interleave(128, 1)
                b = b * self.sb[rows].t().repeat_interleave(128, 1)
            else:
                a, b = a * self.st[e, 0], b * self.st2[e, 0]
            outs.append(a @ b.t())
        return torch.stack(outs)

    def triton(self, blocked: bool, tiles: tg.Tiles) -> torch.Tensor:
        sa, sb = (self.sa, self.sb) if blocked else (self.st, self.st2)
        return tg.grouped_kgroup(self.a, self.b, sa, sb, self.off, self.n, self.k, torch.bfloat16,
                                 blocked=blocked, tiles=tiles)

    def per_expert_scaled_mm(self) -> None:
        for e in range(len(self.splits)):
            a, b, _ = self._views(e)
            torch._scaled_mm(a, self.bt[e], self.st[e, :1].view(()), self.st2[e, :1].view(()),
                             out_dtype=torch.bfloat16)

    def prepare_scaled_mm(self) -> None:
        # cuBLAS takes the second operand column-major: b_e.t() ([m_e, K], strides (1, m_e)) is
        self.bt = [self._views(e)[1].t() for e in range(len(self.splits))]


def _bf16(experts: int, tokens: int, k: int, n: int) -> dict[str, float]:
    m = experts * tokens
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * tokens
    return {"fprop": median_ms(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)),
            "dgrad": median_ms(lambda: torch._grouped_mm(dy, w, offs=offs)),
            "wgrad": median_ms(lambda: torch._grouped_mm(dy.t(), x, offs=offs))}


def _tiles(t: tg.Tiles) -> str:
    return f"{t.bm}x{t.bn} w{t.warps} s{t.stages}"


def run_shape(experts: int, tokens: int, k: int, n: int, quick: bool) -> list[list[object]]:
    splits = [tokens] * experts
    m = sum(splits)
    flops = 2 * m * n * k
    rows: list[list[object]] = []

    def add(gemm: str, path: str, ms: float, err: float | None = None) -> None:
        rows.append([f"K={k} N={n}", gemm, path, ms, flops / ms / 1e9, "-" if err is None else f"{err:.1e}"])
        print(rows[-1], flush=True)

    for gemm, ms in _bf16(experts, tokens, k, n).items():
        add(gemm, "bf16 _grouped_mm", ms)

    fprop = Problem(splits, n, k, E4, True)  # the layers' accumulation modes: fast in fprop only
    add("fprop", "per-expert _scaled_mm (tensor)", median_ms(fprop.per_expert_scaled_mm))
    xs = torch.rand(m, 1, device="cuda") + 0.5
    ws = torch.rand(experts, n, device="cuda") + 0.5
    add("fprop", "_scaled_grouped_mm (rowwise)", median_ms(lambda: torch._scaled_grouped_mm(
        fprop.a, fprop.b.transpose(-2, -1), xs.view(-1), ws, offs=fprop.off[1:], out_dtype=torch.bfloat16,
        use_fast_accum=True)))
    dgrad = Problem(splits, k, n, E5, False)  # dy [M, N] against w_e^T [K, N]
    add("dgrad", "per-expert _scaled_mm (tensor)", median_ms(dgrad.per_expert_scaled_mm))
    wgrad = KGroupProblem(splits, n, k, E5)
    wgrad.prepare_scaled_mm()
    add("wgrad", "per-expert _scaled_mm (tensor)", median_ms(wgrad.per_expert_scaled_mm))
    dgrad_b = Problem(splits, k, n, E4, False)
    wgrad_b = KGroupProblem(splits, n, k, E4)

    row_tiles = ROW_TILES[:2] if quick else ROW_TILES
    kg_tiles = KGROUP_TILES[:2] if quick else KGROUP_TILES
    for gemm, prob, blocked, tiles in (("fprop", fprop, False, row_tiles), ("fprop", fprop, True, row_tiles),
                                       ("dgrad", dgrad, False, row_tiles), ("dgrad", dgrad_b, True, row_tiles),
                                       ("wgrad", wgrad, False, kg_tiles), ("wgrad", wgrad_b, True, kg_tiles)):
        want = prob.reference(blocked)
        for t in tiles:
            try:
                got = prob.triton(blocked, t)
                err = _rel(got, want)
                ms = median_ms(lambda p=prob, b=blocked, t=t: p.triton(b, t))
            except Exception as exc:  # a config that does not compile or fit: report it
                print(f"{gemm} {'block' if blocked else 'tensor'} {_tiles(t)} failed: {type(exc).__name__}: "
                      f"{str(exc)[:200]}", flush=True)
                continue
            add(gemm, f"triton {'block' if blocked else 'tensor'} {_tiles(t)}", ms, err)
        del want
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--quick", action="store_true", help="two tile configurations per kernel")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_triton_grouped.py needs CUDA (run it on the device machine)")
    torch.manual_seed(0)
    table = []
    for k, n in ((4096, 2048), (2048, 7168)):
        table += run_shape(args.experts, args.tokens, k, n, args.quick)
    print(environment())
    print(markdown_table(["shape", "GEMM", "path", "ms", "TFLOP/s", "rel. err vs FP32"], table))


if __name__ == "__main__":
    main()
