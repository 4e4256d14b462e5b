"""The lean eager path on the GPU: its fast routes (one-launch current cast, CUDA / Triton block
casts, delayed amax-and-cast, torch's scaled_mm, cuBLASLt for HYBRID blocks) give the general
path's bits, save the same tensors and report the same GEMMs to ``record_gemms``."""

from __future__ import annotations

import pytest
import torch

import megatron_fp8 as mf
from megatron_fp8.recipe import PRESETS, Float8BlockScaling, Float8CurrentScaling, Format

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

RECIPES = {
    "current": PRESETS["current"],
    "current-e4m3": Float8CurrentScaling(fp8_format=Format.E4M3),
    "blockwise": PRESETS["blockwise"],
    "blockwise-hybrid": Float8BlockScaling(fp8_format=Format.HYBRID),
    "delayed": PRESETS["delayed"],
}


def _run(monkeypatch: pytest.MonkeyPatch, lean_on: str, recipe: object, soi: bool, bias: bool,
         dtype: torch.dtype = torch.bfloat16) -> tuple[list[torch.Tensor], list[tuple[str, str]], mf.Linear]:
    monkeypatch.setenv("MEGATRON_FP8_LEAN", lean_on)
    torch.manual_seed(3)
    layer = mf.Linear(1024, 512, bias=bias, params_dtype=dtype, device="cuda", save_original_input=soi, name="fc")
    x = torch.randn(2, 256, 1024, dtype=dtype, device="cuda", requires_grad=True)
    dy = torch.randn(2, 256, 512, dtype=dtype, device="cuda")
    out: list[torch.Tensor] = []
    with mf.gemm.record_gemms() as calls:
        for _ in range(3):  # the plan's first call, then its prepared launches
            with mf.fp8_autocast(fp8_recipe=recipe):
                y = layer(x)
            y.backward(dy)
            out += [y.detach().clone(), x.grad.clone(), layer.weight.grad.clone()]
            if bias:
                out.append(layer.bias.grad.clone())
    torch.cuda.synchronize()
    return out, [(c.name, c.backend.value) for c in calls], layer


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("soi", [False, True])
def test_lean_equals_general_on_the_gpu(monkeypatch: pytest.MonkeyPatch, recipe: str, soi: bool) -> None:
    general, general_calls, _ = _run(monkeypatch, "0", RECIPES[recipe], soi, True)
    planned, planned_calls, layer = _run(monkeypatch, "auto", RECIPES[recipe], soi, True)
    for i, (a, b) in enumerate(zip(general, planned)):
        assert torch.equal(a, b), (recipe, soi, i, (a.float() - b.float()).abs().max().item())
    assert planned_calls == general_calls
    q = layer._quantizers["weight"]
    plan = next(p for p in q.__dict__["_plans"].values() if p is not None)
    assert plan.proven
    fast = {"cast_x": plan.cast_x, "dy": plan.dy_route, "fprop": plan.fprop, "weight": next(iter(
        q.weight.__dict__["_lean_routes"].values()))}
    if recipe != "blockwise-hybrid":  # its dgrad/wgrad may run on Triton's GEMM (gemm decides, a general route)
        fast["dgrad"], fast["wgrad"] = plan.dgrad, plan.wgrad_gemm
    general_routes = [k for k, r in fast.items() if getattr(r, "general", False)]
    assert not general_routes, f"{recipe}: general routes where fast ones were expected: {general_routes}"


def test_lean_fp32_input_takes_the_general_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP32 inputs with a columnwise copy take the compiled reference (``kernels._transpose_ok``):
    their routes are the general ones, and the bits stay the general path's."""
    general, _, _ = _run(monkeypatch, "0", PRESETS["current"], False, False, torch.float32)
    planned, _, _ = _run(monkeypatch, "auto", PRESETS["current"], False, False, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(general, planned))


def _grouped_run(monkeypatch: pytest.MonkeyPatch, lean_on: str, recipe: object, soi: bool, splits: list[list[int]],
                 fuse: bool = False) -> tuple[list[torch.Tensor], list[tuple[str, str]], object]:
    from megatron_fp8.modules.grouped import GroupedLinear

    monkeypatch.setenv("MEGATRON_FP8_LEAN", lean_on)
    torch.manual_seed(5)
    layer = GroupedLinear(8, 1024, 512, bias=False, params_dtype=torch.bfloat16, device="cuda",
                          save_original_input=soi, fuse_wgrad_accumulation=fuse, name="fc1")
    if fuse:  # FP32 main_grads in one buffer, the last expert's first (Megatron's gradient buffer)
        main = torch.zeros(8, 512, 1024, device="cuda")
        for i, w in enumerate(layer.weights):
            w.main_grad = main[7 - i]
            w.grad_added_to_main_grad = False  # as Megatron's DDP tracks it: dummy grads come back
    out: list[torch.Tensor] = []
    with mf.gemm.record_gemms() as calls:
        for s in splits:  # a new split each step, as a router hands them out (padded to 128 inside)
            x = torch.randn(sum(s), 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            with mf.fp8_autocast(fp8_recipe=recipe):
                y = layer(x, s)
            y.backward(torch.randn_like(y))
            if fuse:
                assert all(w.grad_added_to_main_grad and w.grad is not None for w in layer.weights)
                for w in layer.weights:
                    w.grad, w.grad_added_to_main_grad = None, False  # what Megatron's hook does
            out += [y.detach().clone(), x.grad.clone(),
                    *[(w.main_grad if fuse else w.grad).clone() for w in layer.weights]]
    torch.cuda.synchronize()
    return out, [(c.name, c.backend.value) for c in calls], layer


@pytest.mark.parametrize("recipe", ["current", "blockwise", "blockwise-hybrid", "delayed"])
@pytest.mark.parametrize("soi", [False, True])
@pytest.mark.parametrize("fuse", [False, True], ids=["", "fused"])
def test_lean_grouped_equals_general_on_the_gpu(monkeypatch: pytest.MonkeyPatch, recipe: str, soi: bool,
                                                fuse: bool) -> None:
    """The grouped plan (ops.lean_grouped) with a top-2 router's uneven splits: the general path's
    bits and GEMM records (every expert GEMM native, on the one-launch Triton kernels); fused:
    the wgrads added into main_grads laid out as Megatron's buffers lay them (the lean path adds
    them in the wgrad's epilogue, the general one after it)."""
    from megatron_fp8.testing import router_splits

    splits = [router_splits(2048, 8, 2, seed=s) for s in range(3)]
    general, general_calls, _ = _grouped_run(monkeypatch, "0", RECIPES[recipe], soi, splits, fuse)
    planned, planned_calls, layer = _grouped_run(monkeypatch, "auto", RECIPES[recipe], soi, splits, fuse)
    for i, (a, b) in enumerate(zip(general, planned)):
        assert torch.equal(a, b), (recipe, soi, i, (a.float() - b.float()).abs().max().item())
    assert planned_calls == general_calls
    assert all(backend == "native" for _, backend in planned_calls)
    plans = [p for k, p in layer._quantizers["weight0"].__dict__["_plans"].items() if k[0] == "grouped"]
    if recipe == "delayed" and soi:  # the flag's delayed backward keeps the general path
        assert plans == [None]
        return
    assert len(plans) == 1 and plans[0] is not None and plans[0].proven and not plans[0].backward_general
