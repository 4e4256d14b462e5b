"""The Triton casts keep NaN and +-inf as the reference does (RECIPES.md, "Non-finite values"):
planted NaN, +inf and -inf in BF16 inputs of every cast the kernels serve (given per-tensor
scales, current scaling, 1x128 and 128x128 blocks, and the experts' one-launch casts), E4M3 and
E5M2, against the reference path (the CPU's, or ``MEGATRON_FP8_CAST_BACKEND=eager``).

On a GPU every byte and scale is compared (``torch.equal``). Under Triton's interpreter
(``TRITON_INTERPRET=1``, how ``.ci/run`` runs it on a machine without a GPU) the FP8 conversion of
finite values is the interpreter's, not the hardware's, so there the bytes of the non-finite
values, every scale and the finiteness of everything else are compared. Skipped elsewhere (the
CPU path is the reference itself: ``tests/test_nonfinite.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from megatron_fp8.quant.quantizers import CurrentScalingQuantizer
from megatron_fp8.quant.tensor import Operand, QuantizedTensor

from . import test_nonfinite
from .test_nonfinite import E4, E5, QUANTIZERS, _planted

ON_GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton kernels: a GPU, or TRITON_INTERPRET=1 (see .ci/run)")
DEVICE = "cuda" if ON_GPU else "cpu"
KERNEL_CASTS = ("current", "1x128", "128x128")  # the quantizers whose casts the kernels serve


def _reference(monkeypatch: pytest.MonkeyPatch, run: Callable[[torch.Tensor], object], x: torch.Tensor) -> object:
    """``run`` on the reference path: on the CPU, with the eager backend (else, under the
    interpreter, the kernels would serve CPU tensors too)."""
    with monkeypatch.context() as m:
        m.setenv("MEGATRON_FP8_CAST_BACKEND", "eager")
        return run(x.cpu())


def _same_operand(got: Operand | None, want: Operand | None, bad: torch.Tensor) -> None:
    """Data bytes and scales of one copy; ``bad``: where its input was NaN or +-inf."""
    assert (got is None) == (want is None)
    if got is None or want is None:
        return
    g, w = got.data.cpu().view(torch.uint8), want.data.cpu().view(torch.uint8)
    assert torch.equal(got.scale_inv.cpu(), want.scale_inv.cpu()), "scales differ"
    assert g.shape == w.shape == bad.shape
    if ON_GPU:
        assert torch.equal(g, w)
    else:  # the interpreter's conversion of finite values is not the GPU's
        assert torch.equal(g[bad], w[bad]), "the bytes of NaN / inf differ from the reference's"
        assert torch.isfinite(got.data.cpu().float()[~bad]).all()


def _same(got: QuantizedTensor, want: QuantizedTensor, x: torch.Tensor) -> None:
    bad = ~torch.isfinite(x.cpu())
    _same_operand(got.rowwise, want.rowwise, bad)
    _same_operand(got.columnwise, want.columnwise, bad.t())
    if want.scale is not None:
        assert torch.equal(got.scale.cpu(), want.scale.cpu())


@pytest.mark.parametrize("dtype", [E4, E5], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("name", [*KERNEL_CASTS, "given scale"])
def test_casts_keep_nonfinite_bytes(name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    x, _ = _planted()
    if name == "given scale":  # delayed scaling's cast (and the flagged backward's): a scale in force
        def run(t: torch.Tensor) -> QuantizedTensor:
            s = torch.tensor(4.0, device=t.device)
            return CurrentScalingQuantizer(dtype).quantize(t, rowwise=True, columnwise=True, scale=s)
    else:
        def run(t: torch.Tensor) -> QuantizedTensor:
            return QUANTIZERS[name](dtype).quantize(t, rowwise=True, columnwise=True)
    got = run(x.to(DEVICE))
    want = _reference(monkeypatch, run, x)
    _same(got, want, x)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [E4, E5], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("name,splits", [("current", [100, 0, 156]), ("current", [128, 128]),
                                         ("1x128", [128, 0, 128]), ("128x128", [128, 128])])
def test_expert_casts_keep_nonfinite_bytes(name: str, splits: list[int], dtype: torch.dtype,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-launch cast of every expert's rows (or stacked weights, 128x128) against each
    segment cast alone by the reference."""
    x, _ = _planted()
    peers = [QUANTIZERS[name](dtype) for _ in splits]
    got = peers[0].quantize_segments(x.to(DEVICE), splits, peers=peers, rowwise=True, columnwise=True)
    assert got is not None, "the one-launch expert cast should serve this"
    for g, part in zip(got, x.split(splits)):
        if part.shape[0] == 0:
            continue
        want = _reference(monkeypatch, lambda t: QUANTIZERS[name](dtype).quantize(t, rowwise=True, columnwise=True),
                          part)
        _same(g, want, part)  # type: ignore[arg-type]


@pytest.mark.parametrize("algo,history", [("max", 4), ("most_recent", 4), ("max", 1)])
def test_delayed_state_in_kernels_equals_torch(algo: str, history: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delayed-scaling Linear whose steps advance in one launch per quantizer and whose amaxes
    fold into the history inside the amax launch keeps the bits of the torch ops (the eager
    backend), over steps with a NaN and an inf in x: every scale, inverse and history entry."""
    import megatron_fp8 as mf
    from megatron_fp8.recipe import DelayedScaling

    recipe = DelayedScaling(amax_history_len=history, margin=1, amax_compute_algo=algo)
    states = {}
    for backend in ("auto", "eager"):
        monkeypatch.setenv("MEGATRON_FP8_CAST_BACKEND", backend)
        torch.manual_seed(0)
        layer = mf.Linear(256, 128, bias=False, params_dtype=torch.bfloat16, device=DEVICE)
        seen = []
        for step in range(6):
            x = (torch.randn(128, 256, generator=torch.Generator().manual_seed(step)) * 2.0**step).to(torch.bfloat16)
            if step in (2, 4):
                x[5, 7] = float("nan") if step == 2 else float("inf")
            x = x.to(DEVICE).requires_grad_()
            with mf.fp8_autocast(fp8_recipe=recipe):
                y = layer(x)
                qs = layer.fp8_quantizers()
            y.backward(torch.ones_like(y))
            for q in (qs.input, qs.weight, qs.grad_output):
                _, inv = q._scale_for(torch.zeros(1, 1, device=DEVICE), record_amax=False)
                seen += [q.scale.clone().cpu(), inv.clone().cpu(), q.amax_history.clone().cpu()]
        states[backend] = seen
    for got, want in zip(*states.values(), strict=True):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_one_quantizers_step_equals_the_stacked_one(algo: str) -> None:
    """A lone quantizer's step (``kernels.delayed_state_alone``: its own launch, prepared at the
    first step and reused after, on the GPU) gives the bits of ``_advance_together`` of that one
    quantizer (the ``[1, L]`` launch), over histories holding NaN, +inf, zeros and ordinary
    amaxes; a copy leaves the prepared launch out and prepares its own; one quantizer's history
    is its own one-row stack (a grouped layer with one expert records into it in the kernel)."""
    import copy

    from megatron_fp8.quant.tensor_scaling import DelayedScalingQuantizer as Q
    from megatron_fp8.recipe import DelayedScaling

    recipe = DelayedScaling(amax_history_len=16, margin=1, amax_compute_algo=algo)
    alone, stacked = Q(E4, recipe, device=DEVICE), Q(E4, recipe, device=DEVICE)
    g = torch.Generator().manual_seed(3)
    first = None
    for step in range(1, 7):
        hist = torch.rand(16, generator=g) * 2.0**step
        if step in (2, 3, 5):  # a NaN newest, an inf inside, an all-zero history
            hist[{2: 0, 3: 9, 5: slice(None)}[step]] = {2: float("nan"), 3: float("inf"), 5: 0.0}[step]
        alone.amax_history, stacked.amax_history = hist.to(DEVICE), hist.to(DEVICE).clone()
        alone._advance_to(step)
        Q._advance_together([stacked], step)
        for got, want in ((alone.scale, stacked.scale), (alone._scale_inv(), stacked._scale_inv()),
                          (alone.amax_history, stacked.amax_history)):
            assert got.shape == want.shape and torch.equal(got.view(torch.int32), want.view(torch.int32)), step
        assert alone.step == stacked.step == step
        assert alone._row is None and stacked._row is not None  # the two paths, not one twice
        if ON_GPU:  # prepared at the first step, the same launch reused after
            first = first or alone._launch
            assert first is not None and alone._launch is first
        stacked.scale = alone.scale.clone()  # the next step starts from the same scale in both
    assert Q._stack_of([alone]) is not None and Q._stack_of([alone])[0].data_ptr() == alone.amax_history.data_ptr()
    twin = copy.deepcopy(alone)
    assert twin._launch is None
    twin._advance_to(7)
    alone._advance_to(7)
    if ON_GPU:
        assert twin._launch is not None and twin._launch is not alone._launch  # its own
    for got, want in ((twin.scale, alone.scale), (twin._scale_inv(), alone._scale_inv()),
                      (twin.amax_history, alone.amax_history)):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.skipif(not ON_GPU, reason="the GPU's delayed-scaling kernels")
@pytest.mark.parametrize("history", [8, 1])
def test_one_nan_step_recovers_on_the_gpu(history: int) -> None:
    """RECIPES.md on the GPU: a delayed-scaling run (BF16, the kernels' one-launch step) with one
    NaN step takes the twin run's scales again from the step after next (tests/test_nonfinite.py)."""
    test_nonfinite.test_one_nan_step_does_not_hold_the_delayed_scale(history, "cuda", torch.bfloat16)


@pytest.mark.parametrize("history", [4, 1])
def test_amax_folds_into_the_history_in_one_launch(history: int) -> None:
    """Delayed scaling's one-launch amax and fold (``triton_scale.fold_amax_into``, the lean
    route's) leaves every history entry as ``tensor_scaling.fold_amax`` of the reference amax,
    for finite inputs and ones with a NaN or an inf, over shapes of one program and of many
    (several K slices), call after call on the same atomic words, which end each launch zeroed."""
    from megatron_fp8.kernels import triton_scale
    from megatron_fp8.quant import reference
    from megatron_fp8.quant.tensor_scaling import fold_amax

    work = triton_scale.fold_work(torch.device(DEVICE))
    gen = torch.Generator().manual_seed(0)
    hist = torch.tensor([3.0, 5.0, 1.0, 0.5][:history])
    want = hist.clone()
    got = hist.to(DEVICE)
    for i, (m, k, bad) in enumerate([(7, 33, None), (300, 1030, None), (40, 600, "nan"), (17, 256, "inf"),
                                     (5, 4, None), (2048, 300, "-inf")]):
        x = (torch.randn(m, k, generator=gen) * 2.0 ** (i - 2)).to(torch.bfloat16)
        if bad is not None:
            x[m // 2, k // 3] = float(bad)
        fold_amax(want, reference.tensor_amax(x))
        triton_scale.fold_amax_into(x.to(DEVICE), got, work)
        assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32)), f"call {i} ({m}x{k}, {bad})"
        assert torch.equal(work.cpu(), torch.zeros(2, dtype=torch.int32)), "the atomic words were left dirty"
