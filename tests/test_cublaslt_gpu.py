"""cuBLASLt called directly for HYBRID block GEMMs (E5M2 gradients with 1x128 / 128x128 scales,
which torch's ``scaled_mm`` refuses) and for per-tensor-scaled GEMMs (the default on CUDA, and
the wgrad added into ``main_grad`` in its epilogue): skip without CUDA; run on the device machine.

Per-tensor GEMMs must give torch's ``_scaled_mm`` bit for bit (every operand dtype pair, output
dtype and fast-accumulation setting the linears use).

The plumbing (operand order, scale modes and pointers, layouts) is checked where a yardstick is
bitwise: with two E4M3 operands our call must give torch's block GEMM bit for bit (the same
cuBLASLt kernel, torch's first heuristic answer). E5M2 operands then change only the data type;
their results are checked against emulation (dequantize, FP32 matmul) and our Triton GEMM within
accumulation order, and a HYBRID ``Linear`` is checked end to end: every GEMM native, flag on ==
off bitwise, a CUDA graph replay equal to an eager step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import megatron_fp8 as mf
from megatron_fp8 import gemm as core
from megatron_fp8.kernels import cublaslt
from megatron_fp8.ops import routes
from megatron_fp8.quant import make_quantizer
from megatron_fp8.quant.formats import ScaleLayout
from megatron_fp8.recipe import Float8BlockScaling, Float8CurrentScaling, Format, TensorRole
from megatron_fp8.testing import capture_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
L = ScaleLayout
HYBRID = Float8BlockScaling(fp8_format=Format.HYBRID)
M, N, K = 1024, 768, 2048
ROOT = Path(__file__).resolve().parents[1]
_REAL_LAUNCH = cublaslt._Plan.launch  # (tests spy on it: every direct cuBLASLt launch goes through it)


def _operands(recipe: Float8BlockScaling, gemm_name: str) -> tuple[core.Operand, core.Operand]:
    """The two operands of one of a linear's GEMMs as the linear casts them (dy in E5M2 under HYBRID)."""
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 1e-3
    qx, qw, qg = (make_quantizer(recipe, r) for r in TensorRole)
    if gemm_name == "fprop":
        return qx.quantize(x).rowwise, qw.quantize(w).rowwise
    if gemm_name == "dgrad":
        return qg.quantize(dy).rowwise, qw.quantize(w, rowwise=False, columnwise=True).columnwise
    return (qg.quantize(dy, rowwise=False, columnwise=True).columnwise,
            qx.quantize(x, rowwise=False, columnwise=True).columnwise)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _direct_vs_torch(gemm_name: str) -> tuple[bool, float]:
    """E4M3 block operands (what torch takes) through our direct call and torch's ``scaled_mm``:
    (bitwise equal, relative difference)."""
    a, b = _operands(Float8BlockScaling(), gemm_name)
    kinds = {L.BLOCK_1x128: F.ScalingType.BlockWise1x128, L.BLOCK_128x128: F.ScalingType.BlockWise128x128}
    sa, sb = core._block_scale_layout(a), core._block_scale_layout(b)
    ref = F.scaled_mm(a.data, b.data.t(), sa, kinds[a.layout], sb, kinds[b.layout],
                      swizzle_a=F.SwizzleType.NO_SWIZZLE, swizzle_b=F.SwizzleType.NO_SWIZZLE,
                      output_dtype=torch.bfloat16)
    out = torch.full_like(ref, float("nan"))
    assert cublaslt.matmul(a.data, sa, a.layout, b.data, sb, b.layout, out)
    return torch.equal(out, ref), _rel(out, ref)


@pytest.fixture(autouse=True)
def _defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The package's default paths, whatever the calling environment sets."""
    for var in ("MEGATRON_FP8_HYBRID_GEMM", "MEGATRON_FP8_BLOCK_GEMM", "MEGATRON_FP8_STRICT",
                "MEGATRON_FP8_GEMM_BACKEND", "MEGATRON_FP8_TENSOR_GEMM", "MEGATRON_FP8_LEAN"):
        monkeypatch.delenv(var, raising=False)


SM90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="block-scaled cuBLASLt GEMMs: SM90")


@SM90
@pytest.mark.parametrize("gemm_name", ["fprop", "dgrad", "wgrad"])
def test_direct_call_agrees_with_torch_for_e4m3(gemm_name: str) -> None:
    """Operand order, scale modes and layouts as torch hands them to cuBLASLt: our call agrees
    with torch's within accumulation order (both offer cuBLASLt a workspace of the same size, so
    the heuristic should answer alike; bitwise only asserted below; a misplaced scale gives
    errors of order 1)."""
    equal, rel = _direct_vs_torch(gemm_name)
    print(f"{gemm_name}: direct vs torch {'bitwise equal' if equal else f'rel diff {rel:.2e}'}")
    assert equal or rel < 2e-3


@SM90
def test_workspace_per_stream_kept() -> None:
    """cuBLASLt gets torch's workspace size, one buffer per stream, made once and kept."""
    a, b = _operands(HYBRID, "dgrad")
    sa, sb = core._block_scale_layout(a), core._block_scale_layout(b)
    outs = []
    for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                out = torch.empty(a.shape[0], b.shape[0], device="cuda", dtype=torch.bfloat16)
                assert cublaslt.matmul(a.data, sa, a.layout, b.data, sb, b.layout, out)
                outs.append(out)
        torch.cuda.current_stream().wait_stream(stream)
    dev = torch.cuda.current_device()
    mine = {k: v for k, v in cublaslt._workspaces.items() if k[0] == dev}
    assert len(mine) >= 2 and all(v.numel() == cublaslt.workspace_bytes(dev) == 32 * 2**20 for v in mine.values())
    assert all(torch.equal(o, outs[0]) for o in outs)


@SM90
def test_direct_call_is_torchs_kernel_without_workspace() -> None:
    """With ``CUBLASLT_WORKSPACE_SIZE=0`` (read by torch at its first cuBLASLt call, so in a fresh
    process) torch's heuristic answers as ours: every GEMM bit for bit torch's."""
    code = ("import torch, tests.test_cublaslt_gpu as t\n"
            "torch.manual_seed(0)\n"
            "print([t._direct_vs_torch(g)[0] for g in ('fprop', 'dgrad', 'wgrad')])")
    env = {**os.environ, "CUBLASLT_WORKSPACE_SIZE": "0", "MEGATRON_FP8_GEMM_BACKEND": "auto"}
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1:] == ["[True, True, True]"], run.stdout


@SM90
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("gemm_name", ["dgrad", "wgrad"])
def test_hybrid_gemm_runs_on_cublaslt(gemm_name: str, out_dtype: torch.dtype) -> None:
    """An E5M2 gradient with block scales: ``gemm`` runs it on cuBLASLt, within accumulation
    order of the emulation and of our Triton GEMM, and deterministic (two calls, same bits)."""
    a, b = _operands(HYBRID, gemm_name)
    assert torch.float8_e5m2 in (a.data.dtype, b.data.dtype)
    with core.record_gemms() as calls:
        got = core.gemm(a, b, out_dtype, name=gemm_name)
        again = core.gemm(a, b, out_dtype, name=gemm_name)
    # BF16 output: cuBLASLt must take it; FP32 (wgrad into main_grad): cuBLASLt if it has a kernel
    paths = {f"{gemm_name}[cublaslt]"} if out_dtype == torch.bfloat16 else {f"{gemm_name}[{p}]" for p in
                                                                            ("cublaslt", "triton")}
    assert len({c.name for c in calls}) == 1 and calls[0].name in paths, calls
    assert torch.equal(got, again)
    with core.force_backend("emulate"):
        emu = core.gemm(a, b, out_dtype)
    triton = core._triton_blocks(a, b, out_dtype, fast_accum=False)
    print(f"{calls[0].name} {out_dtype}: vs emulated {_rel(got, emu):.2e}, vs Triton {_rel(got, triton):.2e}")
    assert _rel(got, emu) < 4e-3 and _rel(got, triton) < 4e-3


@SM90
def test_hybrid_choice_triton_and_unaligned_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MEGATRON_FP8_HYBRID_GEMM=triton`` takes the Triton GEMM; an ``out`` that is not 256-byte
    aligned still gets cuBLASLt's result (computed aside, copied in)."""
    a, b = _operands(HYBRID, "dgrad")
    ref = core.gemm(a, b, torch.bfloat16)
    rows, cols = ref.shape
    buf = torch.empty(rows * cols + 8, device="cuda", dtype=torch.bfloat16)
    out = buf[8:].view(rows, cols)  # 16 bytes past an aligned start
    with core.record_gemms() as calls:
        core.gemm(a, b, torch.bfloat16, name="dgrad", out=out)
    assert calls[0].name == "dgrad[cublaslt]" and torch.equal(out, ref)
    monkeypatch.setenv("MEGATRON_FP8_HYBRID_GEMM", "triton")
    with core.record_gemms() as calls:
        tri = core.gemm(a, b, torch.bfloat16, name="dgrad")
    assert calls[0].name == "dgrad[triton]" and _rel(tri, ref) < 4e-3


@SM90
def test_hybrid_linear_native_and_flag_bitwise() -> None:
    """A HYBRID block ``Linear``: fprop on torch's cuBLAS, dgrad and wgrad on cuBLASLt directly,
    ``save_original_input`` on == off bitwise."""
    x = torch.randn(512, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(512, N, device="cuda", dtype=torch.bfloat16)
    results = []
    for flag in (False, True):
        torch.manual_seed(0)
        layer = mf.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device="cuda", save_original_input=flag)
        xi = x.clone().requires_grad_()
        with core.record_gemms() as calls:
            with mf.fp8_autocast(fp8_recipe=HYBRID):
                y = layer(xi)
            y.backward(dy)
        assert sorted(c.name for c in calls) == ["dgrad[cublaslt]", "fprop", "wgrad[cublaslt]"], calls
        assert all(c.backend is core.Backend.NATIVE for c in calls)
        results.append([y.detach(), xi.grad, layer.weight.grad])
    for one, two in zip(*results):
        assert torch.equal(one, two)


def _graphed_matmul() -> None:
    """One direct cuBLASLt GEMM (E5M2 x E4M3) captured on the main thread, no autograd: the replay
    equals the eager call. (Run in a fresh process by the test below.)"""
    a, b = _operands(HYBRID, "dgrad")
    sa, sb = core._block_scale_layout(a), core._block_scale_layout(b)
    eager = torch.empty(a.shape[0], b.shape[0], device="cuda", dtype=torch.bfloat16)
    assert cublaslt.matmul(a.data, sa, a.layout, b.data, sb, b.layout, eager)
    out = torch.full_like(eager, float("nan"))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert cublaslt.matmul(a.data, sa, a.layout, b.data, sb, b.layout, out)
    torch.cuda.current_stream().wait_stream(side)
    out.fill_(float("nan"))
    with torch.cuda.graph(graph):
        cublaslt.matmul(a.data, sa, a.layout, b.data, sb, b.layout, out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def _graphed_hybrid_linear() -> None:
    """A HYBRID ``Linear``'s whole step (forward, backward) captured in one graph; its replay equals
    an eager step of the same layer on the same data. (Run in a fresh process by the test below,
    under the ``MEGATRON_FP8_HYBRID_GEMM`` it sets.)"""
    x = torch.randn(512, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(512, N, device="cuda", dtype=torch.bfloat16)
    layer = mf.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device="cuda")
    xs, dys = x.clone().requires_grad_(), dy.clone()

    def step() -> list[torch.Tensor]:
        xs.grad, layer.weight.grad = None, None
        with mf.fp8_autocast(fp8_recipe=HYBRID):
            out = layer(xs)
        out.backward(dys)
        return [out, xs.grad, layer.weight.grad]

    graph, captured = capture_step(step)
    graph.replay()
    torch.cuda.synchronize()
    graphed = [t.clone() for t in captured]
    eager = step()
    for one, two in zip(graphed, eager):
        assert torch.equal(one, two)


@SM90
@pytest.mark.parametrize("case", ["matmul", "linear-cublaslt", "linear-triton"])
def test_hybrid_in_cuda_graphs(case: str) -> None:
    """Captured HYBRID GEMMs replay as they run eagerly: one direct cuBLASLt GEMM alone, and a
    ``Linear``'s whole step with the E5M2 GEMMs on cuBLASLt or on Triton. Each case in a fresh
    process: a failed capture leaves the process's CUDA state (its RNG among it) unusable, and
    the cases tell apart where a failure lies."""
    fn = "_graphed_matmul" if case == "matmul" else "_graphed_hybrid_linear"
    env = {**os.environ, "MEGATRON_FP8_HYBRID_GEMM": case.split("-")[-1] if case != "matmul" else "auto"}
    code = f"import torch, tests.test_cublaslt_gpu as t\ntorch.manual_seed(0)\nt.{fn}()\nprint('ok')"
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-4000:]


@SM90
def test_e4m3_block_linear_on_cublaslt_agrees_with_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MEGATRON_FP8_BLOCK_GEMM=cublaslt`` (the default): an E4M3 block ``Linear``'s three GEMMs are
    launched on cuBLASLt directly (``matmul`` or the lean routes' bound calls) and agree with
    torch's ``scaled_mm`` path (bitwise where the heuristic picks torch's kernel: see the
    workspace test above)."""
    x = torch.randn(512, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(512, N, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = _REAL_LAUNCH

    def spy(plan: object, a: int, *rest: object) -> None:
        calls.append(a)
        real(plan, a, *rest)
    monkeypatch.setattr(cublaslt._Plan, "launch", spy)
    results = []
    for choice in ("torch", "cublaslt"):
        monkeypatch.setenv("MEGATRON_FP8_BLOCK_GEMM", choice)
        torch.manual_seed(0)
        layer = mf.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device="cuda")
        xi = x.clone().requires_grad_()
        with mf.fp8_autocast(fp8_recipe=Float8BlockScaling()):
            y = layer(xi)
        y.backward(dy)
        results.append([y.detach(), xi.grad, layer.weight.grad])
        assert len(calls) == (3 if choice == "cublaslt" else 0), calls
    for one, two in zip(*results):
        assert torch.equal(one, two) or _rel(one, two) < 2e-3


_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _tensor_operands(m: int, n: int, k: int, da: str, db: str) -> tuple[torch.Tensor, ...]:
    a = (torch.randn(m, k, device="cuda") * 2).to(_FP8[da])
    b = (torch.randn(n, k, device="cuda") * 2).to(_FP8[db])
    return a, torch.tensor(0.75, device="cuda"), b, torch.tensor(1.25, device="cuda")


@pytest.mark.parametrize("fast_accum", [True, False], ids=["fast", "exact"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("pair", ["e4m3-e4m3", "e5m2-e4m3", "e4m3-e5m2"])
def test_tensorwise_direct_call_is_torchs(monkeypatch: pytest.MonkeyPatch, pair: str, out_dtype: torch.dtype,
                                          fast_accum: bool) -> None:
    """Per-tensor scales: our direct call gives torch's ``_scaled_mm`` bit for bit (the question
    torch asks cuBLASLt, with the same workspace size), at a linear's shapes and a small one."""
    monkeypatch.setenv("MEGATRON_FP8_TENSOR_GEMM", "cublaslt")
    torch.manual_seed(0)
    for m, n, k in ((256, 2048, 2048), (4096, 1024, 512), (48, 16, 32)):
        a, sa, b, sb = _tensor_operands(m, n, k, *pair.split("-"))
        assert cublaslt.serves(a, L.TENSOR, b, L.TENSOR, out_dtype)
        ref = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum)
        out = torch.full_like(ref, float("nan"))
        assert cublaslt.matmul(a, sa, L.TENSOR, b, sb, L.TENSOR, out, fast_accum)
        assert torch.equal(out, ref), (m, n, k, _rel(out, ref))


def test_bound_call_is_matmuls_and_declines_other_operands(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cublaslt.bind``: the lean routes' per-problem call gives ``matmul``'s (torch's) bits, and
    declines (nothing written) operands of another shape or a misaligned output."""
    monkeypatch.setenv("MEGATRON_FP8_TENSOR_GEMM", "cublaslt")
    torch.manual_seed(3)
    a, sa, b, sb = _tensor_operands(256, 2048, 1024, "e4m3", "e4m3")
    bound = cublaslt.bind(a, sa, L.TENSOR, b, sb, L.TENSOR, torch.bfloat16)
    assert bound is not None
    for _ in range(2):  # fresh operands of the same problem: the bound call serves them
        a, sa, b, sb = _tensor_operands(256, 2048, 1024, "e4m3", "e4m3")
        ref = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        out = torch.full_like(ref, float("nan"))
        assert bound(a, sa, b, sb, out) and torch.equal(out, ref)
    other = torch.full((128, 2048), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert not bound(a[:128], sa, b, sb, other) and other.isnan().all()
    wide = torch.full((256 * 2048 + 8,), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert not bound(a, sa, b, sb, wide[8:].view(256, 2048)) and wide.isnan().all()


def test_tensorwise_accumulate_adds_into_fp32() -> None:
    """``gemm.accumulate``: ``into += a @ b.T`` in the epilogue (beta = 1), within FP32 rounding of
    adding torch's FP32 GEMM; declined (nothing written) for a BF16 or misaligned buffer."""
    torch.manual_seed(1)
    a, sa, b, sb = _tensor_operands(1024, 2048, 512, "e5m2", "e4m3")
    opa, opb = core.Operand(a, sa, L.TENSOR), core.Operand(b, sb, L.TENSOR)
    base = torch.randn(1024, 2048, device="cuda")
    want = base + torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    got = base.clone()
    with core.record_gemms() as calls:
        assert core.accumulate(opa, opb, got)
    assert [c.name for c in calls] == ["wgrad"]
    assert _rel(got, want) < 1e-6, _rel(got, want)
    bf16 = base.to(torch.bfloat16)
    assert not core.accumulate(opa, opb, bf16) and torch.equal(bf16, base.to(torch.bfloat16))
    wide = torch.zeros(1024 * 2048 + 1, device="cuda")
    assert not core.accumulate(opa, opb, wide[1:].view(1024, 2048)) and not wide.any()




def _fused_steps(monkeypatch: pytest.MonkeyPatch, lean: str, tensor_gemm: str,
                 soi: bool) -> tuple[list[torch.Tensor], list[bool]]:
    monkeypatch.setenv("MEGATRON_FP8_LEAN", lean)
    monkeypatch.setenv("MEGATRON_FP8_TENSOR_GEMM", tensor_gemm)
    seen: list[bool] = []  # every direct cuBLASLt launch: whether it accumulated
    real = _REAL_LAUNCH

    def spy(plan: object, a: int, sa: int, b: int, sb: int, out: int, accumulate: bool, *rest: object) -> None:
        seen.append(accumulate)
        real(plan, a, sa, b, sb, out, accumulate, *rest)
    monkeypatch.setattr(cublaslt._Plan, "launch", spy)
    torch.manual_seed(2)
    layer = mf.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device="cuda", save_original_input=soi,
                      fuse_wgrad_accumulation=True, name="proj")
    layer.weight.main_grad = torch.zeros(N, K, device="cuda")
    layer.weight.grad_added_to_main_grad = False
    x = torch.randn(512, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(512, N, device="cuda", dtype=torch.bfloat16)
    out = []
    for _ in range(2):
        with mf.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
            y = layer(x)
        y.backward(dy)
        out += [y.detach().clone(), x.grad.clone(), layer.weight.main_grad.clone()]
        assert layer.weight.grad_added_to_main_grad
    return out, seen


@pytest.mark.parametrize("soi", [False, True], ids=["flag-off", "flag-on"])
def test_fused_wgrad_is_added_by_the_gemm(monkeypatch: pytest.MonkeyPatch, soi: bool) -> None:
    """Megatron's gradient-accumulation fusion under current scaling: the wgrad GEMM adds itself
    into ``main_grad`` (one cuBLASLt call with beta = 1, no separate add), the lean and general
    paths give the same bits, and ``main_grad`` agrees with torch's FP32 wgrad added after."""
    general, seen_general = _fused_steps(monkeypatch, "0", "torch", soi)
    lean, seen_lean = _fused_steps(monkeypatch, "auto", "torch", soi)
    assert seen_general == [True, True] and seen_lean == [True, True], (seen_general, seen_lean)
    for i, (a, b) in enumerate(zip(general, lean)):
        assert torch.equal(a, b), i
    everything, seen_lt = _fused_steps(monkeypatch, "auto", "cublaslt", soi)  # every GEMM on cuBLASLt
    assert seen_lt.count(True) == 2 and len(seen_lt) == 6, seen_lt
    for i, (a, b) in enumerate(zip(lean, everything)):  # torch's bits
        assert torch.equal(a, b), i
    monkeypatch.setattr(mf.gemm, "accumulate", lambda *a, **k: False)  # the lean path's separate add
    monkeypatch.setattr(routes, "accumulate_route", lambda *a, **k: lambda *a: False)  # (its bound call too)
    added, _ = _fused_steps(monkeypatch, "auto", "torch", soi)
    for i, (a, b) in enumerate(zip(lean, added)):  # y and dx: the same; main_grad: FP32 rounding
        assert torch.equal(a, b) if i % 3 < 2 else _rel(a, b) < 1e-6, i
