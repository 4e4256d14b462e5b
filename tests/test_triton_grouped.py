"""The draft grouped Triton GEMMs (megatron_fp8/triton_grouped.py) against the per-expert
emulated GEMMs: fprop, dgrad (rows) and wgrad (kgroup), tensorwise (HYBRID: E5M2 gradients)
and 1x128/128x128 blocks. Runs on CUDA, or on CPU under TRITON_INTERPRET=1 with Triton
installed; skips otherwise (CI has no Triton)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

triton = pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from megatron_fp8 import gemm as core  # noqa: E402
from megatron_fp8 import gemm_grouped  # noqa: E402
from megatron_fp8.kernels import triton_grouped as tg  # noqa: E402
from megatron_fp8.quant import kernels  # noqa: E402
from megatron_fp8.quant.quantizers import (  # noqa: E402
    Block1DQuantizer,
    Block2DQuantizer,
    CurrentScalingQuantizer,
)
from megatron_fp8.quant.tensor import Operands, Pack  # noqa: E402
from megatron_fp8.testing import same_bits  # noqa: E402

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SPLITS, K, N = [128, 0, 256, 128], 256, 384
QUANTIZERS = {
    "current": (CurrentScalingQuantizer(E4), CurrentScalingQuantizer(E4), CurrentScalingQuantizer(E5)),
    "block": (Block1DQuantizer(E4), Block2DQuantizer(E4), Block1DQuantizer(E4)),
}


# Norm-relative error bounds against the exact (FP32) per-expert products. Under the interpreter
# the dots are exact; on an H200 FP8 MMAs accumulate in reduced precision between promotions
# (measured 2026-12-02 at K=256: ~2e-4 fast). How "precise" compares with cuBLAS at a long K:
# test_accumulation_no_worse_than_cublas.
TOL = {False: 1e-3, True: 1e-3}


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [sum(SPLITS), K]``, the experts' weights stacked ``[E * N, K]`` and ``dy [sum(SPLITS), N]``."""
    torch.manual_seed(0)
    x = (torch.randn(sum(SPLITS), K) * 2).bfloat16().to(DEV)
    dy = (torch.randn(sum(SPLITS), N) * 0.01).bfloat16().to(DEV)
    w = (torch.randn(len(SPLITS) * N, K) * 0.05).bfloat16().to(DEV)
    return x, w, dy


def _norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("fast_accum", [False, True], ids=["precise", "fast"])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_grouped_triton_gemms_match_per_expert_emulation(name: str, fast_accum: bool) -> None:
    g = len(SPLITS)
    x, w, dy = _inputs()
    qx, qw, qg = QUANTIZERS[name]
    xs = qx.quantize_segments(x, SPLITS, peers=[qx] * g, rowwise=True, columnwise=True)
    ws = qw.quantize_segments(w, [N] * g, peers=[qw] * g, rowwise=True, columnwise=True)
    gs = qg.quantize_segments(dy, SPLITS, peers=[qg] * g, rowwise=True, columnwise=True)
    assert xs is not None and ws is not None and gs is not None
    off = kernels.segment_offsets(SPLITS, x.device)
    blocked = name == "block"
    m = sum(SPLITS)
    errs = []

    xr, wr = [q.rowwise for q in xs], [q.rowwise for q in ws]
    gr, wc = [q.rowwise for q in gs], [q.columnwise for q in ws]
    for a, b, k, n in ((xr, wr, K, N), (gr, wc, N, K)):  # fprop x @ w.T, dgrad dy @ w
        want = torch.cat([core.emulate(ai, bi, torch.float32) for ai, bi in zip(a, b)])
        got = tg.grouped_rows(a[0].data.as_strided((m, k), (k, 1)), b[0].data.as_strided((g, n, k), (n * k, k, 1)),
                              a[0].scale_inv, b[0].scale_inv, off, torch.float32, blocked=blocked,
                              fast_accum=fast_accum)
        errs.append(_norm_rel(got, want))

    dc, xc = [q.columnwise for q in gs], [q.columnwise for q in xs]
    want = torch.stack([core.emulate(a, b, torch.float32) if a.shape[1] else torch.zeros(N, K, device=DEV)
                        for a, b in zip(dc, xc)])
    got = tg.grouped_kgroup(dc[0].data, xc[0].data, dc[0].scale_inv, xc[0].scale_inv, off, N, K, torch.float32,
                            blocked=blocked, fast_accum=fast_accum)
    assert not got[1].any()  # the expert without tokens: zero wgrad
    errs.append(_norm_rel(got[[0, 2, 3]], want[[0, 2, 3]]))
    print(f"triton grouped {name} {'fast' if fast_accum else 'precise'}: fprop/dgrad/wgrad norm-rel errors "
          + " / ".join(f"{e:.2e}" for e in errs))
    assert max(errs) < TOL[fast_accum]
    if os.environ.get("TRITON_INTERPRET") != "1":  # the kept-kernel launches stayed on (API matched)
        assert tg._ROWS.fast and tg._KGROUP.fast and tg._ROWS.kernels and tg._KGROUP.kernels


@pytest.mark.parametrize("reversed_", [False, True], ids=["forward", "reversed"])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_kgroup_into_adds_as_a_separate_add(name: str, reversed_: bool) -> None:
    """``grouped_kgroup(into=...)``: each expert's FP32 wgrad added into its slot of an FP32
    buffer (expert order or reversed, as Megatron lays main_grads out) in the epilogue, bit for
    bit the product written out and added by torch afterwards. On a GPU this fails if the
    compiler contracts the per-tensor scaling multiply and the add into one FMA."""
    g = len(SPLITS)
    x, _, dy = _inputs()
    qx, _, qg = QUANTIZERS[name]
    xs = qx.quantize_segments(x, SPLITS, peers=[qx] * g, rowwise=False, columnwise=True)
    gs = qg.quantize_segments(dy, SPLITS, peers=[qg] * g, rowwise=False, columnwise=True)
    assert xs is not None and gs is not None
    off = kernels.segment_offsets(SPLITS, x.device)
    dc, xc = gs[0].columnwise, xs[0].columnwise
    args = (dc.data, xc.data, dc.scale_inv, xc.scale_inv, off, N, K, torch.float32)
    dw = tg.grouped_kgroup(*args, blocked=name == "block")
    torch.manual_seed(1)
    main = torch.randn(g, N, K, device=DEV) * 1e-3  # gradients of earlier micro-batches, FP32
    main[0, 0, :8] = -0.0
    want = main + (dw.flip(0) if reversed_ else dw)
    got = main.clone()
    assert tg.grouped_kgroup(*args, blocked=name == "block", into=(got, reversed_)) is got
    assert same_bits([got], [want])
    with pytest.raises(ValueError, match="contiguous FP32"):
        tg.grouped_kgroup(*args, blocked=name == "block", into=(got.bfloat16(), reversed_))


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_rows_keep_writes_only_the_real_rows(name: str) -> None:
    """``grouped_rows(keep=...)``: each expert's first real rows at its place in the unpadded output,
    bit for bit those of the padded output with its padding dropped afterwards (fprop and dgrad of
    router splits padded to 128, ``ops.grouped_linear``)."""
    g = len(SPLITS)
    x, w, _ = _inputs()
    qx, qw, _ = QUANTIZERS[name]
    xs = qx.quantize_segments(x, SPLITS, peers=[qx] * g, rowwise=True, columnwise=False)
    ws = qw.quantize_segments(w, [N] * g, peers=[qw] * g, rowwise=True, columnwise=False)
    assert xs is not None and ws is not None
    off = kernels.segment_offsets(SPLITS, x.device)
    real = [100, 0, 129, 1]  # at most each padded count; an expert without rows
    m = sum(SPLITS)
    a, b = xs[0].rowwise, ws[0].rowwise
    args = (a.data.as_strided((m, K), (K, 1)), b.data.as_strided((g, N, K), (N * K, K, 1)), a.scale_inv,
            b.scale_inv, off, torch.bfloat16)
    full = tg.grouped_rows(*args, blocked=name == "block")
    kept = tg.grouped_rows(*args, blocked=name == "block", keep=(kernels.segment_offsets(real, x.device), sum(real)))
    starts = itertools.accumulate(SPLITS, initial=0)
    want = torch.cat([full[s:s + r] for s, r in zip(starts, real)])
    assert kept.shape == (sum(real), N)
    assert torch.equal(kept, want)


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_packs_agree_with_the_per_expert_layout_checks(name: str) -> None:
    """A one-launch cast's Operands carry their Pack: ``Pack.of`` answers at once what the
    expert-by-expert checks (data back to back, scales where the grouped kernels read them)
    answer; a reordered or partial list is no pack; the lazily made Operand of one expert is the
    view ``operands()`` makes; a pack rebuilt from its two buffers (what backward gets from
    ``save_for_backward``) makes the same views."""
    g = len(SPLITS)
    x, w, dy = _inputs()
    qx, qw, qg = QUANTIZERS[name]
    cases = [(qx, x, SPLITS, ("rows", "tokens")), (qw, w, [N] * g, ("weights", "weights")),
             (qg, dy, SPLITS, ("rows", "tokens"))]
    for q, t, splits, kinds in cases:
        seg = q.quantize_segments_packed(t, splits, peers=[q] * g, rowwise=True, columnwise=True)
        assert seg is not None and seg.rows is not None and seg.cols is not None
        starts = list(itertools.accumulate(splits[:-1], initial=0))
        for pack, kind in zip((seg.rows, seg.cols), kinds):
            ops = pack.operands()
            width = {"rows": t.shape[1] // 128, "weights": 0, "tokens": t.shape[1]}[kind]
            assert Pack.of(ops) is pack and Pack.of(Operands(pack)) is pack and gemm_grouped._pack_serves(pack, kind)
            assert gemm_grouped.back_to_back([o.data for o in ops])
            assert gemm_grouped._scales_laid_out(ops, starts, kind, width)
            assert Pack.of(ops[::-1]) is None and Pack.of(ops[:-1]) is None
            rebuilt = Operands(Pack(pack.data.clone(), pack.scale_inv.clone(), pack.splits, pack.width,
                                    pack.layout, pack.columnwise))
            for i, op in enumerate(ops):
                one = Operands(pack)[i]
                for u, v in ((one.data, op.data), (one.scale_inv, op.scale_inv)):
                    assert (u.data_ptr(), u.shape, u.stride()) == (v.data_ptr(), v.shape, v.stride())
                for u, v in ((rebuilt[i].data, op.data), (rebuilt[i].scale_inv, op.scale_inv)):
                    assert u.shape == v.shape and u.stride() == v.stride()
                    assert same_bits([u], [v])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares with cuBLAS")
@pytest.mark.parametrize("fast_accum", [False, True], ids=["precise", "fast"])
def test_accumulation_no_worse_than_cublas(fast_accum: bool) -> None:
    """At K=8192 the accumulation mode shows: the grouped kernel's error against the exact product
    stays within 2x that of ``torch._scaled_mm`` per expert in the same mode (FP32 outputs)."""
    torch.manual_seed(1)
    splits, k, n = [256, 384], 8192, 256
    a = (torch.randn(sum(splits), k, device="cuda") * 40).clamp(-400, 400).to(E4)
    b = (torch.randn(len(splits), n, k, device="cuda") * 40).clamp(-400, 400).to(E4)
    sa = torch.rand(len(splits), 4, device="cuda") * 1e-3 + 1e-4  # one scale per expert, 16 bytes apart
    sb = torch.rand(len(splits), 4, device="cuda") * 1e-3 + 1e-4
    off = kernels.segment_offsets(splits, a.device)
    got = tg.grouped_rows(a, b, sa, sb, off, torch.float32, blocked=False, fast_accum=fast_accum)
    exact, cublas, start = [], [], 0
    for e, m_e in enumerate(splits):
        ae, be = a[start:start + m_e], b[e]
        exact.append((ae.double() @ be.double().t()) * (sa[e, 0].double() * sb[e, 0].double()))
        cublas.append(torch._scaled_mm(ae, be.t(), sa[e, 0], sb[e, 0], out_dtype=torch.float32,
                                       use_fast_accum=fast_accum))
        start += m_e
    want = torch.cat(exact)
    err_triton, err_cublas = _norm_rel(got, want), _norm_rel(torch.cat(cublas), want)
    print(f"K={k} {'fast' if fast_accum else 'precise'}: triton {err_triton:.2e}, cuBLAS {err_cublas:.2e}")
    assert err_triton <= 2 * err_cublas + 1e-7


@pytest.mark.parametrize("gemm_name", ["fprop", "dgrad", "wgrad"])
def test_hybrid_block_gemm_one_group_matches_emulation(gemm_name: str) -> None:
    """HYBRID block scaling (E5M2 gradients with 1x128 scales), which torch's scaled_mm refuses on
    SM90: ``gemm`` routes it to the grouped kernels with one group (``gemm._triton_blocks``)."""
    x, w, dy = _inputs()
    m, w = 256, w[:N]
    x, dy = x[:m], dy[:m]
    if gemm_name == "fprop":
        a = Block1DQuantizer(E4).quantize(x).rowwise
        b = Block2DQuantizer(E4).quantize(w).rowwise
    elif gemm_name == "dgrad":
        a = Block1DQuantizer(E5).quantize(dy).rowwise
        b = Block2DQuantizer(E4).quantize(w, rowwise=False, columnwise=True).columnwise
    else:
        a = Block1DQuantizer(E5).quantize(dy, rowwise=False, columnwise=True).columnwise
        b = Block1DQuantizer(E4).quantize(x, rowwise=False, columnwise=True).columnwise
    assert core._triton_serves(a, b)
    got = core._triton_blocks(a, b, torch.float32, fast_accum=False)
    want = core.emulate(a, b, torch.float32)
    assert got.shape == want.shape
    assert _norm_rel(got, want) < TOL[False]


def test_per_tensor_experts_padded_to_128_take_one_launch_per_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Router-like splits under current scaling: padded to 16 rows (cuBLAS's need) the experts'
    GEMMs run one per expert (and torch's grouped GEMM where SM90 has it); padded to 128 (the rule
    on CUDA) under MEGATRON_FP8_GROUPED_GEMM=triton fprop, dgrad and wgrad are one Triton launch
    each, with the same results within accumulation order."""
    import megatron_fp8 as mf
    from megatron_fp8.modules.grouped import GroupedLinear
    from megatron_fp8.ops.grouped_linear import grouped_linear, layout_rows
    from megatron_fp8.quant.formats import ScaleLayout
    from megatron_fp8.recipe import Float8CurrentScaling

    cuda = torch.device("cuda")
    assert layout_rows(ScaleLayout.TENSOR, cuda) == 128 and layout_rows(ScaleLayout.TENSOR) == 16
    monkeypatch.setenv("MEGATRON_FP8_GROUPED_GEMM", "loop")  # 128 whichever GEMM runs (the casts' aligned kernels)
    assert layout_rows(ScaleLayout.TENSOR, cuda) == 128 and layout_rows(ScaleLayout.BLOCK_1x128, cuda) == 128
    monkeypatch.setenv("MEGATRON_FP8_GROUPED_GEMM", "triton")
    splits = [100, 3, 250, 159]
    layer = GroupedLinear(len(splits), K, N, bias=False, params_dtype=torch.bfloat16, device=DEV)
    x = torch.randn(sum(splits), K, device=DEV).bfloat16()
    dy = torch.randn(sum(splits), N, device=DEV).bfloat16()
    runs = {}
    for pad_to in (16, 128):
        xi = x.clone().requires_grad_()
        with core.record_gemms() as calls:
            with mf.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
                qs, w_fp8 = layer.fp8_operands(None)
                y = grouped_linear(xi, layer.weights, None, splits, w_fp8=w_fp8, quantizers=qs, pad_to=pad_to)
            y.backward(dy)
        runs[pad_to] = (calls, [y.detach(), xi.grad, *(w.grad.clone() for w in layer.weights)])
        layer.zero_grad(set_to_none=True)
    assert sorted(c.name for c in runs[128][0]) == ["dgrad[triton]", "fprop[triton]", "wgrad[triton]"]
    assert not [c for c in runs[16][0] if "[triton]" in c.name]
    for a, b in zip(runs[16][1], runs[128][1]):
        assert (a.float() - b.float()).norm() <= 1e-2 * b.float().norm()
