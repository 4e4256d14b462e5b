"""FP8 GroupedLinear: bitwise a list of separate Linears, flag-neutral, exact saved bytes, errors.

Bitwise (torch.equal), per recipe, over two FP8 steps (delayed: the second uses the history):
out, dx, dw, db of ``GroupedLinear`` vs one ``megatron_fp8.Linear`` per expert with the same
weights, for splits with zero-size experts, and ``save_original_input`` on == off.

Block recipes with an expert whose token count is not a multiple of the block (128 / 32): the
layer pads that expert's columnwise copies with zero rows. The reference for such an expert is
two Linear passes: out and dx on the real tokens (no wgrad: nothing columnwise is cast), dw on
the tokens and dy zero-padded to the block (the zero rows add exact zeros to the wgrad sum).
"""

from __future__ import annotations

import contextlib
import itertools
import os

import pytest
import torch
import torch.nn.functional as F

import megatron_fp8 as mf
from megatron_fp8.modules.grouped import GroupedLinear
from megatron_fp8.quant import kernels
from megatron_fp8.recipe import DelayedScaling, Float8BlockScaling, Format

from .conftest import RECIPES

K, N = 256, 384
MULTIPLE = {"delayed": 1, "current": 1, "block": 128, "block-hybrid": 128, "mxfp8": 32}
# the recipes, and block scaling under Megatron's usual --fp8-format hybrid (E5M2 gradients)
GROUPED_RECIPES = {**RECIPES, "block-hybrid": Float8BlockScaling(fp8_format=Format.HYBRID)}
SPLITS = {  # in units of the recipe's block (x1 for per-tensor recipes: arbitrary counts)
    "aligned": lambda b: [2 * b, 0, b, 3 * b],
    "ragged": lambda b: [b + 37, 0, 0, 2 * b + 5, 19],
}


def _splits(name: str, recipe: str) -> list[int]:
    b = MULTIPLE[recipe]
    return SPLITS[name](b if b > 1 else 64)


def _layers(n: int, bias: bool, flag: bool) -> tuple[GroupedLinear, list[mf.Linear]]:
    torch.manual_seed(0)
    grouped = GroupedLinear(n, K, N, bias=bias, params_dtype=torch.bfloat16, save_original_input=flag)
    with torch.no_grad():
        for b in grouped.biases or []:
            b.normal_()
    refs = []
    for i in range(n):
        ref = mf.Linear(K, N, bias=bias, params_dtype=torch.bfloat16)
        ref.load_state_dict({"weight": grouped.weights[i], **({"bias": grouped.biases[i]} if bias else {})},
                            strict=False)
        refs.append(ref)
    return grouped, refs


def _data(splits: list[int], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    m = sum(splits)
    x = (torch.randn(m, K, generator=g) * (step + 1)).to(torch.bfloat16)
    dy = torch.randn(m, N, generator=g).to(torch.bfloat16)
    return x, dy


def _run_grouped(layer: GroupedLinear, splits: list[int], recipe, steps: int) -> list[list[torch.Tensor]]:
    out = []
    for step in range(steps):
        layer.zero_grad(set_to_none=True)
        x, dy = _data(splits, step)
        x.requires_grad_()
        with mf.fp8_autocast(fp8_recipe=recipe):
            y = layer(x, splits)
        y.backward(dy)
        grads = [layer.weights[i].grad for i in range(layer.num_gemms)]
        grads += [b.grad for b in layer.biases or []]
        out.append([y, x.grad, *grads])
    return out


def _ref_expert(ref: mf.Linear, x: torch.Tensor, dy: torch.Tensor, recipe, multiple: int) -> tuple:
    """out, dx, dw, db of one expert's Linear (two passes when its count needs padding)."""
    ref.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    pad = (-x.shape[0]) % multiple
    if pad:  # real tokens: only rowwise casts (the flag is bitwise-neutral, test_linear.py), no wgrad
        ref.weight.requires_grad_(False)
        ref.save_original_input = True
    with mf.fp8_autocast(fp8_recipe=recipe):
        y = ref(xi)
    y.backward(dy)
    db = ref.bias.grad.clone() if ref.bias is not None else None
    if pad:
        ref.weight.requires_grad_(True)
        ref.save_original_input = False
        xp = F.pad(x, (0, 0, 0, pad)).requires_grad_()
        with mf.fp8_autocast(fp8_recipe=recipe):
            yp = ref(xp)
        yp.backward(F.pad(dy, (0, 0, 0, pad)))
    return y, xi.grad, ref.weight.grad, db


def _run_refs(refs: list[mf.Linear], splits: list[int], recipe, steps: int, multiple: int) -> list[list]:
    out = []
    for step in range(steps):
        x, dy = _data(splits, step)
        per = [_ref_expert(r, xi, di, recipe, multiple)
               for r, xi, di in zip(refs, x.split(splits), dy.split(splits))]
        ys, dxs, dws, dbs = zip(*per)
        out.append([torch.cat(ys), torch.cat(dxs), *dws, *(d for d in dbs if d is not None)])
    return out


@pytest.mark.parametrize("case", ["aligned", "ragged"])
@pytest.mark.parametrize("name", list(GROUPED_RECIPES))
def test_grouped_equals_separate_linears_and_flag_is_neutral(name: str, case: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # the per-expert GEMM family (emulated here, cuBLAS on a GPU) is what equals separate Linears bit
    # for bit; the one-launch Triton kernels (a GPU, or TRITON_INTERPRET) are only close to it
    monkeypatch.setenv("MEGATRON_FP8_GROUPED_GEMM", "torch")
    recipe, splits = GROUPED_RECIPES[name], _splits(case, name)
    bias = case == "ragged"
    results = {}
    for flag in (False, True):
        grouped, refs = _layers(len(splits), bias, flag)
        results[flag] = _run_grouped(grouped, splits, recipe, steps=2)
    _, refs = _layers(len(splits), bias, False)
    want = _run_refs(refs, splits, recipe, steps=2, multiple=MULTIPLE[name])
    for step in range(2):
        for j, (off, on, ref) in enumerate(zip(results[False][step], results[True][step], want[step])):
            assert torch.equal(off, ref), f"{name} step {step}: tensor {j} differs from the separate Linears"
            assert torch.equal(on, off), f"{name} step {step}: tensor {j} differs with save_original_input"
    zero = [i for i, m in enumerate(splits) if m == 0]
    assert zero and all(not results[False][1][2 + i].any() for i in zero)  # no tokens: zero wgrad


_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("flag", [False, True], ids=["flag-off", "flag-on"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_copying_saved_tensor_hooks_change_nothing(name: str, flag: bool, device: str) -> None:
    """Saved tensors that come back as fresh contiguous copies (what CPU offload of activations
    does) give the same bits as the tensors kept in place: also the experts' per-tensor scales,
    saved as one buffer 16 bytes apart and packed together by the copy (cuBLAS needs each GEMM
    scale pointer 16-byte aligned again)."""
    recipe, splits = RECIPES[name], [256, 512, 0, 128]
    x = torch.randn(sum(splits), K, dtype=torch.bfloat16, device=device)
    dy = torch.randn(sum(splits), N, dtype=torch.bfloat16, device=device)

    def run(hooks: bool) -> list[torch.Tensor]:  # a fresh layer each time (delayed scaling keeps state)
        torch.manual_seed(0)
        layer = GroupedLinear(len(splits), K, N, bias=False, params_dtype=torch.bfloat16, save_original_input=flag,
                              device=device)
        xi = x.clone().requires_grad_()
        def fresh_copy(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)

        ctx = (torch.autograd.graph.saved_tensors_hooks(fresh_copy, lambda t: t) if hooks
               else contextlib.nullcontext())
        with ctx, mf.fp8_autocast(fp8_recipe=recipe):
            y = layer(xi, splits)
        y.backward(dy)
        return [y, xi.grad, *(w.grad for w in layer.weights)]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", [n for n in RECIPES if n != "delayed"])  # delayed: x's scale moves per call
def test_weight_cache_follows_is_first_microbatch(name: str) -> None:
    """Megatron's micro-batch convention on the grouped layer: the experts' FP8 weights cast with
    ``is_first_microbatch=True`` are reused while it is False (an in-place weight change is not
    seen), recast when it is True again, and not kept when it is None."""
    recipe, splits = RECIPES[name], [256, 0, 128]
    torch.manual_seed(0)
    layer = GroupedLinear(len(splits), K, N, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(sum(splits), K, dtype=torch.bfloat16)

    def run(first: bool | None) -> torch.Tensor:
        with torch.no_grad(), mf.fp8_autocast(fp8_recipe=recipe):
            return layer(x, splits, is_first_microbatch=first)

    y0 = run(True)
    assert layer._w_cache
    with torch.no_grad():
        for w in layer.weights:
            w.mul_(2)
    assert torch.equal(run(False), y0)  # the cached cast
    y2 = run(True)
    assert not torch.equal(y2, y0)  # cast again from the changed weights
    assert torch.equal(run(False), y2)
    run(None)
    assert not layer._w_cache


@pytest.mark.parametrize("name", ["current", "block"])
def test_one_launch_casts_save_two_tensors_per_operand(name: str) -> None:
    """Where the experts' casts run in one launch (CUDA, or Triton's interpreter), the layer saves
    each FP8 operand's pack, a data and a scale buffer (x's columnwise copy, the weights'
    columnwise copy): 4 tensors whatever the expert count; elsewhere 2 per expert and operand."""
    splits = [256, 0, 128, 384, 128, 256]
    x = torch.randn(sum(splits), K, dtype=torch.bfloat16, requires_grad=True)
    layer = GroupedLinear(len(splits), K, N, bias=False, params_dtype=torch.bfloat16)
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), mf.fp8_autocast(fp8_recipe=RECIPES[name]):
        layer(x, splits)
    packed = kernels.segments_fused(x, True)
    assert len(saved) == (4 if packed else 4 * len(splits))


def test_unstash_realigns_copied_tensorwise_scales() -> None:
    """A pack's per-expert scales handed back packed together (by a copying saved-tensor hook)
    are laid out 16 bytes apart again: each expert's scale pointer 16-byte aligned, values kept."""
    from megatron_fp8.ops.grouped_linear import _unstash
    from megatron_fp8.quant.formats import ScaleLayout

    splits, k = (128, 0, 256), 64
    data = torch.zeros(sum(splits) * k, dtype=torch.float8_e4m3fn)
    scale = torch.tensor([0.5, 2.0, 4.0])  # contiguous: 4 bytes apart
    ops = _unstash([data, scale], (splits, k, ScaleLayout.TENSOR, True))
    assert [o.scale_inv.item() for o in ops] == [0.5, 2.0, 4.0]
    assert all(o.scale_inv.data_ptr() % 16 == 0 for o in ops)
    assert [tuple(o.shape) for o in ops] == [(k, m) for m in splits]
    assert ops[-1].slot == 2
    for bad in (3, -4):
        with pytest.raises(IndexError):
            ops[bad]


@pytest.mark.parametrize("packed", [True, False], ids=["grouped_mm", "loop"])
def test_fp8_off_equals_separate_linears(packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 off: with the experts' weights in one buffer (as built) the three GEMMs are one
    ``torch._grouped_mm`` each; with weights apart (a ``.to()`` or DDP may re-allocate them)
    an expert loop. Either way bit for bit separate ``Linear``s on the CPU."""
    calls: list[int] = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    splits = [100, 0, 28]
    grouped, refs = _layers(3, True, False)
    if not packed:
        for w in grouped.weights:
            w.data = w.data.clone()
    x, dy = _data(splits, 0)
    x.requires_grad_()
    grouped(x, splits).backward(dy)
    assert len(calls) == (3 if packed else 0)
    for i, (r, xi, di) in enumerate(zip(refs, x.split(splits), dy.split(splits))):
        xr = xi.detach().clone().requires_grad_()
        yr = r(xr)
        yr.backward(di)
        assert torch.equal(grouped.weights[i].grad, r.weight.grad)
        assert torch.equal(grouped.biases[i].grad, r.bias.grad)
        assert torch.equal(x.grad.split(splits)[i], xr.grad)


def test_token_multiple_of_the_input_layout_per_recipe() -> None:
    layer = GroupedLinear(2, K, N, bias=False)
    for name, want in MULTIPLE.items():
        with mf.fp8_autocast(fp8_recipe=GROUPED_RECIPES[name]):
            qs, _ = layer.fp8_operands(None)
        assert qs[0].input.layout.token_multiple == want


# ---- saved bytes: exact counts from shapes ----------------------------------------------------
def _col_scale_bytes(name: str, m_pad: int) -> int:
    return {"delayed": 4, "current": 4, "block": K * (m_pad // 128) * 4, "mxfp8": K * (m_pad // 32)}[name]


@pytest.mark.parametrize("name", list(RECIPES))
def test_saved_bytes_exact(name: str) -> None:
    recipe, splits = RECIPES[name], _splits("ragged", name)
    x = torch.randn(sum(splits), K, dtype=torch.bfloat16, requires_grad=True)
    got = {}
    for flag in (False, True):
        layer = GroupedLinear(len(splits), K, N, bias=False, params_dtype=torch.bfloat16,
                                 save_original_input=flag)
        with mf.memory.track_saved_tensors() as saved, mf.fp8_autocast(fp8_recipe=recipe):
            layer(x, splits)
        got[flag] = saved
    mult = MULTIPLE[name]
    padded = [m + (-m) % mult for m in splits]
    per_tensor = name in ("delayed", "current")
    # a one-launch expert cast (per-tensor recipes, CUDA or Triton's interpreter) keeps the experts'
    # scales 16 bytes apart in one buffer (cuBLAS alignment): 16 bytes per expert instead of 4, but
    # the last one's 4 (``quant.tensor.aligned_scalars``)
    apart = per_tensor and kernels.segments_fused(x, True)
    scales_total = (16 * (len(splits) - 1) + 4) if apart else 4 * len(splits)
    # default: each expert's (padded) columnwise FP8 copy of its tokens and its scales
    assert got[False].activation_bytes == sum(m * K for m in padded) + (
        scales_total if per_tensor else sum(_col_scale_bytes(name, m) for m in padded))
    # flagged: the original x once, plus each expert's per-tensor scale (the one-launch cast's
    # aligned buffer; for delayed scaling the quantizers' own scales, which the one-launch state
    # update lays out the same way)
    assert got[True].activation_bytes == x.untyped_storage().nbytes() + (scales_total if per_tensor else 0)
    assert got[False].parameter_bytes == got[True].parameter_bytes > 0


@pytest.mark.parametrize("name", list(RECIPES))
def test_no_wgrad_saves_no_input_copy(name: str) -> None:
    """Frozen experts: x's columnwise copies serve only wgrad, so none is cast or saved; dx still
    flows (and equals the trainable layer's)."""
    recipe, splits = RECIPES[name], _splits("aligned", name)
    x = torch.randn(sum(splits), K, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(sum(splits), N, dtype=torch.bfloat16)
    dxs = []
    for frozen in (False, True):
        torch.manual_seed(0)
        layer = GroupedLinear(len(splits), K, N, bias=False, params_dtype=torch.bfloat16)
        layer.requires_grad_(not frozen)
        with mf.memory.track_saved_tensors() as saved, mf.fp8_autocast(fp8_recipe=recipe):
            y = layer(x, splits)
        (dx,) = torch.autograd.grad(y, x, dy)
        dxs.append(dx)
        if frozen:
            assert saved.activation_bytes == 0
    assert torch.equal(dxs[0], dxs[1])


# ---- state, options -------------------------------------------------------------------------
def test_per_expert_delayed_history_roundtrips_through_state_dict() -> None:
    recipe = DelayedScaling(amax_history_len=8)
    splits = [64, 0, 192]
    layer, _ = _layers(3, True, False)
    for step in range(3):
        x, dy = _data(splits, step)
        with mf.fp8_autocast(fp8_recipe=recipe):
            layer(x.requires_grad_(), splits).backward(dy)
    fresh, _ = _layers(3, True, False)
    fresh.load_state_dict(layer.state_dict())
    x, _ = _data(splits, 5)
    with mf.fp8_autocast(fp8_recipe=recipe):
        assert torch.equal(layer(x, splits), fresh(x, splits))
    hist = [layer._quantizers[f"weight{i}"].input.amax_history for i in range(3)]
    assert not torch.equal(hist[0], hist[2])  # each expert keeps its own history
    for i in range(3):
        assert torch.equal(fresh._quantizers[f"weight{i}"].input.amax_history, hist[i])


@pytest.mark.parametrize("name", ["current", "block"])
def test_fused_main_grad_accumulates_per_expert(name: str) -> None:
    """FP32 weights: the fused FP32 accumulation is bitwise the sum of the unfused wgrads."""
    splits = [128, 256]

    def make(fuse: bool) -> GroupedLinear:
        torch.manual_seed(0)
        return GroupedLinear(2, K, N, bias=False, params_dtype=torch.float32, fuse_wgrad_accumulation=fuse)

    layer, plain = make(True), make(False)
    for w in layer.weights:
        w.main_grad = torch.zeros_like(w)
    for step in range(2):  # two micro-batches
        x, dy = _data(splits, step)
        with mf.fp8_autocast(fp8_recipe=RECIPES[name]):
            layer(x.float(), splits).backward(dy.float())
            plain(x.float(), splits).backward(dy.float())
    for w, p in zip(layer.weights, plain.weights):
        assert w.main_grad.abs().sum() > 0 and torch.equal(w.main_grad, p.grad)
    with pytest.raises(RuntimeError, match="main_grad on every expert weight"):
        make(True)(torch.randn(4, K), [2, 2])


@pytest.mark.parametrize("recipe", [None, "current", "block"])
@pytest.mark.parametrize("order", ["forward", "reversed"])
def test_fused_main_grads_in_one_buffer_take_one_add(order: str, recipe: str | None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts' main_grads back to back in one buffer (in expert order, or reversed as Megatron's
    gradient buffers lay parameters out) get the grouped wgrad in one add where it is one [E, N, K]
    buffer (FP8 off: torch._grouped_mm's; FP8: the Triton grouped wgrad's, here under Triton's
    interpreter): the same bits as one add an expert into separate main_grads."""
    from megatron_fp8.ops import grouped_linear as ops

    splits = [128, 0, 256]

    def make(buffer: bool) -> GroupedLinear:
        torch.manual_seed(0)
        layer = GroupedLinear(3, K, N, bias=False, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
        flat = torch.zeros(3, N, K)
        for i, w in enumerate(layer.weights):
            w.main_grad = flat[i if order == "forward" else 2 - i] if buffer else torch.zeros(N, K)
        return layer

    per_expert = []
    real = ops._accumulate_wgrad
    monkeypatch.setattr(ops, "_accumulate_wgrad", lambda w, d: per_expert.append(w) or real(w, d))
    fused, separate = make(True), make(False)
    region = (lambda: mf.fp8_autocast(fp8_recipe=RECIPES[recipe])) if recipe else contextlib.nullcontext
    for step in range(2):
        x, dy = _data(splits, step)
        with region():
            fused(x, splits).backward(dy)
    one_buffer = recipe is None or os.environ.get("TRITON_INTERPRET") == "1"  # else one wgrad an expert
    assert not per_expert if one_buffer else len(per_expert) == 6
    monkeypatch.undo()
    for step in range(2):
        x, dy = _data(splits, step)
        with region():
            separate(x, splits).backward(dy)
    for a, b in zip(fused.weights, separate.weights):
        assert torch.equal(a.main_grad, b.main_grad)
    assert fused.weights[0].main_grad.abs().sum() > 0 and not fused.weights[1].main_grad.any()


@pytest.mark.parametrize("zero_out", [False, True])
def test_fused_dummy_grads_are_views_of_one_buffer(zero_out: bool) -> None:
    """Where Megatron tracks ``grad_added_to_main_grad``, a fused grouped backward sets it on every
    expert and hands autograd dummy grads that are views of one allocation (zeros where
    ``zero_out_wgrad`` asks), kept by autograd as the weights' ``.grad``; the adds are unchanged."""
    torch.manual_seed(0)
    layer = GroupedLinear(3, K, N, bias=False, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
    flat = torch.zeros(3, N, K)
    for i, w in enumerate(layer.weights):
        w.main_grad = flat[i]
        w.grad_added_to_main_grad = False
        w.zero_out_wgrad = zero_out
    x, dy = _data([128, 0, 256], 0)
    layer(x, [128, 0, 256]).backward(dy)
    grads = [w.grad for w in layer.weights]
    assert all(w.grad_added_to_main_grad for w in layer.weights)
    assert all(g is not None and g.shape == (N, K) and g.dtype == torch.bfloat16 for g in grads)
    assert len({g.untyped_storage().data_ptr() for g in grads}) == 1
    assert not zero_out or not any(g.any() for g in grads)
    assert flat[0].abs().sum() > 0 and not flat[1].any()


def test_skip_bias_add_returns_every_bias_and_repr_shows_flag() -> None:
    layer = GroupedLinear(2, K, N, skip_bias_add=True, save_original_input=True)
    y, biases = layer(torch.randn(10, K), [3, 7])
    assert y.shape == (10, N) and biases == [layer.bias0, layer.bias1]
    assert "save_original_input=True" in repr(layer) and "num_gemms=2" in repr(layer)
    assert [n for n, _ in layer.named_parameters()] == ["weight0", "bias0", "weight1", "bias1"]


# ---- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("splits", "match"),
    [
        ([5, 5], r"m_splits has 2 entries, but the layer has 3 experts"),
        ([5, 5, 5], r"m_splits \[5, 5, 5\] sum to 15, but the input has 12 tokens"),
        ([14, -2, 0], r"m_splits\[1\]=-2; token counts must be non-negative"),
        ([6, 6.0, 0], r"m_splits\[1\]=6.0"),
    ],
)
def test_bad_m_splits_name_the_layer_and_the_fix(splits: list, match: str) -> None:
    layer = GroupedLinear(3, K, N, name="experts.fc1")
    with pytest.raises(ValueError, match=r"GroupedLinear\(experts.fc1\): " + match):
        layer(torch.randn(12, K), splits)


def test_tensor_m_splits_and_feature_mismatch() -> None:
    layer = GroupedLinear(2, K, N)
    assert layer(torch.randn(12, K), torch.tensor([4, 8])).shape == (12, N)
    with pytest.raises(ValueError, match="input has 100 features"):
        layer(torch.randn(12, 100), [4, 8])
    with pytest.raises(ValueError, match="at least one expert"):
        GroupedLinear(0, K, N)


def test_expert_weights_packed_in_one_buffer() -> None:
    """The experts' weights are views of one buffer (one cast launch, no stacking copy); after
    ``.to()`` re-allocates them the stacked tensor is a copy with the same values."""
    layer = GroupedLinear(3, K, N, bias=False, params_dtype=torch.bfloat16)
    stacked = layer._stacked_weights()
    assert stacked.data_ptr() == layer.weight0.data_ptr() and stacked.shape == (3 * N, K)
    assert all(isinstance(w, torch.nn.Parameter) for w in layer.weights)
    assert torch.equal(stacked, torch.cat(list(layer.weights)))
    moved = layer.to(torch.float32)
    copy = moved._stacked_weights()
    assert copy.data_ptr() != moved.weight0.data_ptr() and torch.equal(copy, torch.cat(list(moved.weights)))


def test_back_to_back_detects_one_buffer_in_order() -> None:
    """The grouped GEMM takes per-expert operands as one tensor only when they lie back to back
    in one buffer, in expert order (else it runs per expert)."""
    from megatron_fp8.gemm_grouped import back_to_back

    buf = torch.arange(24.0)
    assert back_to_back([buf[:6].view(2, 3), buf[6:6].view(0, 3), buf[6:15].view(3, 3)])
    assert not back_to_back([buf[6:12].view(2, 3), buf[:6].view(2, 3)])  # out of order
    assert not back_to_back([buf[:6].view(2, 3), buf[9:15].view(2, 3)])  # a gap
    assert not back_to_back([buf[:6].view(2, 3), torch.zeros(2, 3)])  # another buffer
    assert not back_to_back([buf[:12].view(3, 4)[:, :2], buf[12:18].view(3, 2)])  # not contiguous
    arr = buf.numpy()  # adjacent in memory, but two storages (as two allocations side by side)
    assert not back_to_back([torch.from_numpy(arr[:6]), torch.from_numpy(arr[6:12])])


def test_segment_offsets_cached_and_bounded() -> None:
    from megatron_fp8.quant import kernels

    first = kernels.segment_offsets([3, 0, 5], torch.device("cpu"))
    assert first.tolist() == [0, 3, 3, 8] and first.dtype == torch.int64
    assert kernels.segment_offsets((3, 0, 5), torch.device("cpu")) is first  # same splits: no new copy
    for i in range(kernels._INTS_KEPT + 1):
        kernels.segment_offsets([i + 100], torch.device("cpu"))
    assert len(kernels._ints_cache) == kernels._INTS_KEPT
    assert kernels.segment_offsets([3, 0, 5], torch.device("cpu")) is not first  # evicted, rebuilt


@pytest.mark.parametrize("real, padded", [([3, 0, 5], [128, 0, 128]), ([1, 2], [128, 128]), ([128], [128])])
def test_segment_offsets_pair_in_one_copy(real: list[int], padded: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A router step's real and padded prefix sums reach the device in one copy: two views, each
    16 bytes aligned, the values ``segment_offsets`` gives, and kept as its own entries (later
    calls get the same tensors); one already kept, or a capture, takes them one by one."""
    from megatron_fp8.quant import kernels

    cpu = torch.device("cpu")
    monkeypatch.setattr(kernels, "_ints_cache", {})
    a, b = kernels.segment_offsets_pair(real, padded, cpu)
    assert a.tolist() == [0, *itertools.accumulate(real)] and b.tolist() == [0, *itertools.accumulate(padded)]
    assert a.dtype == b.dtype == torch.int64 and not a.data_ptr() % 16 and not b.data_ptr() % 16
    assert kernels.segment_offsets(real, cpu) is a and kernels.segment_offsets(padded, cpu) is b
    if real != padded:
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one copy
    again = kernels.segment_offsets_pair(real, padded, cpu)
    assert again[0] is a and again[1] is b
    monkeypatch.setattr(kernels, "_ints_cache", {})
    monkeypatch.setattr(kernels, "_ints_held", {})
    monkeypatch.setattr(kernels, "_ints_captured", [])
    monkeypatch.setattr(kernels, "capturing", lambda device: True)
    c, d = kernels.segment_offsets_pair(real, padded, cpu)
    assert c.tolist() == a.tolist() and d.tolist() == b.tolist()
    assert real == padded or c.untyped_storage().data_ptr() != d.untyped_storage().data_ptr()


def test_segment_offsets_kept_for_captured_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offsets a CUDA graph captured outlive any eviction (the graph may replay at any time), and
    those a capture created (written only when the graph replays) are handed to no one else."""
    from megatron_fp8.quant import kernels

    cpu = torch.device("cpu")
    monkeypatch.setattr(kernels, "_ints_held", {})
    monkeypatch.setattr(kernels, "_ints_captured", [])
    eager = kernels.segment_offsets([128, 256], cpu)  # made eagerly, then used by a capture
    monkeypatch.setattr(kernels, "capturing", lambda device: True)
    assert kernels.segment_offsets([128, 256], cpu) is eager
    in_capture = kernels.segment_offsets([384, 128], cpu)  # first made inside a capture
    monkeypatch.setattr(kernels, "capturing", lambda device: False)
    for i in range(kernels._INTS_KEPT + 1):  # evicts every eager entry
        kernels.segment_offsets([i + 1000], cpu)
    assert kernels.segment_offsets([128, 256], cpu) is eager  # held: never evicted
    again = kernels.segment_offsets([384, 128], cpu)
    assert again is not in_capture and again.tolist() == [0, 384, 512]  # eager callers get their own
    assert any(entry[1] is in_capture for entry in kernels._ints_captured)  # kept for the graph


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_stacked_advance_equals_one_by_one(algo: str, device: str) -> None:
    """The experts' delayed-scaling state advanced together (one stacked history: one Triton
    launch on CUDA or under TRITON_INTERPRET, else torch ops) holds the same bits as each
    quantizer advanced alone, over steps with NaN, inf and zero amaxes, and a second record in
    one step; a history replaced by load_state_dict leaves the stack."""
    from megatron_fp8.quant.quantizers import DelayedScalingQuantizer as Q
    from megatron_fp8.quant.tensor_scaling import fold_amax

    recipe = DelayedScaling(amax_history_len=4, margin=1, amax_compute_algo=algo)
    together, alone = ([Q(torch.float8_e4m3fn, recipe, device=device) for _ in range(4)] for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    bits = lambda t: t.view(torch.int32)  # noqa: E731 - NaN-safe bitwise comparison
    for step in range(7):
        amaxes = [(torch.rand(4, generator=gen) * 4.0**step).to(device) for _ in range(2)]
        if step == 2:
            amaxes[0][1:] = torch.tensor([float("nan"), float("inf"), 0.0], device=device)
        with mf.fp8_autocast(fp8_recipe=recipe):
            for amax in amaxes:  # two records in the step: the second advances nothing
                adv = Q._advance_peers(together)
                stack = adv.hist
                assert stack is not None
                if adv.laid_out is not None:  # the one-launch step's inverses: torch.reciprocal's bits
                    inv = adv.laid_out[1]
                    assert torch.equal(bits(inv), bits(torch.reciprocal(torch.stack([p.scale for p in together]))))
                x = amax.view(-1, 1)  # one row per expert whose |max| is its amax
                if kernels.segments_fused(x, False):  # the amax kernel records into the stack
                    kernels.segment_amax_scale(x, [1] * len(together), torch.float8_e4m3fn, scale=False, history=stack)
                else:
                    fold_amax(stack, amax)
                for i, q in enumerate(alone):
                    q._advance()
                    fold_amax(q.amax_history, amax[i])
        for p, q in zip(together, alone):
            assert torch.equal(bits(p.scale), bits(q.scale))
            assert torch.equal(bits(p.amax_history), bits(q.amax_history)) and p.step == q.step
        # NaN and inf never enter a history: the step records the previous step's amax instead
        assert torch.isfinite(torch.stack([q.amax_history for q in alone])).all()
    together[2].load_state_dict(alone[2].state_dict())
    assert Q._stack_of(together) is None
    with mf.fp8_autocast(fp8_recipe=recipe):  # one peer advanced alone first: no stack, one by one
        together[0]._advance()
        assert Q._advance_peers(together).hist is None
        assert all(p.step == together[0].step for p in together)
    assert Q._advance_peers([together[1], together[1]]).hist is None  # one quantizer listed twice


@pytest.mark.parametrize("name", list(RECIPES))
def test_padding_experts_to_the_native_alignment(name: str) -> None:
    """On CUDA each expert's rows are padded to the recipe's native alignment (128 tokens for
    per-tensor scales and 1x128 blocks, 32 MXFP8; 16 for per-tensor scales off CUDA) so that every
    expert GEMM runs natively for any split (here on CPU, ``pad_to`` forced). The zero rows change
    no output row and add zeros to every gradient sum: out, dx, dw and db equal the unpadded layer's
    within the GEMMs' accumulation order (a padded expert is a longer GEMM), over two steps
    (delayed: the history too), and the flag on == off bitwise on the padded path. BF16 inputs, as
    the layers get them (an FP32 input with a columnwise copy takes the reference cast, which under
    Triton's interpreter rounds differently from its kernels: not the GPU's behaviour)."""
    from megatron_fp8.ops.grouped_linear import grouped_linear

    splits = [5, 0, 130, 17, 1]
    runs = {}
    for pad_to in (1, 16, 128):
        for flag in (False, True):
            torch.manual_seed(0)
            layer = GroupedLinear(len(splits), 256, 128, bias=True, params_dtype=torch.bfloat16,
                                  save_original_input=flag)
            outs = []
            for step in range(2):
                g = torch.Generator().manual_seed(step)
                x = torch.randn(sum(splits), 256, generator=g).to(torch.bfloat16).requires_grad_()
                with mf.fp8_autocast(fp8_recipe=RECIPES[name]):
                    qs, w_fp8 = layer.fp8_operands(None)
                    y = grouped_linear(x, layer.weights, layer.biases, splits, w_fp8=w_fp8, quantizers=qs,
                                       save_original_input=flag, pad_to=pad_to)
                y.backward(torch.linspace(-1, 1, 128, dtype=torch.bfloat16).expand_as(y))
                outs += [y.detach(), x.grad, *(w.grad.clone() for w in layer.weights)]
                outs += [b.grad.clone() for b in layer.biases]
                layer.zero_grad()
            runs[pad_to, flag] = outs
    for pad_to in (16, 128):
        assert all(torch.equal(a, b) for a, b in zip(runs[pad_to, True], runs[pad_to, False]))
        for got, want in zip(runs[pad_to, False], runs[1, False]):
            # BF16 outputs: an FP32 sum in another order may round to the neighbouring BF16 value
            assert (got - want).float().abs().max() <= 2**-7 * want.float().abs().max().clamp(min=1.0)


@pytest.mark.parametrize("backend", ["loop", "auto"])
def test_grouped_gemm_keeps_only_the_real_rows(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``grouped_gemm_cat(keep=...)``: the experts' GEMMs write only their real rows, each at its
    place in the unpadded output (one GEMM's padding lands on the next experts' first rows before
    their GEMMs write them; the last experts, whose padding would run past the end, go through a
    buffer of their own), bit for bit the padded output with its padding dropped afterwards."""
    from megatron_fp8.gemm_grouped import grouped_gemm_cat
    from megatron_fp8.quant.quantizers import CurrentScalingQuantizer

    monkeypatch.setenv("MEGATRON_FP8_GROUPED_GEMM", backend)
    padded, real = [16, 0, 32, 16, 16], [5, 0, 17, 10, 1]  # the last two both run past the end
    torch.manual_seed(0)
    x = torch.randn(sum(padded), 64).bfloat16()
    for i, (p, r) in enumerate(zip(padded, real)):  # zero padding rows, as the layer's
        start = sum(padded[:i])
        x[start + r:start + p] = 0
    ws = [torch.randn(48, 64).bfloat16() for _ in padded]
    q = CurrentScalingQuantizer(torch.float8_e4m3fn)
    a = [q.quantize(xi, columnwise=False).rowwise for xi in x.split(padded)]
    b = [q.quantize(w, columnwise=False).rowwise for w in ws]
    full = grouped_gemm_cat(a, b, torch.bfloat16)
    starts = [sum(padded[:i]) for i in range(len(padded))]
    want = torch.cat([full[s:s + r] for s, r in zip(starts, real)])
    got = grouped_gemm_cat(a, b, torch.bfloat16, keep=real)
    assert got.shape == (sum(real), 48)
    assert torch.equal(got, want)


def test_expert_rows_index() -> None:
    """The padded row of every real row and the padded splits (empty and aligned experts too)."""
    from megatron_fp8.ops.grouped_linear import expert_rows

    rows, padded = expert_rows([5, 0, 17, 16], 16, torch.device("cpu"))
    assert padded == [16, 0, 32, 16]
    assert rows.tolist() == [*range(0, 5), *range(16, 33), *range(48, 64)]


@pytest.mark.parametrize("name", ["current", "block"])
def test_padding_saves_no_high_precision_copy(name: str) -> None:
    """Padding each expert's rows keeps no high-precision copy for backward: flag off, the FP8
    copies and the index (``Tensor.index_copy``, which this used, also saved its source: the whole
    input); flag on, the caller's own tensor (not a padded copy of it) and the index."""
    from megatron_fp8 import memory
    from megatron_fp8.ops.grouped_linear import grouped_linear

    splits = [5, 0, 130, 17, 1]
    for flag in (False, True):
        layer = GroupedLinear(len(splits), 256, 128, bias=False, params_dtype=torch.bfloat16)
        x = torch.randn(sum(splits), 256, dtype=torch.bfloat16, requires_grad=True)
        with memory.track_saved_tensors(layer) as saved, mf.fp8_autocast(fp8_recipe=RECIPES[name]):
            qs, w_fp8 = layer.fp8_operands(None)
            grouped_linear(x, layer.weights, None, splits, w_fp8=w_fp8, quantizers=qs, save_original_input=flag,
                           pad_to=128)
        acts = [r for r in saved.records if not r.is_parameter]
        high = [r for r in acts if r.dtype == torch.bfloat16]
        index = [r for r in acts if r.dtype == torch.int64]
        assert [r.nbytes for r in index] == [8 * sum(splits)]
        if flag:
            assert len(high) == 1 and high[0].storage._cdata == x.untyped_storage()._cdata
        else:
            assert not high


def test_expert_padding_saves_only_the_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's ``ExpertPadding`` (our TE ``Fp8Padding``) padding outside the grouped linears: the
    padded input's backward keeps the index, not the experts' whole input."""
    from megatron_fp8.megatron.experts import ExpertPadding

    monkeypatch.setenv("MEGATRON_FP8_EXPERT_PADDING", "outside")

    x = torch.randn(153, 64, requires_grad=True)
    packed: list[torch.Tensor] = []
    with mf.fp8_autocast(fp8_recipe=RECIPES["block"]), torch.autograd.graph.saved_tensors_hooks(
            lambda t: packed.append(t) or t, lambda t: t):
        y, padded = ExpertPadding()(x, [5, 0, 130, 17, 1])
    assert padded == [128, 0, 256, 128, 128] and y.shape == (640, 64)
    assert [(t.dtype, tuple(t.shape)) for t in packed] == [(torch.int64, (153,))]
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, torch.ones_like(x))


def test_row_padding_with_partial_weight_blocks() -> None:
    """Row padding (``pad_to``) and a 128x128-blocked weight with a partial block (N = 192: zero
    weight rows, output columns trimmed, dy padded with zero columns) together, bias and FP32
    wgrad accumulation on: flag on == off bitwise, and within the GEMMs' accumulation order of
    the unpadded layer."""
    from megatron_fp8.ops.grouped_linear import grouped_linear

    splits = [5, 0, 130, 17]
    runs = {}
    for pad_to, flag in ((1, False), (128, False), (128, True)):
        torch.manual_seed(0)
        layer = GroupedLinear(len(splits), 256, 192, bias=True, params_dtype=torch.bfloat16, save_original_input=flag,
                              fuse_wgrad_accumulation=True)
        for w in layer.weights:
            w.main_grad = torch.zeros(192, 256)
        x = torch.randn(sum(splits), 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        x.requires_grad_()
        with mf.fp8_autocast(fp8_recipe=RECIPES["block"]):
            qs, w_fp8 = layer.fp8_operands(None)
            y = grouped_linear(x, layer.weights, layer.biases, splits, w_fp8=w_fp8, quantizers=qs,
                               save_original_input=flag, fuse_wgrad_accumulation=True, pad_to=pad_to)
        y.backward(torch.linspace(-1, 1, 192, dtype=torch.bfloat16).expand_as(y))
        runs[pad_to, flag] = [y.detach(), x.grad, *(w.main_grad for w in layer.weights),
                              *(b.grad for b in layer.biases)]
    assert all(torch.equal(a, b) for a, b in zip(runs[128, True], runs[128, False]))
    for got, want in zip(runs[128, False], runs[1, False]):
        assert (got - want).float().abs().max() <= 2**-7 * want.float().abs().max().clamp(min=1.0)
