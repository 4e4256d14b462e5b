"""GPU checks (skip without CUDA; run on the device machine): native GEMMs vs emulation, the
compiled casts vs the CPU reference (bitwise), and the Linear's guarantees on native paths."""

from __future__ import annotations

import gc

import pytest
import torch

import megatron_fp8 as mf
from megatron_fp8 import gemm as core
from megatron_fp8.quant import make_quantizer
from megatron_fp8.quant.formats import ScaleLayout
from megatron_fp8.recipe import TensorRole
from megatron_fp8.testing import same_bits

from .conftest import RECIPES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
L = ScaleLayout
PAIRS = [(L.TENSOR, L.TENSOR), (L.ROW, L.ROW), (L.BLOCK_1x128, L.BLOCK_128x128),
         (L.BLOCK_1x128, L.BLOCK_1x128), (L.BLOCK_128x128, L.BLOCK_1x128), (L.MX_1x32, L.MX_1x32)]


def test_report_native_paths() -> None:
    dev = torch.device("cuda")
    lines = [f"{a.value} x {b.value}: {'native' if core.native_supported(a, b, dev) else 'emulated'}"
             for a, b in PAIRS]
    print(f"\n{torch.cuda.get_device_name()} sm{''.join(map(str, torch.cuda.get_device_capability()))}, "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}:\n  " + "\n  ".join(lines))
    if torch.cuda.get_device_capability() == (9, 0):
        assert all(core.native_supported(a, b, dev) for a, b in PAIRS[:5])


def _rowwise_operand(x: torch.Tensor) -> core.Operand:
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = 448.0 / amax
    data = (x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return core.Operand(data, scale.reciprocal(), L.ROW)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("gemm_name", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("name", ["current", "block"])
def test_native_agrees_with_emulation(name: str, gemm_name: str) -> None:
    recipe = RECIPES[name]
    m, n, k = 1024, 768, 2048
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    qx, qw, qg = (make_quantizer(recipe, r) for r in TensorRole)
    if gemm_name == "fprop":
        a, b = qx.quantize(x).rowwise, qw.quantize(w).rowwise
    elif gemm_name == "dgrad":
        a, b = qg.quantize(dy).rowwise, qw.quantize(w, rowwise=False, columnwise=True).columnwise
    else:
        a = qg.quantize(dy, rowwise=False, columnwise=True).columnwise
        b = qx.quantize(x, rowwise=False, columnwise=True).columnwise
    for out_dtype in (torch.bfloat16, torch.float32):  # FP32: native if cuBLAS allows, else BF16 + cast
        with core.record_gemms() as calls:
            nat = core.gemm(a, b, out_dtype)
        assert calls[0].backend is core.Backend.NATIVE
        with core.force_backend("emulate"):
            emu = core.gemm(a, b, out_dtype)
        err = _rel(nat, emu)
        print(f"{name} {gemm_name} {out_dtype}: native vs emulated rel err {err:.2e}")
        assert err < 4e-3  # accumulation order (+ BF16 output rounding of block GEMMs)


def test_native_rowwise_agrees_with_emulation() -> None:
    a = _rowwise_operand(torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16))
    b = _rowwise_operand(torch.randn(768, 2048, device="cuda", dtype=torch.bfloat16))
    nat = core.gemm(a, b, torch.bfloat16)
    with core.force_backend("emulate"):
        emu = core.gemm(a, b, torch.bfloat16)
    assert _rel(nat, emu) < 4e-3


@pytest.mark.parametrize("backend", ["auto", "compile"])
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("role", list(TensorRole), ids=[r.value for r in TensorRole])
def test_gpu_casts_bitwise_equal_cpu_reference(name: str, role: TensorRole, backend: str, monkeypatch) -> None:
    """auto = the Triton kernels where they apply, compile = torch.compile of the reference:
    bitwise, NaN and +-inf in the input too (their bytes are set after the FP8 conversion, whose
    NaN encoding differs between inductor and the CPU)."""
    monkeypatch.setenv("MEGATRON_FP8_CAST_BACKEND", backend)
    x = (torch.randn(512, 1024) * torch.logspace(-2, 2, 512).unsqueeze(1)).to(torch.bfloat16)
    x[3, 7] = 0.0
    x[128:256, :128] = 0.0  # zero blocks
    x[5, 9], x[300, 1000] = 448.0 * 2**-20, -3.0e4  # amax values near powers of two / the E4M3 max
    x[7, 300], x[400, 5], x[9, 9] = float("nan"), float("inf"), float("-inf")  # block amaxes: finite values
    outs = []
    for dev in ("cpu", "cuda"):
        q = make_quantizer(RECIPES[name], role)
        qt = q.quantize(x.to(dev), rowwise=True, columnwise=True)
        outs.append([t.cpu() for t in qt.tensors()])
    for c, g in zip(*outs):
        assert c.dtype == g.dtype and same_bits([c], [g])


@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_flag_bitwise_on_native_paths(name: str) -> None:
    res = []
    for flag in (False, True):
        torch.manual_seed(0)
        layer = mf.Linear(1024, 2048, params_dtype=torch.bfloat16, device="cuda", save_original_input=flag)
        x = torch.randn(4, 256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with core.record_gemms() as calls:
            with mf.fp8_autocast(fp8_recipe=RECIPES[name]):
                y = layer(x)
                y2 = layer(torch.tanh(y[..., :1024]))
            (y.float().sum() + y2.float().square().sum()).backward()
        res.append([y, y2, x.grad, layer.weight.grad, layer.bias.grad])
    expected = core.Backend.EMULATE if name == "mxfp8" else core.Backend.NATIVE
    assert {c.backend for c in calls} == {expected}
    for a, b in zip(*res):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(RECIPES))
def test_max_memory_allocated_confirms_saving(name: str) -> None:
    """Retained memory after forward (and the forward peak) drop by what the accounting predicts:
    the columnwise FP8 copy of x the flag avoids. x stays alive as another module would keep it."""
    m, k, n = 16384, 4096, 4096
    x = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 0.1).requires_grad_()
    got = {}
    for flag in (False, True):
        layer = mf.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda", save_original_input=flag)
        with mf.fp8_autocast(fp8_recipe=RECIPES[name]):
            layer(x[:256])  # warm-up: compiled casts, cuBLAS workspace
        gc.collect()  # nothing of the previous pass may be freed inside this one's measurement
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with mf.memory.track_saved_tensors() as saved, mf.fp8_autocast(fp8_recipe=RECIPES[name]):
            y = layer(x)
        torch.cuda.synchronize()
        retained = torch.cuda.memory_allocated() - base
        got[flag] = (retained, torch.cuda.max_memory_allocated() - base, saved.activation_bytes)
        y.float().sum().backward()
        del y, saved
    # the flagged layer's saved x is the caller's storage, allocated before the region
    predicted = got[False][2] - (got[True][2] - x.untyped_storage().nbytes())
    retained = got[False][0] - got[True][0]
    peak = got[False][1] - got[True][1]
    print(f"{name}: accounting predicts {predicted / 2**20:.2f} MiB less; allocator: retained "
          f"{retained / 2**20:.2f} MiB less, forward peak {peak / 2**20:.2f} MiB less")
    assert abs(retained - predicted) <= 0.01 * predicted
    assert peak >= 0.99 * predicted


@pytest.mark.parametrize("hybrid", [False, True], ids=["e4m3", "hybrid"])
def test_partial_weight_blocks_native_and_bitwise_on_cuda(hybrid: bool) -> None:
    """DeepSeek's kv down-projection width (576 out features, 4.5 weight blocks) under 128x128
    block scaling on the GPU: every GEMM native, and bitwise the zero-padded 640-wide layer."""
    from megatron_fp8.recipe import Float8BlockScaling, Format

    recipe = Float8BlockScaling(fp8_format=Format.HYBRID if hybrid else Format.E4M3)
    torch.manual_seed(0)
    layer = mf.Linear(1024, 576, bias=False, params_dtype=torch.bfloat16, device="cuda")
    twin = mf.Linear(1024, 640, bias=False, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        twin.weight.zero_()
        twin.weight[:576].copy_(layer.weight)
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(512, 576, device="cuda", dtype=torch.bfloat16)
    outs = []
    for module, grad in ((layer, dy), (twin, torch.nn.functional.pad(dy, (0, 64)))):
        xi = x.clone().requires_grad_()
        with core.record_gemms() as calls:
            with mf.fp8_autocast(fp8_recipe=recipe):
                y = module(xi)
            y.backward(grad)
        assert len(calls) == 3 and not [c for c in calls if c.backend is core.Backend.EMULATE], calls
        outs.append([y[:, :576], xi.grad, module.weight.grad[:576]])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
