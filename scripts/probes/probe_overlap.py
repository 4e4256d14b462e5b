"""Probe (GPU): can the current-scaling casts of a grouped step hide behind its GEMMs?

    python scripts/probe_overlap.py [--experts 8] [--tokens 2048] [--k 4096] [--n 2048] [--carveouts 16 24 32]

The graphed forward+backward of one grouped layer (current scaling, E4M3, weights cast every
step), built from the package's casts (``triton_cast.cast_current``) and cuBLAS ``_scaled_mm``
per expert, in three schedules:

- ``serial``: the package's step today: one segmented cast each of w, x (fwd) and dy (bwd),
  then the experts' GEMMs;
- ``overlap-1L/c``: expert e+1's casts (the one-launch cast, ``c`` programs) on a side stream
  while expert e's GEMMs run on the main stream, their cuBLAS kernels told to leave ``c`` SMs
  free (``torch._C._set_sm_carveout_experimental``; only the GEMMs that run while casts remain);
- ``overlap-2L/c``: the same with the two-launch cast (one program per tile) on a low-priority
  stream, the GEMMs on a high-priority one.

Prints a table of milliseconds per step against the BF16 grouped step (``torch._grouped_mm``,
graphed the same way) and checks that every schedule's outputs equal ``serial``'s bit for bit.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib
from benchlib import markdown_table, median_ms

from megatron_fp8.kernels import triton_cast
from megatron_fp8.quant.kernels import segment_offsets
from megatron_fp8.testing import same_bits

F8 = torch.float8_e4m3fn
Cast = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # row [m, K], col [K, m], 1/scale (0-d)


def cast_one(t: torch.Tensor, one_launch: bool, programs: int | None = None) -> Cast:
    """Row and column FP8 copies of ``t`` and its dequantization scale."""
    if one_launch and programs is not None:
        from megatron_fp8.kernels.triton_persistent import cast_current_persistent

        row, col, _, inv = cast_current_persistent(t, F8, True, True, programs=programs)
    else:
        row, col, _, inv = triton_cast.cast_current(t, F8, True, True, one_launch=one_launch)
    return row, col, inv[0]


def cast_all(t: torch.Tensor, splits: list[int], offs: torch.Tensor) -> list[Cast]:
    """One segmented one-launch cast of every expert (the package's default), split into views."""
    row, col, _, inv = triton_cast.cast_current(t, F8, True, True, splits=splits, offsets=offs, one_launch=True)
    k, out, start = t.shape[1], [], 0
    for e, m in enumerate(splits):
        out.append((row[start:start + m], col[k * start:k * (start + m)].view(k, m), inv[e]))
        start += m
    return out


def mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, fast: bool,
       carveout: int | None) -> torch.Tensor:
    torch._C._set_sm_carveout_experimental(carveout)
    try:
        return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
    finally:
        torch._C._set_sm_carveout_experimental(None)


def gemms_fwd(xc: Cast, wc: Cast, c: int | None) -> torch.Tensor:
    return mm(xc[0], wc[0], xc[2], wc[2], True, c)


def gemms_bwd(dc: Cast, xc: Cast, wc: Cast, c: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    dx = mm(dc[0], wc[1], dc[2], wc[2], False, c)  # [m, N] x [N, K]: w's column copy [K, N]
    dw = mm(dc[1], xc[1], dc[2], xc[2], False, c)  # [N, m] x [m, K]: x's column copy [K, m]
    return dx, dw


def serial(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, E: int) -> Callable[[], list[torch.Tensor]]:
    m, n = x.shape[0] // E, w.shape[0] // E
    om, on = segment_offsets([m] * E, x.device), segment_offsets([n] * E, x.device)

    def step() -> list[torch.Tensor]:
        wc, xc = cast_all(w, [n] * E, on), cast_all(x, [m] * E, om)
        ys = [gemms_fwd(xc[e], wc[e], None) for e in range(E)]
        dc = cast_all(dy, [m] * E, om)
        bw = [gemms_bwd(dc[e], xc[e], wc[e], None) for e in range(E)]
        return [torch.cat(ys), torch.cat([b[0] for b in bw]), *[b[1] for b in bw]]

    return step


def overlapped(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, E: int, c: int, one_launch: bool,
               side: torch.cuda.Stream) -> Callable[[], list[torch.Tensor]]:
    m, n = x.shape[0] // E, w.shape[0] // E
    xs, ws, dys = x.split(m), w.split(n), dy.split(m)
    progs = c if one_launch else None

    def pipeline(first: Callable[[int], list[Cast]], rest: Callable[[int], list[Cast]],
                 work: Callable[[int, list[Cast], int | None], object]) -> list[object]:
        main = torch.cuda.current_stream()
        casts: list[list[Cast]] = [first(0)]  # expert 0 alone: every SM
        ev = []
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for e in range(1, E):
                casts.append(rest(e))
                ev.append(torch.cuda.Event())
                ev[-1].record(side)
        out = []
        for e in range(E):
            if e:
                main.wait_event(ev[e - 1])
            out.append(work(e, casts[e], c if e < E - 1 else None))  # the last one's casts are done
        main.wait_stream(side)
        for cs in casts[1:]:  # made on the side stream, read on main
            for t in cs:
                for u in t:
                    u.record_stream(main)
        return out

    def step() -> list[torch.Tensor]:
        fwd_casts: list[list[Cast]] = []

        def fwd(e: int, cs: list[Cast], cc: int | None) -> torch.Tensor:
            fwd_casts.append(cs)
            return gemms_fwd(cs[1], cs[0], cc)

        ys = pipeline(lambda e: [cast_one(ws[e], True), cast_one(xs[e], True)],
                      lambda e: [cast_one(ws[e], one_launch, progs), cast_one(xs[e], one_launch, progs)], fwd)
        bw = pipeline(lambda e: [cast_one(dys[e], True)], lambda e: [cast_one(dys[e], one_launch, progs)],
                      lambda e, cs, cc: gemms_bwd(cs[0], fwd_casts[e][1], fwd_casts[e][0], cc))
        return [torch.cat(ys), torch.cat([b[0] for b in bw]), *[b[1] for b in bw]]  # type: ignore[index]

    return step


def graphed(step: Callable[[], object], stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, object]:
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        out = step()
    g.replay()
    torch.cuda.synchronize()
    return g, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--carveouts", type=int, nargs="+", default=[8, 16, 24, 32, 48])
    a = p.parse_args()
    E, m, K, N = a.experts, a.tokens, a.k, a.n
    torch.manual_seed(0)
    dev = torch.device("cuda")
    x = torch.randn(E * m, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E * N, K, device=dev, dtype=torch.bfloat16) * 0.02
    dy = torch.randn(E * m, N, device=dev, dtype=torch.bfloat16)
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * m
    w3 = w.view(E, N, K)
    hi = torch.cuda.Stream(priority=-5)  # clamped to the device's highest
    lo = torch.cuda.Stream(priority=0)
    flops = 6 * E * m * N * K

    def bf16() -> None:
        torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        torch._grouped_mm(dy, w3, offs=offs)
        torch._grouped_mm(dy.t(), x, offs=offs)

    rows = []
    g, _ = graphed(bf16, hi)
    base = median_ms(g.replay)
    rows.append(["bf16 grouped_mm", f"{base:.3f}", f"{flops / base / 1e9:.0f}", "1.00", "-"])
    keep = [g]
    g, ref = graphed(serial(x, w, dy, E), hi)
    keep.append(g)
    t = median_ms(g.replay)
    rows.append(["fp8 serial (package schedule)", f"{t:.3f}", f"{flops / t / 1e9:.0f}", f"{base / t:.3f}", "ref"])
    for one_launch in (True, False):
        for c in a.carveouts:
            name = f"overlap-{'1L' if one_launch else '2L'}/{c}"
            try:
                g, out = graphed(overlapped(x, w, dy, E, c, one_launch, lo), hi)
            except Exception as exc:  # a probe: report and go on
                rows.append([name, "failed", str(exc)[:60], "", ""])
                continue
            keep.append(g)
            t = median_ms(g.replay)
            g.replay()
            torch.cuda.synchronize()
            same = same_bits(out, ref)  # type: ignore[arg-type]
            rows.append([name, f"{t:.3f}", f"{flops / t / 1e9:.0f}", f"{base / t:.3f}", "equal" if same else "DIFFER"])
            print(rows[-1], flush=True)
    print(f"\n{E} experts x {m} tokens, K={K}, N={N}, fwd+bwd graphed ({torch.cuda.get_device_name()}, "
          f"torch {torch.__version__})\n")
    print(markdown_table(["schedule", "ms", "TFLOP/s", "x BF16", "bits vs serial"], rows))


if __name__ == "__main__":
    main()
