"""Host cost of one GroupedLinear training step (GPU): host vs device milliseconds per step for
each grouped-GEMM path (``MEGATRON_FP8_GROUPED_GEMM``) and recipe, and where the host's time goes
(cProfile, own time) for the default path. A step whose host time matches its device time is
launch/Python-bound: the GPU waits on us.

    python scripts/profile_grouped_host.py [--experts 8] [--tokens 2048] [--k 4096] [--n 2048]
"""

from __future__ import annotations

import argparse
import os

import torch
from benchlib import host_and_device_ms, markdown_table, train_step
from profile_steps import _host_profile, _syncs, _top_kernels

from megatron_fp8.modules.grouped import GroupedLinear
from megatron_fp8.recipe import PRESETS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--paths", nargs="*", default=["auto", "triton", "torch", "loop"])
    p.add_argument("--recipes", nargs="*", default=["current", "blockwise"])
    p.add_argument("--detail", action="store_true",
                   help="also cumulative Python time, host time per aten op and the step's syncs")
    args = p.parse_args()
    splits = [args.tokens] * args.experts
    x = torch.randn(sum(splits), args.k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(sum(splits), args.n, device="cuda", dtype=torch.bfloat16) * 1e-3
    layer = GroupedLinear(args.experts, args.k, args.n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    rows = []
    for path in args.paths:
        os.environ["MEGATRON_FP8_GROUPED_GEMM"] = path
        for rname in args.recipes:
            host, dev = host_and_device_ms(train_step(layer, x, dy, PRESETS[rname], splits))
            rows.append([path, rname, host, dev])
            print(rows[-1], flush=True)
    print(markdown_table(["grouped GEMM path", "recipe", "host ms/step", "device ms/step"], rows))
    os.environ["MEGATRON_FP8_GROUPED_GEMM"] = "auto"
    for rname in args.recipes:
        step = train_step(layer, x, dy, PRESETS[rname], splits)
        print(f"## {rname} (auto), Python own time over 10 steps\n{_host_profile(step, 30)}", flush=True)
        if args.detail:
            print(f"## {rname} (auto), cumulative over 10 steps\n{_host_profile(step, 45, 'cumulative')}")
            print(f"## {rname} (auto), host time by op over 3 steps\n"
                  f"{_top_kernels(step, 30, 'self_cpu_time_total')}")
            print(f"syncs in a {rname} step: {_syncs(step)}", flush=True)


if __name__ == "__main__":
    main()
