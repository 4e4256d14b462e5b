"""The one-launch current-scaling cast's schedules against each other (GPU only): every
combination of ``triton_persistent.PIPELINE`` (the experts' casts segment by segment) and
``L2_HINTS`` (eviction hints: the amax pass's lines kept in L2, the cast's loads and FP8 stores
marked first to go), checked bit for bit against the package's default, then timed; prints one
table with the two-launch cast and a DRAM copy (``clone``) as yardsticks.

    python scripts/probe_current_l2.py

The amax pass reads the tensor once and the cast reads it again; what the second read finds in
L2 (50 MB on an H200) it does not take from DRAM. Bytes moved count both reads, so a cast whose
second read hits L2 shows above the copy rate.
"""

from __future__ import annotations

import torch
from benchlib import environment, markdown_table, median_ms

from megatron_fp8.quant import kernels, triton_cast, triton_persistent
from megatron_fp8.testing import same_bits

SCHEDULES = [(False, False), (False, True), (True, False), (True, True)]


def _name(pipe: bool, hints: bool) -> str:
    return ("segment by segment" if pipe else "barrier") + (" + L2 hints" if hints else "")


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("probe_current_l2.py needs CUDA (run it on the device machine)")
    print(environment())
    e4 = torch.float8_e4m3fn
    cases = [("x 8x2048x4096", 8, 2048, 4096, True, True), ("dy 8x2048x2048", 8, 2048, 2048, True, True),
             ("x 8x2048x4096, col only", 8, 2048, 4096, False, True), ("x 32x512x4096", 32, 512, 4096, True, True),
             ("x 16384x4096 plain", 1, 16384, 4096, True, True)]
    default = (triton_persistent.PIPELINE, triton_persistent.L2_HINTS)
    rows = []
    for label, experts, tokens, k, row, col in cases:
        x = torch.randn(experts * tokens, k, device="cuda", dtype=torch.bfloat16)
        x[:tokens] *= 50.0  # the experts' scales differ
        splits = [tokens] * experts if experts > 1 else None
        off = kernels.segment_offsets(splits, x.device) if splits else None
        gb = (4 + row + col) * x.numel() / 1e9  # GB moved: two reads of 2 bytes, 1 byte per FP8 copy

        def one(x: torch.Tensor = x, splits: list[int] | None = splits, off: torch.Tensor | None = off,
                row: bool = row, col: bool = col):
            return triton_persistent.cast_current_persistent(x, e4, row, col, splits=splits, offsets=off)

        timings = {"clone (DRAM copy)": median_ms(lambda x=x: x.clone()),
                   "two launches": median_ms(lambda x=x, s=splits, o=off, r=row, c=col: triton_cast.cast_current(
                       x, e4, r, c, splits=s, offsets=o))}
        ref = None
        for pipe, hints in SCHEDULES:
            if pipe and splits is None:
                continue
            triton_persistent.PIPELINE, triton_persistent.L2_HINTS = pipe, hints
            out = one()
            if ref is None:
                ref = out
            elif not same_bits(out, ref):
                rows.append([label, _name(pipe, hints), "MISMATCH", "", ""])
                continue
            timings[_name(pipe, hints)] = median_ms(one)
        triton_persistent.PIPELINE, triton_persistent.L2_HINTS = default
        base = timings[_name(False, False)]
        for name, ms in timings.items():
            moved = 4 * x.numel() / 1e9 if name.startswith("clone") else gb
            rows.append([label, name, f"{ms * 1e3:.1f}", f"{moved / ms:.2f}", f"{base / ms:.2f}x"])
    print(markdown_table(["tensor", "schedule", "us", "TB/s (both reads counted)", "vs barrier"], rows))


if __name__ == "__main__":
    main()
