"""Non-finite values surface, never vanish (RECIPES.md, "Non-finite values"; the hostile-input
issue's first two cases), on the CPU reference path:

* a cast keeps NaN as NaN and turns +-inf into NaN (E4M3) or +-inf (E5M2), with fixed bytes, in
  every recipe and both copies, while finite values still saturate (also where ``x * scale``
  overflows FP32);
* a block's scale comes from its finite values (1.0 if none); a per-tensor cast of a tensor with
  a non-finite amax uses scale 1.0 (current) or the scale in force (delayed);
* one inf or NaN in x, w or dy of a ``Linear`` makes exactly the outputs and gradients that high
  precision makes non-finite non-finite, every recipe, E4M3 and HYBRID, flag on == off;
* a non-finite amax never enters a delayed-scaling history: a run with one NaN step scales the
  steps after it as a run without it (the old rule held the scale for ``amax_history_len``
  steps), also with a history of length 1.

The Triton kernels (Triton's interpreter here, ``tests/test_nonfinite_kernels.py``), the CUDA
cast (``tests/test_cuda_cast_gpu.py``) and the TP amax reduction
(``dist_workers/hostile_worker.py``) are tested against the same bytes elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import megatron_fp8 as mf
from megatron_fp8.quant import reference as ref
from megatron_fp8.quant.quantizers import (
    Block1DQuantizer,
    Block2DQuantizer,
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    MXFP8Quantizer,
)
from megatron_fp8.recipe import DelayedScaling, Format
from megatron_fp8.testing import same_bits

from .conftest import RECIPES

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
NAN, INF = float("nan"), float("inf")
QUANTIZERS: dict[str, Callable[[torch.dtype], object]] = {
    "current": lambda d: CurrentScalingQuantizer(d),
    "delayed": lambda d: DelayedScalingQuantizer(d, DelayedScaling()),
    "1x128": lambda d: Block1DQuantizer(d),
    "128x128": lambda d: Block2DQuantizer(d),
    "mx": lambda d: MXFP8Quantizer(d),
}


def _planted() -> tuple[torch.Tensor, torch.Tensor]:
    """A BF16 ``[256, 256]`` tensor with NaN, +inf and -inf planted (one 128x128 block all NaN)
    and the same tensor with zeros in their place (zeros change no block's finite amax)."""
    x = (torch.randn(256, 256) * torch.logspace(-2, 2, 256).unsqueeze(1)).to(torch.bfloat16)
    x[3, 5], x[7, 200], x[130, 2], x[140, 140], x[255, 0] = NAN, INF, -INF, INF, -NAN
    x[128:, 128:] = NAN
    clean = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype))
    return x, clean


def _expected_bytes(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The contract's bytes, written out: E4M3 NaN (0x7F) for all three; E5M2 keeps +-inf."""
    if dtype == E4:
        return torch.full(x.shape, 0x7F, dtype=torch.uint8)
    return torch.where(torch.isnan(x), 0x7F, torch.where(x > 0, 0x7C, 0xFC)).to(torch.uint8)


@pytest.mark.parametrize("dtype", [E4, E5], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_casts_keep_nonfinite_values_and_scale_from_finite_ones(name: str, dtype: torch.dtype) -> None:
    x, clean = _planted()
    bad = ~torch.isfinite(x)
    got = QUANTIZERS[name](dtype).quantize(x, rowwise=True, columnwise=True)
    if name in ("current", "delayed"):  # a non-finite amax: scale 1.0 (current; delayed: the scale in force)
        want = QUANTIZERS["current"](dtype).quantize(clean, rowwise=True, columnwise=True, scale=torch.ones(()))
        assert torch.equal(got.scale, torch.ones(()))
    else:  # block scales from the finite values: those of the tensor with zeros for the specials
        want = QUANTIZERS[name](dtype).quantize(clean, rowwise=True, columnwise=True)
    for copy, mask in ((got.rowwise, bad), (got.columnwise, bad.t())):
        data = copy.data.view(torch.uint8)
        assert torch.equal(data[mask], _expected_bytes(x.t() if copy is got.columnwise else x, dtype)[mask])
    for g, w, mask in ((got.rowwise, want.rowwise, bad), (got.columnwise, want.columnwise, bad.t())):
        assert torch.equal(g.scale_inv, w.scale_inv)
        assert torch.equal(g.data.view(torch.uint8)[~mask], w.data.view(torch.uint8)[~mask])
    if name in ("1x128", "mx"):  # the all-NaN block of each row has scale 1.0
        unit = torch.ones(()) if name == "1x128" else torch.tensor(127, dtype=torch.uint8)
        assert (got.rowwise.scale_inv[128:, -1] == unit).all()


@pytest.mark.parametrize("dtype", [E4, E5], ids=["e4m3", "e5m2"])
def test_finite_values_saturate_even_where_the_scaled_value_overflows(dtype: torch.dtype) -> None:
    x = torch.tensor([3.0e38, -3.0e38, 1.0])
    got = ref.cast_to_fp8(x, torch.tensor(1.0e10), dtype).float()  # x * scale is +-inf in FP32
    m = ref.fp8_max(dtype)
    assert got.tolist() == [m, -m, m]


def _hp_masks(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    """Where high precision (FP64) gives non-finite out, dx and dw."""
    x, w, dy = x.double(), w.double(), dy.double()
    return [~torch.isfinite(t) for t in (x @ w.t(), dy @ w, dy.t() @ x)]


@pytest.mark.parametrize("where", ["x inf", "x nan", "w -inf", "dy inf", "dy nan"])
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID], ids=["e4m3", "hybrid"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_one_nonfinite_value_surfaces_where_high_precision_does(name: str, fmt: Format, where: str) -> None:
    recipe = type(RECIPES[name])(fp8_format=fmt)
    torch.manual_seed(0)
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    dy = torch.randn(128, 128, dtype=torch.bfloat16)
    tensor, kind = where.split()
    value = {"inf": INF, "-inf": -INF, "nan": NAN}[kind]
    runs = []
    for flag in (False, True):
        torch.manual_seed(1)
        layer = mf.Linear(256, 128, bias=True, params_dtype=torch.bfloat16, save_original_input=flag)
        xi, dyi = x.clone(), dy.clone()
        with torch.no_grad():
            {"x": xi, "w": layer.weight, "dy": dyi}[tensor][5, 17] = value
        xi.requires_grad_()
        with mf.fp8_autocast(fp8_recipe=recipe):
            out = layer(xi)
        out.backward(dyi)
        runs.append([out.detach(), xi.grad, layer.weight.grad])
        masks = _hp_masks(xi.detach(), layer.weight.detach(), dyi)
    for got, want, what in zip(runs[0], masks, ("out", "dx", "dw")):
        reaches = {"x": ("out", "dw"), "w": ("out", "dx"), "dy": ("dx", "dw")}[tensor]
        assert bool(want.any()) == (what in reaches)
        assert torch.equal(~torch.isfinite(got), want), f"{what}: non-finite where high precision is not "
    assert same_bits(runs[0], runs[1])  # save_original_input changes only what is saved


def _relative_errors(nan_step: int | None, history: int, device: str = "cpu",
                     dtype: torch.dtype = torch.float32) -> tuple[list[float], list[torch.Tensor]]:
    """A delayed-scaling Linear over 12 steps whose inputs grow 1.3x a step (margin 1 covers the
    one-step lag); with ``nan_step``, one NaN in that step's input. Per step: the relative error
    of the output's finite rows against FP32, and the input scale in force."""
    recipe = DelayedScaling(amax_history_len=history, margin=1)
    torch.manual_seed(0)
    layer = mf.Linear(256, 128, bias=False, params_dtype=dtype, device=device)
    errors, scales = [], []
    for step in range(12):
        x = (torch.randn(128, 256, generator=torch.Generator().manual_seed(step)) * 1.3**step).to(device, dtype)
        if step == nan_step:
            x[9, 3] = NAN
        with torch.no_grad(), mf.fp8_autocast(fp8_recipe=recipe):
            out = layer(x)
            q = layer.fp8_quantizers().input
            want = x @ layer.weight.t()
        rows = torch.isfinite(want).all(dim=1)
        errors.append(float((out[rows] - want[rows]).norm() / want[rows].norm()))
        scales.append(q.scale.clone())
        assert torch.isfinite(q.amax_history).all(), f"step {step}: a non-finite amax entered the history"
    return errors, scales


@pytest.mark.parametrize("history", [8, 1])
def test_one_nan_step_does_not_hold_the_delayed_scale(history: int, device: str = "cpu",
                                                      dtype: torch.dtype = torch.float32) -> None:
    """One NaN in one step's input: from the step after next on, the scales are those of a twin
    run without it (the NaN's amax never enters the history). Also run on the GPU's kernels
    (tests/test_nonfinite_kernels.py)."""
    twin, twin_scales = _relative_errors(None, history, device, dtype)
    hit, hit_scales = _relative_errors(3, history, device, dtype)
    assert max(twin) < 0.1
    # the NaN step records the step before's amax, so the next step's scale lags one step more
    # than the twin's; from then on the scales are the twin's (they follow the inputs)
    assert max(hit[4:]) < 0.1, f"after the NaN step the errors are {hit[4:]}"
    assert all(torch.equal(a, b) for a, b in zip(hit_scales[5:], twin_scales[5:]))
    assert not torch.equal(hit_scales[5], hit_scales[4])  # not held


@pytest.mark.parametrize("name", list(RECIPES))
def test_an_inf_in_one_experts_tokens_stays_in_that_expert(name: str) -> None:
    """GroupedLinear: an inf in one token of expert 1 makes that token's output row and expert 1's
    weight gradient non-finite, as in high precision; the other experts are untouched (their
    per-tensor scales are their own)."""
    from megatron_fp8.modules.grouped import GroupedLinear

    splits = [128, 256, 128]
    torch.manual_seed(0)
    layer = GroupedLinear(len(splits), 256, 128, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(sum(splits), 256, dtype=torch.bfloat16)
    x[200, 31] = INF  # token 72 of expert 1
    x.requires_grad_()
    with mf.fp8_autocast(fp8_recipe=RECIPES[name]):
        y = layer(x, splits)
    y.backward(torch.randn_like(y))
    bad_rows = (~torch.isfinite(y)).any(dim=1).nonzero().flatten().tolist()
    assert bad_rows == [200] and (~torch.isfinite(y[200])).all()
    assert torch.isfinite(x.grad).all()  # dx = dy w: no inf involved
    finite_w = [bool(torch.isfinite(w.grad).all()) for w in layer.weights]
    assert finite_w == [True, False, True]
    assert (~torch.isfinite(layer.weights[1].grad)).sum() == 128  # column 31 of expert 1's dw


def test_the_compiled_reference_keeps_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.compile`` of the reference (the GPU's path for options the kernels lack: MXFP8, an
    amax epsilon) sets the same non-finite bytes and scales as the eager reference (inductor's own
    FP8 conversion encodes NaN differently; the bytes are chosen after it). Forced on the CPU."""
    x, _ = _planted()
    for dtype in (E4, E5):
        got = []
        for backend in ("compile", "eager"):
            monkeypatch.setenv("MEGATRON_FP8_CAST_BACKEND", backend)
            got.append([t for name in ("1x128", "mx") for t in
                        QUANTIZERS[name](dtype).quantize(x, rowwise=True, columnwise=True).tensors()])
        assert same_bits(*got)
