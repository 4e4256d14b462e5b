"""Where a step's time goes (GPU): host wall time per call vs device time, and the top device
kernels, for single casts and grouped-layer forwards. Separates launch-bound from device-bound.

    python scripts/profile_steps.py
"""

from __future__ import annotations

import torch
from benchlib import host_and_device_ms, markdown_table, own_time_profile
from torch.profiler import ProfilerActivity, profile

from megatron_fp8 import Linear, fp8_autocast
from megatron_fp8.modules.grouped import GroupedLinear
from megatron_fp8.quant import make_quantizer
from megatron_fp8.recipe import PRESETS, TensorRole


def _top_kernels(fn, k: int = 12, sort_by: str = "self_cuda_time_total") -> str:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by=sort_by, row_limit=k, max_name_column_width=60)


def _host_profile(fn, k: int = 25, sort: str = "tottime") -> str:
    """Python functions by own time (``sort``: any pstats key) over 10 calls (where the host's
    milliseconds go)."""
    fn()
    return own_time_profile(fn, 10, k, sort)


def _syncs(fn) -> str:
    """Host-device synchronisations one call makes (torch's sync debug mode)."""
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "; ".join(str(w.message).splitlines()[0] for w in caught) or "none"


def main() -> None:
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    cases = {}
    # launch costs alone (tiny tensors: host-bound by construction)
    from megatron_fp8.kernels import triton_scale

    tiny = torch.ones(4, device="cuda")
    a16 = torch.ones(16, 16, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    cases["launch: one Triton kernel (scale_from_amax, 4 values)"] = lambda: triton_scale.scale_from_amax(
        tiny, torch.float8_e4m3fn)
    cases["launch: torch._scaled_mm 16x16x16"] = lambda: torch._scaled_mm(a16, a16.t(), one, one,
                                                                          out_dtype=torch.bfloat16)
    cases["launch: torch.empty x4"] = lambda: [torch.empty(1024, device="cuda") for _ in range(4)]
    xs = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    for rname in ("current", "blockwise"):
        q = make_quantizer(PRESETS[rname], TensorRole.INPUT)
        cases[f"launch: {rname} quantize rc 256x256"] = lambda q=q: q.quantize(xs, rowwise=True, columnwise=True)
    for rname in ("current", "blockwise", "delayed"):
        q = make_quantizer(PRESETS[rname], TensorRole.INPUT)
        cases[f"{rname} x quantize r"] = lambda q=q: q.quantize(x, rowwise=True, columnwise=False)
        cases[f"{rname} x quantize rc"] = lambda q=q: q.quantize(x, rowwise=True, columnwise=True)
    splits = [2048] * 8
    for rname in ("current", "blockwise", "delayed"):
        layer = GroupedLinear(8, 4096, 2048, bias=False, params_dtype=torch.bfloat16, device="cuda")

        def fwd(layer=layer, r=PRESETS[rname]) -> None:
            with torch.no_grad(), fp8_autocast(fp8_recipe=r):
                layer(x, splits)

        cases[f"{rname} grouped fwd"] = fwd
        xg = x.detach().clone().requires_grad_(True)
        dyg = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16) * 1e-3

        def fwd_bwd(layer=layer, r=PRESETS[rname], xg=xg, dyg=dyg) -> None:
            xg.grad = None
            for p in layer.parameters():
                p.grad = None
            with fp8_autocast(fp8_recipe=r):
                y = layer(xg, splits)
            y.backward(dyg)

        cases[f"{rname} grouped fwd+bwd"] = fwd_bwd
    # the Linear shapes that missed their targets: K small (casts weigh most), K large (flag cost)
    for m, n, k in ((16384, 7168, 2048), (16384, 4096, 14336)):
        xl = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
        for rname in ("current", "blockwise"):
            for flag in (False, True):
                lin = Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda",
                             save_original_input=flag)

                def step(lin=lin, r=PRESETS[rname], xl=xl, dy=dy) -> None:
                    xl.grad = lin.weight.grad = None
                    with fp8_autocast(fp8_recipe=r):
                        y = lin(xl)
                    y.backward(dy)

                cases[f"{rname} Linear {m}x{n}x{k} flag={'on' if flag else 'off'}"] = step
    rows = []
    for name, fn in cases.items():
        host, dev = host_and_device_ms(fn)
        rows.append([name, host, dev])
        print(rows[-1], flush=True)
    print(markdown_table(["case", "host ms/call", "device ms/call"], rows))
    for name in ("current Linear 16384x7168x2048 flag=off", "blockwise Linear 16384x7168x2048 flag=off",
                 "current Linear 16384x4096x14336 flag=off", "current Linear 16384x4096x14336 flag=on",
                 "blockwise Linear 16384x7168x2048 flag=on", "current grouped fwd+bwd",
                 "blockwise grouped fwd+bwd"):
        print(f"## {name}\n{_top_kernels(cases[name])}", flush=True)
    for name in ("current grouped fwd+bwd", "blockwise grouped fwd+bwd"):
        print(f"## {name} (host)\n{_top_kernels(cases[name], 25, 'self_cpu_time_total')}", flush=True)
    for name in ("current grouped fwd+bwd", "current Linear 16384x7168x2048 flag=off"):
        print(f"## {name} (Python, cProfile)\n{_host_profile(cases[name])}", flush=True)
    for name, fn in cases.items():
        print(f"syncs in {name}: {_syncs(fn)}", flush=True)


if __name__ == "__main__":
    main()
