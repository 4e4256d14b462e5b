"""Quantizers vs independent oracles (torchao casts, a per-block loop), and the cast rules.

Bitwise: FP8 data and scales against torchao where both define the same rounding. Documented
rule instead of torchao where they differ (torchao's MX default is the OCP FLOOR rule; ours is
the round-up rule that never overflows, which torchao calls RCEIL).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_fp8.quant import (
    Block1DQuantizer,
    Block2DQuantizer,
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    MXFP8Quantizer,
    ScaleLayout,
)
from megatron_fp8.quant.reference import e8m0_to_float
from megatron_fp8.recipe import DelayedScaling

torchao_utils = pytest.importorskip("torchao.float8.float8_utils")
mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
mx_config = pytest.importorskip("torchao.prototype.mx_formats.config")

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
HP = [torch.float32, torch.bfloat16]


def _data(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    # heavy-tailed rows so that per-row / per-block scales differ
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[0]).unsqueeze(1)
    return x.to(dtype)


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("hp", HP, ids=["fp32", "bf16"])
@pytest.mark.parametrize("pow2", [False, True], ids=["scale", "pow2"])
def test_tensorwise_matches_torchao_bitwise(fp8: torch.dtype, hp: torch.dtype, pow2: bool) -> None:
    x = torch.randn(256, 384, dtype=hp) * 3.7
    qt = CurrentScalingQuantizer(fp8, power_2_scale=pow2).quantize(x, rowwise=True, columnwise=True)
    ao_scale = torchao_utils.tensor_to_scale(x, fp8, round_scales_to_power_of_2=pow2)
    ao_data = torchao_utils.to_fp8_saturated(x.to(torch.float32) * ao_scale, fp8)
    assert torch.equal(qt.scale, ao_scale)
    assert torch.equal(qt.rowwise.data.view(torch.uint8), ao_data.view(torch.uint8))
    # per-tensor: the columnwise copy is the transposed rowwise one, same scale
    assert torch.equal(qt.columnwise.data.view(torch.uint8), ao_data.t().contiguous().view(torch.uint8))
    assert torch.equal(qt.rowwise.scale_inv, qt.columnwise.scale_inv)


@pytest.mark.parametrize("hp", HP, ids=["fp32", "bf16"])
def test_mx_matches_torchao_rceil_bitwise(hp: torch.dtype) -> None:
    x = _data((128, 256), hp)
    qt = MXFP8Quantizer(torch.float8_e4m3fn).quantize(x, rowwise=True, columnwise=True)
    rceil = mx_config.ScaleCalculationMode.RCEIL
    ao_e, ao_data = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=rceil)
    assert torch.equal(qt.rowwise.scale_inv, ao_e.view(torch.uint8).reshape(128, 256 // 32))
    assert torch.equal(qt.rowwise.data.view(torch.uint8), ao_data.view(torch.uint8))
    # columnwise = the same rule with blocks along dim 0 (torchao on the transposed tensor)
    ao_e_t, ao_data_t = mx_tensor.to_mx(x.t().contiguous(), torch.float8_e4m3fn, 32, scaling_mode=rceil)
    assert torch.equal(qt.columnwise.scale_inv, ao_e_t.view(torch.uint8).reshape(256, 128 // 32))
    assert torch.equal(qt.columnwise.data.view(torch.uint8), ao_data_t.view(torch.uint8))


def test_mx_differs_from_torchao_floor_and_keeps_its_rule() -> None:
    """torchao's default (OCP FLOOR) may map amax above 448 and saturate; ours never does."""
    x = _data((64, 256), torch.float32)
    qt = MXFP8Quantizer(torch.float8_e4m3fn).quantize(x)
    ao_e, _ = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32)  # FLOOR
    ours = qt.rowwise.scale_inv.int()
    assert (ours != ao_e.view(torch.uint8).reshape(ours.shape).int()).any(), "rules should differ"
    amax = x.reshape(64, 8, 32).abs().amax(-1)
    scale = e8m0_to_float(qt.rowwise.scale_inv)
    assert (amax / scale <= 448).all()  # no overflow
    assert (amax / (scale / 2) > 448).all()  # and the smallest such power of two


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
def test_block_1x128_matches_loop_oracle(fp8: torch.dtype) -> None:
    x = _data((128, 512), torch.bfloat16)
    qt = Block1DQuantizer(fp8).quantize(x, rowwise=True, columnwise=False)
    fmax = torch.finfo(fp8).max
    for r in range(0, 128, 17):
        for b in range(4):
            blk = x[r, b * 128:(b + 1) * 128].float()
            amax = blk.abs().max().item()
            scale = 2.0 ** math.floor(math.log2(fmax / amax))  # power of two, rounded down
            assert qt.rowwise.scale_inv[r, b].item() == 1.0 / scale
            ref = torch.clamp(blk * scale, -fmax, fmax).to(fp8)
            assert torch.equal(qt.rowwise.data[r, b * 128:(b + 1) * 128].view(torch.uint8), ref.view(torch.uint8))


def test_block_128x128_matches_loop_oracle() -> None:
    w = _data((256, 384), torch.float32)
    qt = Block2DQuantizer(torch.float8_e4m3fn).quantize(w, rowwise=True, columnwise=True)
    assert qt.rowwise.scale_inv.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale = 2.0 ** math.floor(math.log2(448.0 / blk.abs().max().item()))
            assert qt.rowwise.scale_inv[i, j].item() == 1.0 / scale
    # a 2-D block has one amax whichever dim is contracted: the columnwise copy is the transpose
    assert torch.equal(qt.columnwise.data.view(torch.uint8), qt.rowwise.data.t().contiguous().view(torch.uint8))
    assert torch.equal(qt.columnwise.scale_inv, qt.rowwise.scale_inv.t())


@pytest.mark.parametrize("make", [lambda: Block1DQuantizer(torch.float8_e4m3fn),
                                  lambda: MXFP8Quantizer(torch.float8_e4m3fn)], ids=["1x128", "mx1x32"])
def test_columnwise_copy_is_not_derivable_from_rowwise(make) -> None:
    q = make()
    x1 = _data((256, 256), torch.float32)
    q1 = q.quantize(x1, rowwise=True, columnwise=True)
    # scales run along different dims: rowwise [M, K/b], columnwise [K, M/b] (stored transposed)
    b = q.block
    assert q1.rowwise.scale_inv.shape == (256, 256 // b)
    assert q1.columnwise.scale_inv.shape == (256, 256 // b)
    assert q1.columnwise.data.shape == (256, 256)
    # Counterexample: x1 and x2 share their rowwise copy but not their columnwise one. x[0, 5]
    # is tiny next to its row block's outlier (subnormal once scaled rowwise, so a 10% change
    # rounds away) but ordinary within its column block (the change survives there).
    x0 = torch.randn(256, 256)
    x0[0, 6], x0[0, 5] = 1000.0, 0.01
    x1 = x0
    for _ in range(3):  # a fixed point of dequantize(quantize_rowwise(.))
        x1 = q.quantize(x1, rowwise=True).dequantize("rowwise", torch.float32)
    x2 = x1.clone()
    x2[0, 5] *= 1.1
    q1, q2 = (q.quantize(x, rowwise=True, columnwise=True) for x in (x1, x2))
    assert torch.equal(q2.rowwise.data.view(torch.uint8), q1.rowwise.data.view(torch.uint8))
    assert torch.equal(q2.rowwise.scale_inv, q1.rowwise.scale_inv)
    assert not torch.equal(q2.columnwise.data.view(torch.uint8), q1.columnwise.data.view(torch.uint8))


ALL = {
    "current": lambda: CurrentScalingQuantizer(torch.float8_e4m3fn),
    "delayed": lambda: DelayedScalingQuantizer(torch.float8_e4m3fn, DelayedScaling()),
    "1x128": lambda: Block1DQuantizer(torch.float8_e4m3fn),
    "128x128": lambda: Block2DQuantizer(torch.float8_e4m3fn),
    "mx": lambda: MXFP8Quantizer(torch.float8_e4m3fn),
}


@pytest.mark.parametrize("name", list(ALL))
def test_zero_tensor_and_zero_block_have_finite_unit_scale(name: str) -> None:
    x = torch.zeros(128, 256)
    x[:, 128:] = torch.randn(128, 128)  # first blocks all zero, the rest not
    qt = ALL[name]().quantize(torch.zeros(128, 256), rowwise=True, columnwise=True)
    for op in (qt.rowwise, qt.columnwise):
        s = op.scale_inv if op.layout is not ScaleLayout.MX_1x32 else e8m0_to_float(op.scale_inv)
        assert torch.isfinite(s).all() and (s == 1.0).all()
        assert (op.data.float() == 0).all()
    qt = ALL[name]().quantize(x, rowwise=True)
    s = qt.rowwise.scale_inv
    s = e8m0_to_float(s) if qt.rowwise.layout is ScaleLayout.MX_1x32 else s
    assert torch.isfinite(s).all()
    assert torch.equal(qt.dequantize("rowwise", torch.float32)[:, :128], torch.zeros(128, 128))


@pytest.mark.parametrize("name, shape, match", [
    ("1x128", (128, 200), r"features .*\(128, 200\) is 200.*multiple of the block size 128.*current"),
    ("1x128", (100, 256), r"tokens .*\(100, 256\) is 100.*multiple of the block size 128"),  # columnwise: along M
    ("128x128", (100, 256), r"\(100, 256\).*multiples of 128"),
    ("mx", (64, 48), r"\(64, 48\).*multiple of the block size 32"),
])
def test_indivisible_shapes_are_clear_errors(name: str, shape: tuple[int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ALL[name]().quantize(torch.randn(shape), rowwise=True, columnwise=True)


@pytest.mark.parametrize("name", list(ALL))
def test_unsupported_dtype_rejected(name: str) -> None:
    with pytest.raises(TypeError, match="dtype torch.int32"):
        ALL[name]().quantize(torch.ones(128, 256, dtype=torch.int32))
    with pytest.raises(ValueError, match="2-D"):
        ALL[name]().quantize(torch.ones(2, 128, 256))


def test_delayed_scaling_history_and_state_roundtrip() -> None:
    from megatron_fp8 import fp8_autocast

    q = DelayedScalingQuantizer(torch.float8_e4m3fn, DelayedScaling(amax_history_len=4, margin=1))
    amaxes = [2.0, 8.0, 1.0, 0.5, 0.25, 0.125]
    scales = []
    for a in amaxes:
        with fp8_autocast():
            x = torch.full((16, 16), a)
            qt = q.quantize(x)
            qt2 = q.quantize(x * 0.5)  # second cast in the same step: same scale
            assert torch.equal(qt.scale, qt2.scale)
            scales.append(qt.scale.item())
    assert scales[0] == 1.0  # empty history
    # step t uses max(history of the last 4 steps before t), margin 1
    for t in range(1, len(amaxes)):
        expect = 448.0 / max(amaxes[max(0, t - 4):t]) / 2
        assert scales[t] == pytest.approx(expect, rel=1e-7)
    state = q.state_dict()
    q2 = DelayedScalingQuantizer(torch.float8_e4m3fn, DelayedScaling(amax_history_len=4, margin=1))
    q2.load_state_dict(state)
    assert torch.equal(q2.amax_history, q.amax_history) and torch.equal(q2.scale, q.scale)
    with pytest.raises(ValueError, match="amax_history_len=8"):
        DelayedScalingQuantizer(torch.float8_e4m3fn, DelayedScaling(amax_history_len=8)).load_state_dict(state)


def test_delayed_most_recent() -> None:
    from megatron_fp8 import fp8_autocast

    q = DelayedScalingQuantizer(torch.float8_e4m3fn, DelayedScaling(amax_compute_algo="most_recent"))
    for a in (4.0, 1.0, 2.0):
        with fp8_autocast():
            s = q.quantize(torch.full((4, 4), a)).scale.item()
    assert s == pytest.approx(448.0 / 1.0)  # the newest past amax, not the max


def test_cast_clamp_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MEGATRON_FP8_CAST_CLAMP``: the GPU kernels' clamp before the FP8 conversion, off by
    default (the GPU's ``.satfinite`` conversion saturates), on on request, always on under the
    Triton interpreter, whose conversion is torch's on the CPU: that one turns E5M2 inf into inf
    (the reference gives FP8_MAX), so there the clamp is what makes the reference's bits."""
    from megatron_fp8.quant.formats import cast_clamp

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MEGATRON_FP8_CAST_CLAMP", raising=False)
    assert not cast_clamp()
    monkeypatch.setenv("MEGATRON_FP8_CAST_CLAMP", "1")
    assert cast_clamp()
    monkeypatch.setenv("MEGATRON_FP8_CAST_CLAMP", "0")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cast_clamp()
    monkeypatch.setenv("MEGATRON_FP8_CAST_CLAMP", "off")
    with pytest.raises(ValueError, match="MEGATRON_FP8_CAST_CLAMP='off'"):
        cast_clamp()
    big = torch.tensor([float("inf"), -1.0e6])
    assert torch.isinf(big.to(torch.float8_e5m2).float()).all()  # the CPU conversion alone
    m = torch.finfo(torch.float8_e5m2).max
    assert torch.equal(big.clamp(-m, m).to(torch.float8_e5m2).float(), torch.tensor([m, -m]))


def test_cuda_cast_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MEGATRON_FP8_CUDA_CURRENT`` (current scaling through the CUDA tile cast: by default
    only while a CUDA graph is captured, so not here; always with 1; never with 0 or with
    ``MEGATRON_FP8_CUDA_CAST=0``; anything else raises; so does anything but 0 or 1 for
    ``MEGATRON_FP8_CUDA_CAST``), and the CUDA cast never claims a CPU tensor."""
    from megatron_fp8.kernels import cuda_cast

    monkeypatch.delenv("MEGATRON_FP8_CUDA_CAST", raising=False)
    monkeypatch.delenv("MEGATRON_FP8_CUDA_CURRENT", raising=False)
    assert not cuda_cast.current_enabled()  # no capture in progress
    monkeypatch.setenv("MEGATRON_FP8_CUDA_CURRENT", "1")
    assert cuda_cast.current_enabled()
    monkeypatch.setenv("MEGATRON_FP8_CUDA_CAST", "0")
    assert not cuda_cast.current_enabled()
    monkeypatch.delenv("MEGATRON_FP8_CUDA_CAST")
    monkeypatch.setenv("MEGATRON_FP8_CUDA_CURRENT", "0")
    assert not cuda_cast.current_enabled()
    monkeypatch.setenv("MEGATRON_FP8_CUDA_CURRENT", "yes")
    with pytest.raises(ValueError, match="MEGATRON_FP8_CUDA_CURRENT='yes'"):
        cuda_cast.current_enabled()
    monkeypatch.setenv("MEGATRON_FP8_CUDA_CAST", "off")
    with pytest.raises(ValueError, match="MEGATRON_FP8_CUDA_CAST='off'"):
        cuda_cast.enabled()
    monkeypatch.delenv("MEGATRON_FP8_CUDA_CAST")
    x = torch.zeros(256, 256, dtype=torch.bfloat16)
    assert not any(cuda_cast.serves(x, torch.float8_e4m3fn, mode, True, True, True)
                   for mode in ("1x128", "128x128", "tensor"))
