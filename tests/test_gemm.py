"""The GEMM core: emulation is exactly an FP32 matmul of dequantized operands; FP8 GEMMs are
close to a BF16 matmul by SQNR; backend selection is inspectable and forceable."""

from __future__ import annotations

import pytest
import torch

from megatron_fp8 import gemm as core
from megatron_fp8 import gemm_grouped
from megatron_fp8.quant import make_quantizer
from megatron_fp8.quant.formats import ScaleLayout
from megatron_fp8.quant.reference import e8m0_to_float
from megatron_fp8.recipe import TensorRole

from .conftest import RECIPES

M, N, K = 256, 384, 512


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return float(20 * torch.log10(ref.norm() / (ref - out).norm()))


def _dequant_independent(data: torch.Tensor, scale_inv: torch.Tensor, layout: ScaleLayout) -> torch.Tensor:
    """The test's own dequantization (expand scales with kron), not the package's."""
    d = data.float()
    if layout is ScaleLayout.TENSOR:
        return d * scale_inv
    s = e8m0_to_float(scale_inv) if layout is ScaleLayout.MX_1x32 else scale_inv
    br, bc = layout.block
    return d * torch.kron(s, torch.ones(br, bc))


def _operands(recipe, gemm_name: str):
    """Quantized (a, b) operands of one of the three linear GEMMs, and the HP tensors."""
    x = torch.randn(M, K, dtype=torch.bfloat16)
    w = torch.randn(N, K, dtype=torch.bfloat16) * 0.05
    dy = torch.randn(M, N, dtype=torch.bfloat16) * 1e-3
    qx, qw, qg = (make_quantizer(recipe, r) for r in (TensorRole.INPUT, TensorRole.WEIGHT, TensorRole.GRAD_OUTPUT))
    if gemm_name == "fprop":
        return qx.quantize(x).rowwise, qw.quantize(w).rowwise, x.float() @ w.float().t()
    if gemm_name == "dgrad":
        wq = qw.quantize(w, rowwise=False, columnwise=True)
        return qg.quantize(dy).rowwise, wq.columnwise, dy.float() @ w.float()
    dyq = qg.quantize(dy, rowwise=False, columnwise=True)
    xq = qx.quantize(x, rowwise=False, columnwise=True)
    return dyq.columnwise, xq.columnwise, dy.float().t() @ x.float()


GEMMS = ["fprop", "dgrad", "wgrad"]


@pytest.mark.parametrize("gemm_name", GEMMS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_emulation_is_fp32_matmul_of_dequantized_operands(recipe, gemm_name: str, out_dtype) -> None:
    a, b, _ = _operands(recipe, gemm_name)
    with core.force_backend("emulate"):
        out = core.gemm(a, b, out_dtype)
    ref = _dequant_independent(a.data, a.scale_inv, a.layout) @ _dequant_independent(
        b.data, b.scale_inv, b.layout).t()
    assert torch.equal(out, ref.to(out_dtype))


# Measured on this CPU (2026-12-02, seed 1234), SQNR in dB of fprop / dgrad / wgrad against the
# exact product of the high-precision operands (E4M3 on Gaussian data: ~28.5 dB; the E5M2
# gradients of the HYBRID format: ~24.6 dB):
#   delayed 28.4 / 24.5 / 24.6   current 28.5 / 24.7 / 24.7   block 28.5 / 28.5 / 28.5
#   mxfp8   28.5 / 28.5 / 28.5
# Thresholds sit 3 dB below; a wrong scale layout lands far lower (see the next test).
SQNR_MIN = {
    "delayed": {"fprop": 25.4, "dgrad": 21.5, "wgrad": 21.5},
    "current": {"fprop": 25.5, "dgrad": 21.7, "wgrad": 21.7},
    "block": {"fprop": 25.5, "dgrad": 25.5, "wgrad": 25.5},
    "mxfp8": {"fprop": 25.5, "dgrad": 25.5, "wgrad": 25.5},
}


@pytest.mark.parametrize("gemm_name", GEMMS)
def test_fp8_gemm_close_to_high_precision_by_sqnr(recipe, gemm_name: str, request) -> None:
    name = request.node.callspec.params["recipe"]
    a, b, ref = _operands(recipe, gemm_name)
    out = core.gemm(a, b, torch.float32)
    got = sqnr(ref, out)
    print(f"SQNR {name} {gemm_name}: {got:.1f} dB")
    assert got > SQNR_MIN[name][gemm_name], f"{name} {gemm_name}: {got:.1f} dB"


def test_wrong_scale_layout_shows_as_low_sqnr() -> None:
    """Sanity of the metric: shuffled 1x128 scales (a layout bug) ruin the result. The input's
    rows span 2^-8..2^8, so its blocks' power-of-two scales differ (with i.i.d. rows most
    blocks share one scale, and a shuffle could leave the result nearly intact)."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.exp2(torch.randint(-8, 9, (M, 1), generator=gen).float())
    x = (torch.randn(M, K, generator=gen) * rows).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=gen) * 0.05).to(torch.bfloat16)
    recipe = RECIPES["block"]
    a = make_quantizer(recipe, TensorRole.INPUT).quantize(x).rowwise
    b = make_quantizer(recipe, TensorRole.WEIGHT).quantize(w).rowwise
    ref = x.float() @ w.float().t()
    good = sqnr(ref, core.gemm(a, b, torch.float32))
    flat = a.scale_inv.reshape(-1)
    shuffled = flat[torch.randperm(flat.numel(), generator=gen)].reshape(a.scale_inv.shape)
    assert not torch.equal(shuffled, a.scale_inv)
    bad = sqnr(ref, core.gemm(core.Operand(a.data, shuffled, a.layout), b, torch.float32))
    assert bad < good - 10, f"shuffled scales {bad:.1f} dB against {good:.1f} dB"


def test_backend_selection_on_cpu() -> None:
    cpu = torch.device("cpu")
    L = ScaleLayout
    assert core.select_backend(L.TENSOR, L.TENSOR, cpu) is core.Backend.EMULATE  # auto on CPU
    assert core.native_supported(L.TENSOR, L.TENSOR, cpu)
    assert not core.native_supported(L.BLOCK_1x128, L.BLOCK_128x128, cpu)
    with core.force_backend("native"):
        with pytest.raises(RuntimeError, match=r"native FP8 GEMM forced.*\(1x128, 128x128\)"):
            core.select_backend(L.BLOCK_1x128, L.BLOCK_128x128, cpu)


@pytest.mark.parametrize("gemm_name", GEMMS)
def test_cpu_native_tensorwise_agrees_with_emulation(gemm_name: str) -> None:
    a, b, _ = _operands(RECIPES["current"], gemm_name)
    with core.force_backend("emulate"):
        emu = core.gemm(a, b, torch.float32)
    with core.force_backend("native"), core.record_gemms() as calls:
        nat = core.gemm(a, b, torch.float32, name=gemm_name)
    mnk = (a.shape[0], b.shape[0], a.shape[1])
    assert calls == [core.GemmCall(gemm_name, core.Backend.NATIVE, (ScaleLayout.TENSOR,) * 2, mnk)]
    torch.testing.assert_close(nat, emu, rtol=1e-5, atol=1e-5 * emu.abs().max().item())


def test_mismatched_contraction_is_an_error() -> None:
    a, b, _ = _operands(RECIPES["current"], "fprop")
    with pytest.raises(ValueError, match="contraction dims differ"):
        core.gemm(a, core.Operand(b.data[:, :256], b.scale_inv, b.layout), torch.float32)


def test_env_backend_is_validated(monkeypatch) -> None:
    monkeypatch.setenv("MEGATRON_FP8_GEMM_BACKEND", "cublas")
    with pytest.raises(ValueError, match="MEGATRON_FP8_GEMM_BACKEND='cublas'"):
        core.select_backend(ScaleLayout.TENSOR, ScaleLayout.TENSOR, torch.device("cpu"))


def test_hybrid_gemm_choice_is_validated_and_cpu_never_served(monkeypatch) -> None:
    """``MEGATRON_FP8_HYBRID_GEMM`` names its values when wrong; CPU tensors never go to cuBLASLt
    (HYBRID block GEMMs are emulated there, the reference the GPU paths are tested against)."""
    from megatron_fp8.kernels import cublaslt
    from megatron_fp8.recipe import Float8BlockScaling, Format

    a, b, _ = _operands(Float8BlockScaling(fp8_format=Format.HYBRID), "dgrad")
    assert a.data.dtype == torch.float8_e5m2
    assert not cublaslt.serves(a.data, a.layout, b.data, b.layout, torch.bfloat16)
    with core.record_gemms() as calls:
        core.gemm(a, b, torch.bfloat16, name="dgrad")
    assert [(c.name, c.backend) for c in calls] == [("dgrad", core.Backend.EMULATE)]
    monkeypatch.setenv("MEGATRON_FP8_HYBRID_GEMM", "cublas")
    with pytest.raises(ValueError, match="MEGATRON_FP8_HYBRID_GEMM='cublas'.*'auto'.*'cublaslt'.*'triton'"):
        cublaslt.choice()


def test_tensor_gemm_choice_and_accumulate_on_cpu(monkeypatch) -> None:
    """``MEGATRON_FP8_TENSOR_GEMM`` names its values when wrong; on CPU no per-tensor GEMM goes to
    cuBLASLt, and ``accumulate`` declines (the caller computes the wgrad and adds it)."""
    from megatron_fp8.kernels import cublaslt
    from megatron_fp8.recipe import Float8CurrentScaling

    a, b, _ = _operands(Float8CurrentScaling(), "wgrad")
    assert not cublaslt.serves(a.data, a.layout, b.data, b.layout, torch.float32)
    into = torch.zeros(a.shape[0], b.shape[0])
    assert not core.accumulate(a, b, into) and not into.any()
    monkeypatch.setenv("MEGATRON_FP8_TENSOR_GEMM", "cublas")
    with pytest.raises(ValueError, match="MEGATRON_FP8_TENSOR_GEMM='cublas'.*'torch'.*'cublaslt'"):
        cublaslt.tensor_choice()


@pytest.mark.parametrize("splits", [[128, 0, 256, 128], [0, 0, 512, 0]], ids=["some-empty", "one-expert"])
def test_grouped_gemm_equals_per_expert_gemms(recipe, splits: list[int]) -> None:
    """Rowwise operands split by tokens (fprop shape), per-expert weights; zero-token experts."""
    qx = make_quantizer(recipe, TensorRole.INPUT)
    qw = make_quantizer(recipe, TensorRole.WEIGHT)
    x = torch.randn(sum(splits), K, dtype=torch.bfloat16)
    ws = [torch.randn(N, K, dtype=torch.bfloat16) for _ in splits]
    a_all = qx.quantize(x).rowwise
    a = gemm_grouped.split_rows(a_all, splits)
    b = [qw.quantize(w).rowwise for w in ws]
    outs = gemm_grouped.grouped_gemm(a, b, torch.bfloat16)
    for s, ai, bi, o in zip(splits, a, b, outs):
        assert o.shape == (s, N)
        assert torch.equal(o, core.gemm(ai, bi, torch.bfloat16))
    with pytest.raises(ValueError, match="sum to"):
        gemm_grouped.split_rows(a_all, [1, 2])


@pytest.mark.parametrize("backend", ["emulate", "native"])
def test_grouped_loop_writes_each_experts_rows(recipe, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-expert loop of ``grouped_gemm_cat`` writes each GEMM into its rows of one output
    (``gemm(..., out=)``): bitwise the concatenation of separate ``gemm`` calls, zero-token
    experts included, on CPU ``_scaled_mm.out`` where it runs and the emulation."""
    monkeypatch.setenv("MEGATRON_FP8_GROUPED_GEMM", "loop")
    splits, n, k = [128, 0, 48, 80], 128, 256  # small: CPU _scaled_mm is slow
    x_fp8 = make_quantizer(recipe, TensorRole.INPUT).quantize(torch.randn(sum(splits), k))
    a = gemm_grouped.split_rows(x_fp8.rowwise, splits)
    b = [make_quantizer(recipe, TensorRole.WEIGHT).quantize(torch.randn(n, k)).rowwise for _ in splits]
    if backend == "native" and not core.native_supported(a[0].layout, b[0].layout, torch.device("cpu")):
        pytest.skip(f"CPU torch has no native GEMM for {a[0].layout.value} operands")
    for dtype in (torch.float32, torch.bfloat16):
        with core.force_backend(backend), core.record_gemms() as calls:
            got = gemm_grouped.grouped_gemm_cat(a, b, dtype, name="fprop")
        assert {c.backend for c in calls} == {core.Backend(backend)} and len(calls) == len(splits)
        with core.force_backend(backend):
            want = torch.cat([core.gemm(ai, bi, dtype) for ai, bi in zip(a, b)])
        assert got.dtype == dtype and torch.equal(got, want)


def test_gemm_out_checked_and_misaligned_out_copied() -> None:
    """``out`` must be a contiguous ``[m, n]`` of the output dtype (else a ValueError naming the
    GEMM); an ``out`` whose address is under cuBLASLt's default 256-byte alignment is filled by
    a copy of a fresh result (same bits)."""
    q = make_quantizer(RECIPES["current"], TensorRole.INPUT)
    a, b = q.quantize(torch.randn(32, 64)).rowwise, q.quantize(torch.randn(16, 64)).rowwise
    for bad in (torch.empty(32, 17), torch.empty(32, 16, dtype=torch.bfloat16), torch.empty(16, 32).t()):
        with pytest.raises(ValueError, match=r"fprop: out must be a contiguous \[32, 16\]"):
            core.gemm(a, b, torch.float32, name="fprop", out=bad)
    with core.force_backend("native"):
        want = core.gemm(a, b, torch.float32)
        buf = torch.full((34 * 16,), float("nan"))
        skip = 16 if (buf.data_ptr() + 64) % 256 else 32  # 64 or 128 bytes in: not 256-aligned
        out = buf[skip:skip + 32 * 16].view(32, 16)
        assert out.data_ptr() % 256 and core.gemm(a, b, torch.float32, out=out) is out
    assert torch.equal(out, want) and buf[:skip].isnan().all() and buf[skip + 32 * 16:].isnan().all()


def test_megatron_launch_counts_each_gemm_by_its_kernel() -> None:
    """``launch --count-gemms`` tallies the kernel from a name's last bracket (an expert's index
    may come first), else the backend."""
    from megatron_fp8.megatron.launch import _kind

    pair, mnk = (ScaleLayout.BLOCK_1x128, ScaleLayout.BLOCK_128x128), (128, 128, 128)
    cases = {("wgrad[3][cublaslt]", core.Backend.NATIVE): "cublaslt", ("dgrad[triton]", core.Backend.NATIVE): "triton",
             ("fprop[3]", core.Backend.NATIVE): "native", ("fprop", core.Backend.EMULATE): "emulate"}
    assert {key: _kind(core.GemmCall(key[0], key[1], pair, mnk)) for key in cases} == cases


def test_cublaslt_structs_match_the_c_abi() -> None:
    """``cublasLtMatmulAlgo_t`` is 64 opaque bytes; ``cublasLtMatmulHeuristicResult_t`` is 96,
    its ``state`` (the cuBLAS status read to accept an answer) at byte 72: a drifted field would
    make the GPU path misread the heuristic's answer."""
    import ctypes

    from megatron_fp8.kernels import cublaslt

    assert ctypes.sizeof(cublaslt.Algo) == 64
    assert ctypes.sizeof(cublaslt.Heuristic) == 96 and cublaslt.Heuristic.state.offset == 72


def test_cublaslt_workspace_size_reads_torchs_variable(monkeypatch) -> None:
    """The direct cuBLASLt call offers the workspace torch's own ``scaled_mm`` offers:
    ``CUBLASLT_WORKSPACE_SIZE`` in KiB (0: none); anything else is an error naming it."""
    from megatron_fp8.kernels import cublaslt

    for value, want in (("0", 0), ("64", 65536), ("32768", 32 * 2**20)):
        monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", value)
        cublaslt.workspace_bytes.cache_clear()
        assert cublaslt.workspace_bytes(0) == want
    for bad in ("32M", "-1"):
        monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", bad)
        cublaslt.workspace_bytes.cache_clear()
        with pytest.raises(ValueError, match="CUBLASLT_WORKSPACE_SIZE"):
            cublaslt.workspace_bytes(0)
    cublaslt.workspace_bytes.cache_clear()


def test_nested_records_close_their_own_collection() -> None:
    """An inner ``record_gemms()`` (or ``count_paths()``) that closes while both collections are
    still empty, so equal, closes its own: the outer one keeps recording."""
    from megatron_fp8.ops import paths

    with core.record_gemms() as outer:
        with core.record_gemms():
            pass
        assert len(core._state.records) == 1 and core._state.records[0] is outer
    with paths.count_paths() as counts:
        with paths.count_paths():
            pass
        assert len(paths._open) == 1 and paths._open[0] is counts
