"""Host cost of one cast-kernel launch with and without the kept-kernel shortcut
(``megatron_fp8.kernels.triton_launch.Launcher``), same process, same machine: prints a table (GPU).

    python scripts/launch_overhead.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib
from benchlib import host_and_device_ms, markdown_table

from megatron_fp8.kernels import triton_cast, triton_scale
from megatron_fp8.quant.quantizers import CurrentScalingQuantizer


def main() -> None:
    tiny = torch.ones(4, device="cuda")
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    q = CurrentScalingQuantizer(torch.float8_e4m3fn)
    cases = {
        "scale_from_amax (1 launch)": lambda: triton_scale.scale_from_amax(tiny, torch.float8_e4m3fn),
        "current quantize rc 256x256 (amax + cast launches)": lambda: q.quantize(x, rowwise=True, columnwise=True),
        "torch.empty (reference)": lambda: torch.empty(1024, device="cuda"),
    }
    launchers = [triton_cast._CAST, triton_scale._ROW_AMAX, triton_scale._SEGMENT_SCALE, triton_scale._SCALE_FROM_AMAX]
    rows = []
    for name, fn in cases.items():
        got = {}
        for fast in (False, True):
            for launcher in launchers:
                launcher.fast = fast
            got[fast] = host_and_device_ms(fn, 2000)[0] * 1e3  # host us per call
        rows.append([name, got[False], got[True], got[False] - got[True]])
    print(markdown_table(["call", "plain Triton launch us", "kept-kernel launch us", "saved us"], rows))


if __name__ == "__main__":
    main()
