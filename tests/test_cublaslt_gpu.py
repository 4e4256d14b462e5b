"""cuBLASLt called directly (``megatron_fp8.cublaslt``) against torch's ``scaled_mm`` (GPU; the
setting's check runs everywhere): the same kernel, so the same bits, for every tensorwise and
block-scaled pair and output dtype, eagerly and replayed from a CUDA graph, at unaligned
addresses too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_fp8 import cublaslt
from megatron_fp8 import gemm as core
from megatron_fp8.quant import make_quantizer
from megatron_fp8.recipe import TensorRole
from megatron_fp8.testing import capture_step, same_bits

from .conftest import RECIPES

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="block-scaled cuBLASLt GEMMs need SM90")


def test_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_FP8_CUBLASLT", "yes")
    with pytest.raises(ValueError, match="MEGATRON_FP8_CUBLASLT='yes'"):
        cublaslt.enabled()
    monkeypatch.setenv("MEGATRON_FP8_CUBLASLT", "0")
    assert not cublaslt.enabled()
    assert not cublaslt.serves(core.L.TENSOR, core.L.TENSOR, torch.bfloat16, torch.device("cpu"))


def _operands(name: str, gemm_name: str, m: int, n: int, k: int) -> tuple[core.Operand, core.Operand]:
    recipe = RECIPES[name]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    qx, qw, qg = (make_quantizer(recipe, r) for r in TensorRole)
    if gemm_name == "fprop":
        return qx.quantize(x).rowwise, qw.quantize(w).rowwise
    if gemm_name == "dgrad":
        return qg.quantize(dy).rowwise, qw.quantize(w, rowwise=False, columnwise=True).columnwise
    return (qg.quantize(dy, rowwise=False, columnwise=True).columnwise,
            qx.quantize(x, rowwise=False, columnwise=True).columnwise)


def _torch_gemm(monkeypatch: pytest.MonkeyPatch, a: core.Operand, b: core.Operand, out_dtype: torch.dtype,
                fast_accum: bool = False) -> torch.Tensor:
    with monkeypatch.context() as mp:
        mp.setenv("MEGATRON_FP8_CUBLASLT", "0")
        return core.gemm(a, b, out_dtype, fast_accum=fast_accum)


def _check_same_bits() -> None:
    """Every pair, GEMM and output dtype through both paths, bitwise; run in a fresh process with
    ``CUBLASLT_WORKSPACE_SIZE=0`` (torch reads it at its first cuBLASLt call): torch then asks
    the heuristic for kernels without a workspace, as ``cublaslt`` does, and gets the same one."""
    mp = pytest.MonkeyPatch()
    served = 0
    for name in ("current", "block"):
        for gemm_name in ("fprop", "dgrad", "wgrad"):
            a, b = _operands(name, gemm_name, 512, 384, 1024)
            for out_dtype in (torch.bfloat16, torch.float32, torch.float16):
                for fast_accum in (False, True) if name == "current" else (False,):
                    ref = _torch_gemm(mp, a, b, out_dtype, fast_accum)
                    cublaslt._plans.clear()
                    got = core.gemm(a, b, out_dtype, fast_accum=fast_accum)
                    lt = any(p is not None for p in cublaslt._plans.values())
                    served += lt
                    print(f"{name} {gemm_name} {out_dtype} fast_accum={fast_accum}: "
                          f"{'cuBLASLt' if lt else 'torch (no cuBLASLt answer)'}", flush=True)
                    assert got.dtype == out_dtype and same_bits([got], [ref]), (name, gemm_name, out_dtype)
                    if out_dtype == torch.bfloat16:
                        assert lt, f"cuBLASLt served no {name} {gemm_name} GEMM with BF16 output"
    print(f"cuBLASLt served {served} of the GEMMs, all bitwise equal to torch's")


@sm90
def test_same_bits_as_torch() -> None:
    env = dict(os.environ, CUBLASLT_WORKSPACE_SIZE="0", MEGATRON_FP8_CUBLASLT="1")
    proc = subprocess.run([sys.executable, "-m", "tests.test_cublaslt_gpu"], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parent.parent, env=env)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all bitwise equal" in proc.stdout


@sm90
@pytest.mark.parametrize("name", ["current", "block"])
def test_served_by_cublaslt_and_replayable(name: str) -> None:
    a, b = _operands(name, "wgrad", 256, 256, 512)
    out = torch.empty(256, 256, device="cuda", dtype=torch.bfloat16)
    cublaslt._plans.clear()
    core.gemm(a, b, torch.bfloat16, out=out)
    assert [p for p in cublaslt._plans.values() if p is not None], "cuBLASLt served no GEMM"
    eager = out.clone()
    out.fill_(float("nan"))
    graph, _ = capture_step(lambda: core.gemm(a, b, torch.bfloat16, out=out))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits([out], [eager])


@sm90
def test_unaligned_operands() -> None:
    """Operands starting 16 bytes into a buffer: the plan records the alignment cuBLASLt may
    assume, so the kernel it picks reads them right."""
    a, b = _operands("current", "fprop", 256, 128, 512)
    buf = torch.empty(256 * 512 + 16, device="cuda", dtype=a.data.dtype)
    a16 = core.Operand(buf[16:].view(256, 512).copy_(a.data), a.scale_inv, a.layout)
    assert a16.data.data_ptr() % 32 == 16
    cublaslt._plans.clear()
    got = core.gemm(a16, b, torch.bfloat16)
    assert [k for k, p in cublaslt._plans.items() if p is not None and k[-1][1] == 16], "not served at 16 bytes"
    with core.force_backend("emulate"):
        ref = core.gemm(a, b, torch.bfloat16)
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 4e-3


@cuda
def test_off_routes_through_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_FP8_CUBLASLT", "0")
    a, b = _operands("current", "fprop", 256, 128, 512)
    before = dict(cublaslt._plans)
    core.gemm(a, b, torch.bfloat16)
    assert cublaslt._plans == before


if __name__ == "__main__":
    _check_same_bits()
