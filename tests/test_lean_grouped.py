"""The lean grouped path (ops.lean_grouped) against the general one: the same bits and saved
bytes, plans only where they apply, and a failing route warned about and left for the general
path. Its routes are Triton's segmented casts and grouped GEMMs, which run on CPU only under
``TRITON_INTERPRET=1`` (CI's interpreter phase); tests/test_lean_gpu.py runs them on the GPU."""

from __future__ import annotations

import copy
import itertools
import os
import warnings

import pytest
import torch

import megatron_fp8 as mf
from megatron_fp8 import memory
from megatron_fp8.modules.grouped import GroupedLinear
from megatron_fp8.ops import lean_grouped, paths
from megatron_fp8.recipe import PRESETS, Float8BlockScaling, Format

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the grouped routes run on CPU only under TRITON_INTERPRET=1")

RECIPES = {"current": PRESETS["current"], "blockwise": PRESETS["blockwise"],
           "blockwise-hybrid": Float8BlockScaling(fp8_format=Format.HYBRID), "delayed": PRESETS["delayed"]}
PAIRWISE = [(False, False, False), (True, True, False), (True, False, True), (False, True, True)]
SPLITS = {"current": [128, 256, 128], "blockwise": [0, 256, 128], "blockwise-hybrid": [128, 0, 256],
          "delayed": [256, 0, 128]}


def _steps(monkeypatch: pytest.MonkeyPatch, lean_on: str, recipe: object, splits: list[int], soi: bool = False,
           bias: bool = False, fuse: bool = False) -> tuple[list[torch.Tensor], GroupedLinear, str]:
    """Two fwd+bwd steps of a fresh layer (same seed): outputs and every gradient, and the name
    of the autograd node that made the last output."""
    monkeypatch.setenv("MEGATRON_FP8_LEAN", lean_on)
    torch.manual_seed(2)
    e = len(splits)
    layer = GroupedLinear(e, 256, 128, bias=bias, params_dtype=torch.bfloat16, save_original_input=soi,
                          fuse_wgrad_accumulation=fuse, name="fc1")
    if fuse:
        main = torch.zeros(e, 128, 256)
        for w, m in zip(layer.weights, main):
            w.main_grad = m
    x = torch.randn(sum(splits), 256, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(sum(splits), 128, dtype=torch.bfloat16)
    out: list[torch.Tensor] = []
    node = ""
    for _ in range(2):
        with mf.fp8_autocast(fp8_recipe=recipe):
            y = layer(x, splits)
        node = type(y.grad_fn).__name__
        y.backward(dy)
        out += [y.detach().clone(), x.grad.clone(), *[(w.main_grad if fuse else w.grad).clone() for w in layer.weights]]
        if bias:
            out += [b.grad.clone() for b in layer.biases]
    return out, layer, node


def _plans(layer: GroupedLinear) -> list[lean_grouped.GroupedPlan | None]:
    q = layer._quantizers["weight0"]
    return [p for k, p in q.__dict__.get("_plans", {}).items() if k[0] == "grouped"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_lean_grouped_equals_general_bitwise(monkeypatch: pytest.MonkeyPatch, recipe: str) -> None:
    """Two steps each (delayed scaling: the histories and scales the steps leave, compared too);
    the flag x bias x wgrad-fusion combinations that cover every pair of settings."""
    for soi, bias, fuse in PAIRWISE:
        general, g_layer, g_node = _steps(monkeypatch, "0", RECIPES[recipe], SPLITS[recipe], soi, bias, fuse)
        planned, layer, p_node = _steps(monkeypatch, "1", RECIPES[recipe], SPLITS[recipe], soi, bias, fuse)
        if recipe == "delayed":
            for i in range(len(SPLITS[recipe])):
                for role in ("input", "weight", "grad_output"):
                    a, b = (getattr(x._quantizers[f"weight{i}"], role) for x in (g_layer, layer))
                    assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale)
        if recipe == "delayed" and soi:  # the flag's delayed backward keeps the general path
            assert p_node == "_GroupedLinearBackward" and _plans(layer) == [None]
            assert all(torch.equal(a, b) for a, b in zip(general, planned))
            continue
        assert (g_node, p_node) == ("_GroupedLinearBackward", "LeanGroupedBackward")
        assert len(general) == len(planned)
        for i, (a, b) in enumerate(zip(general, planned)):
            assert torch.equal(a, b), (recipe, soi, bias, fuse, i)
        plans = _plans(layer)
        assert len(plans) == 1 and plans[0] is not None and plans[0].proven


@pytest.mark.parametrize("recipe", ["current", "blockwise"])
@pytest.mark.parametrize("soi", [False, True])
def test_lean_grouped_saves_what_the_general_path_saves(monkeypatch: pytest.MonkeyPatch, recipe: str,
                                                        soi: bool) -> None:
    counted = {}
    for lean_on in ("0", "1"):
        monkeypatch.setenv("MEGATRON_FP8_LEAN", lean_on)
        torch.manual_seed(0)
        layer = GroupedLinear(2, 256, 128, bias=False, params_dtype=torch.bfloat16, save_original_input=soi)
        x = torch.randn(256, 256, dtype=torch.bfloat16, requires_grad=True)
        with memory.track_saved_tensors(layer) as saved, mf.fp8_autocast(fp8_recipe=RECIPES[recipe]):
            layer(x, [128, 128])
        counted[lean_on] = (saved.activation_bytes, saved.parameter_bytes)
    assert counted["0"] == counted["1"]
    assert counted["1"][0] > 0


def test_plans_only_where_they_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """Splits the one-launch GEMMs do not take (on CPU nothing pads them), current scaling with an
    expert without tokens, MXFP8 and FP8 off take the general path; the plan stays and serves the
    next aligned call."""
    _, layer, node = _steps(monkeypatch, "1", PRESETS["current"], [100, 156])
    assert node == "_GroupedLinearBackward"
    _, layer, node = _steps(monkeypatch, "1", PRESETS["current"], [0, 256])
    assert node == "_GroupedLinearBackward" and _plans(layer)[0] is not None
    x = torch.randn(256, 256, dtype=torch.bfloat16, requires_grad=True)
    with mf.fp8_autocast(fp8_recipe=PRESETS["current"]):
        y = layer(x, [128, 128])
    assert type(y.grad_fn).__name__ == "LeanGroupedBackward"
    _, layer, node = _steps(monkeypatch, "1", PRESETS["mxfp8"], [128, 128])
    assert node == "_GroupedLinearBackward" and not any(_plans(layer))
    _, _, node = _steps(monkeypatch, "0", PRESETS["current"], [128, 128])
    assert node == "_GroupedLinearBackward"


def test_a_failing_forward_route_warns_and_the_general_path_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    general, _, _ = _steps(monkeypatch, "0", PRESETS["blockwise"], [128, 128])

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("this device refuses the grouped GEMM")

    with paths.count_paths() as served:
        _steps(monkeypatch, "1", PRESETS["blockwise"], [128, 128])
    monkeypatch.setattr(lean_grouped, "_rows_gemm", refuse)
    with pytest.warns(RuntimeWarning, match=r"fc1.*lean grouped FP8 path failed in forward"), \
            paths.count_paths() as fell_back:
        planned, layer, node = _steps(monkeypatch, "1", PRESETS["blockwise"], [128, 128])
    assert node == "_GroupedLinearBackward" and _plans(layer) == [None]
    assert all(torch.equal(a, b) for a, b in zip(general, planned))
    assert served == {"lean grouped": 2} and fell_back == {"general grouped": 2}  # (megatron.launch reports it)


def test_a_failing_backward_route_warns_and_the_general_calls_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    for soi in (False, True):
        general, _, _ = _steps(monkeypatch, "0", PRESETS["current"], [128, 256], soi)

        def refuse(*args: object, **kwargs: object) -> None:
            raise RuntimeError("this device refuses the wgrad")

        with monkeypatch.context() as m:
            m.setattr(lean_grouped, "_gradients", refuse)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                planned, layer, node = _steps(monkeypatch, "1", PRESETS["current"], [128, 256], soi)
        assert node == "LeanGroupedBackward"
        assert [str(w.message) for w in caught if "failed in backward" in str(w.message)]
        assert _plans(layer)[0].backward_general
        assert all(torch.equal(a, b) for a, b in zip(general, planned)), soi


def test_copies_make_their_own_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    _, layer, _ = _steps(monkeypatch, "1", PRESETS["current"], [128, 128])
    assert _plans(layer)
    twin = copy.deepcopy(layer)
    assert "_plans" not in twin._quantizers["weight0"].__dict__


def _one_step(monkeypatch: pytest.MonkeyPatch, lean_on: str, soi: bool, hooks: bool = False,
              backward_env: dict[str, str] | None = None) -> tuple[list[torch.Tensor], list[str], str]:
    """One current-scaling step with [128, 256] splits: outputs, grads, the GEMMs recorded and the
    autograd node; ``hooks``: saved tensors copied (as CPU offload does); ``backward_env``:
    settings changed between forward and backward."""
    monkeypatch.setenv("MEGATRON_FP8_LEAN", lean_on)
    torch.manual_seed(4)
    layer = GroupedLinear(2, 256, 128, bias=False, params_dtype=torch.bfloat16, save_original_input=soi, name="fc2")
    x = torch.randn(384, 256, dtype=torch.bfloat16, requires_grad=True)
    with mf.gemm.record_gemms() as calls:
        with mf.fp8_autocast(fp8_recipe=PRESETS["current"]):
            if hooks:
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
                    y = layer(x, [128, 256])
            else:
                y = layer(x, [128, 256])
        with monkeypatch.context() as m:
            for k, v in (backward_env or {}).items():
                m.setenv(k, v)
            y.backward(torch.ones_like(y))
    node = type(y.grad_fn).__name__
    return [y.detach(), x.grad, *[w.grad for w in layer.weights]], [f"{c.name} {c.backend.value}" for c in calls], node


@pytest.mark.parametrize("soi", [False, True])
def test_copying_saved_tensor_hooks_change_nothing(monkeypatch: pytest.MonkeyPatch, soi: bool) -> None:
    """A hook that copies what is saved hands back the experts' per-tensor scales packed, not 16
    bytes apart: the lean backward realigns them, as the general path does."""
    general, _, _ = _one_step(monkeypatch, "0", soi, hooks=True)
    planned, _, node = _one_step(monkeypatch, "1", soi, hooks=True)
    assert node == "LeanGroupedBackward"
    assert all(torch.equal(a, b) for a, b in zip(general, planned))


def test_gemms_recorded_as_the_general_path_records_them(monkeypatch: pytest.MonkeyPatch) -> None:
    _, general_calls, _ = _one_step(monkeypatch, "0", False)
    _, planned_calls, node = _one_step(monkeypatch, "1", False)
    assert node == "LeanGroupedBackward" and planned_calls == general_calls
    assert [c.split("[")[0] for c in planned_calls] == ["fprop", "dgrad", "wgrad"]


def test_a_backward_under_other_settings_takes_the_general_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MEGATRON_FP8_GROUPED_GEMM=loop`` set between forward and backward: the general path's
    backward runs one GEMM per expert; so does the lean one, for that call."""
    env = {"MEGATRON_FP8_GROUPED_GEMM": "loop"}
    general, general_calls, _ = _one_step(monkeypatch, "0", False, backward_env=env)
    planned, planned_calls, node = _one_step(monkeypatch, "1", False, backward_env=env)
    assert node == "LeanGroupedBackward" and planned_calls == general_calls
    assert not any("dgrad[triton]" in c for c in planned_calls)
    assert all(torch.equal(a, b) for a, b in zip(general, planned))


def test_a_cast_turned_off_later_retires_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel guard that turns the one-launch current cast off after a plan has run (a failure
    on another shape): the next call retires the plan, silently (the guard has warned), and the
    general path casts in its fallback launches."""
    from megatron_fp8.quant import kernels

    _, layer, node = _steps(monkeypatch, "1", PRESETS["current"], [128, 128])
    assert node == "LeanGroupedBackward"
    monkeypatch.setattr(kernels, "_current_launches", lambda *a, **k: None)
    x = torch.randn(256, 256, dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with mf.fp8_autocast(fp8_recipe=PRESETS["current"]):
            y = layer(x, [128, 128])
    assert type(y.grad_fn).__name__ == "_GroupedLinearBackward"
    assert _plans(layer) == [None]


@pytest.mark.parametrize("recipe, splits", [("current", [5, 130, 17, 1]), ("blockwise", [5, 0, 130, 17])])
def test_padded_inside_equals_general_bitwise(monkeypatch: pytest.MonkeyPatch, recipe: str, splits: list[int]) -> None:
    """Splits padded to 128 inside the function (as on CUDA; ``pad_to`` forced here): the lean
    path pads, casts, runs and drops the padding as the general path does, bit for bit."""
    from megatron_fp8.ops.grouped_linear import grouped_linear

    runs = {}
    for lean_on, soi in itertools.product(("0", "1"), (False, True)):
        monkeypatch.setenv("MEGATRON_FP8_LEAN", lean_on)
        torch.manual_seed(6)
        layer = GroupedLinear(len(splits), 256, 128, bias=True, params_dtype=torch.bfloat16)
        x = torch.randn(sum(splits), 256, dtype=torch.bfloat16, requires_grad=True)
        with mf.fp8_autocast(fp8_recipe=RECIPES[recipe]):
            qs, w_fp8 = layer.fp8_operands(None)
            y = grouped_linear(x, layer.weights, layer.biases, splits, w_fp8=w_fp8, quantizers=qs,
                               save_original_input=soi, pad_to=128)
        node = type(y.grad_fn).__name__
        assert node == ("LeanGroupedBackward" if lean_on == "1" else "_GroupedLinearBackward")
        y.backward(torch.linspace(-1, 1, 128, dtype=torch.bfloat16).expand_as(y))
        runs[lean_on, soi] = [y.detach(), x.grad, *[w.grad for w in layer.weights], *[b.grad for b in layer.biases]]
    for soi in (False, True):
        assert all(torch.equal(a, b) for a, b in zip(runs["0", soi], runs["1", soi])), soi
        assert all(torch.equal(a, b) for a, b in zip(runs["1", soi], runs["1", False])), soi


@pytest.mark.parametrize("soi", [False, True], ids=["flag-off", "flag-on"])
@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_gathered_casts_equal_padding_first(monkeypatch: pytest.MonkeyPatch, recipe: str, soi: bool) -> None:
    """The casts that read padded experts from their unpadded rows (``kernels.cast_gathered``: the
    Triton cast's ``GATHER`` here, the CUDA tile cast's on the GPU for both copies; current
    scaling's under ``MEGATRON_FP8_CUDA_CURRENT=1``, as while a graph is captured): x's and dy's
    copies, and with ``save_original_input`` x's rowwise copy in forward and its columnwise copy in
    backward, reach the GEMMs as the padded tensors' would, on the lean and the general path: bit
    for bit the results of padding first."""
    from megatron_fp8.ops.grouped_linear import grouped_linear
    from megatron_fp8.quant import kernels

    monkeypatch.setenv("MEGATRON_FP8_CUDA_CURRENT", "1")
    real = kernels.cast_gathered
    calls: list[tuple[str, bool, bool]] = []

    def spy(src, splits, dtype, mode, tensor_scale=None, rowwise=True, columnwise=True):
        out = real(src, splits, dtype, mode, tensor_scale, rowwise, columnwise)
        assert out is not None
        calls.append((mode, rowwise, columnwise))
        return out

    splits = [5, 0, 130, 17, 1]
    runs = {}
    for lean_on, gather in itertools.product(("0", "1"), (False, True)):
        monkeypatch.setenv("MEGATRON_FP8_LEAN", lean_on)
        monkeypatch.setattr(kernels, "cast_gathered", spy if gather else lambda *a, **k: None)
        calls.clear()
        torch.manual_seed(6)
        layer = GroupedLinear(len(splits), 256, 128, bias=True, params_dtype=torch.bfloat16)
        x = torch.randn(sum(splits), 256, dtype=torch.bfloat16, requires_grad=True)
        with mf.fp8_autocast(fp8_recipe=RECIPES[recipe]):
            qs, w_fp8 = layer.fp8_operands(None)
            y = grouped_linear(x, layer.weights, layer.biases, splits, w_fp8=w_fp8, quantizers=qs, pad_to=128,
                               save_original_input=soi)
        y.backward(torch.linspace(-1, 1, 128, dtype=torch.bfloat16).expand_as(y))
        runs[lean_on, gather] = [y.detach(), x.grad, *[w.grad for w in layer.weights], *[b.grad for b in layer.biases]]
        if gather:
            mode = "tensor" if recipe == "current" else "1x128"
            want = [(mode, True, not soi), (mode, True, True)] + ([(mode, False, True)] if soi else [])
            assert calls == want, (lean_on, calls)
    for lean_on in ("0", "1"):
        assert all(torch.equal(a, b) for a, b in zip(runs[lean_on, True], runs[lean_on, False])), lean_on


def test_failure_after_the_epilogue_add_is_raised_not_run_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the wgrad has added into the experts' main_grad (the fusion's epilogue add), a failure
    later in the plan's backward is raised: the general helpers running the gradients again would
    add them a second time."""
    monkeypatch.setenv("MEGATRON_FP8_LEAN", "1")
    torch.manual_seed(0)
    layer = GroupedLinear(3, 256, 128, bias=False, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True,
                          name="fc1")
    main = torch.zeros(3, 128, 256)
    for w, m in zip(layer.weights, main):
        w.main_grad = m
    x = torch.randn(384, 256, dtype=torch.bfloat16, requires_grad=True)
    with mf.fp8_autocast(fp8_recipe=RECIPES["current"]):
        y = layer(x, [128, 128, 128])
    real = lean_grouped._record

    def fail_after_wgrad(name: str, *args: object) -> None:
        if name == "wgrad":
            raise RuntimeError("after the wgrad")
        real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(lean_grouped, "_record", fail_after_wgrad)
    with pytest.raises(RuntimeError, match="after the wgrad"):
        y.backward(torch.randn(384, 128, dtype=torch.bfloat16))
    assert main.abs().sum() > 0  # added once, in the epilogue


@pytest.mark.parametrize("one_launch", [False, True])
def test_lean_weights_equal_the_segmented_cast(monkeypatch: pytest.MonkeyPatch, one_launch: bool) -> None:
    """The experts' weights cast through ``lean_weights`` (its checks made once per signature)
    equal ``quantize_segments_packed``'s packs and kept scales, bit for bit, through the two-launch
    dispatch and through the one-launch cast (on CPU: the interpreter's); the layer takes that
    route, and leaves it for shapes and recipes the one cast does not serve."""
    from megatron_fp8.kernels import triton_persistent
    from megatron_fp8.quant.tensor_scaling import CurrentScalingQuantizer

    monkeypatch.setenv("MEGATRON_FP8_LEAN", "1")
    if one_launch:
        monkeypatch.setattr(triton_persistent, "persistent_ok", lambda x: True)
    general = CurrentScalingQuantizer.quantize_segments_packed
    calls: list[int] = []

    def counted(self: CurrentScalingQuantizer, *args: object, **kw: object) -> object:
        calls.append(1)
        return general(self, *args, **kw)

    monkeypatch.setattr(CurrentScalingQuantizer, "quantize_segments_packed", counted)
    torch.manual_seed(4)
    layer = GroupedLinear(3, 256, 128, bias=False, params_dtype=torch.bfloat16, name="fc1")
    for _ in range(2):
        with mf.fp8_autocast(fp8_recipe=RECIPES["current"]):
            qs, seg = layer.fp8_operands(None)
    assert calls == []
    stacked = layer._stacked_weights()
    want = general(qs[0].weight, stacked, [128] * 3, peers=[q.weight for q in qs], rowwise=True, columnwise=True)
    for a, b in ((seg.rows, want.rows), (seg.cols, want.cols)):
        assert a.splits == b.splits and a.layout is b.layout and a.width == b.width
        assert torch.equal(a.data, b.data) and torch.equal(a.scale_inv, b.scale_inv)
        assert a.scale_inv.stride() == b.scale_inv.stride()
    assert all(torch.equal(a, b) for a, b in zip(seg.scales, want.scales))
    choices = [v for k, v in qs[0].__dict__["_plans"].items() if k[0] == "weights"]
    assert len(choices) == 1 and choices[0][1] == {"weight": one_launch}

    odd = GroupedLinear(3, 256, 96, bias=False, params_dtype=torch.bfloat16, name="fc2")  # rows not 128-aligned
    with mf.fp8_autocast(fp8_recipe=RECIPES["current"]):
        odd.fp8_operands(None)
    assert calls == [1]
    assert [v for k, v in odd._quantizers["weight0"].__dict__["_plans"].items() if k[0] == "weights"] == [None]
    block = GroupedLinear(3, 256, 128, bias=False, params_dtype=torch.bfloat16, name="fc3")
    with mf.fp8_autocast(fp8_recipe=RECIPES["blockwise"]):
        block.fp8_operands(None)
    assert "_plans" not in block._quantizers["weight0"].__dict__


def test_lean_weights_decline_where_the_segmented_cast_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts whose weight quantizers differ in their options, amaxes reduced over a group, and a
    CUDA graph capture: ``lean_weights`` declines (the segmented cast decides, as without it)."""
    from megatron_fp8.ops.lean_grouped import lean_weights
    from megatron_fp8.quant import kernels

    monkeypatch.setenv("MEGATRON_FP8_LEAN", "1")
    layer = GroupedLinear(3, 256, 128, bias=False, params_dtype=torch.bfloat16, name="fc1")
    with mf.fp8_autocast(fp8_recipe=RECIPES["current"]):
        qs = [layer.fp8_quantizers(f"weight{i}") for i in range(3)]
    stacked = layer._stacked_weights()
    qs[2].weight.power_2_scale = not qs[0].weight.power_2_scale  # a peer of other options
    assert lean_weights(stacked, qs) is None
    assert [v for k, v in qs[0].__dict__["_plans"].items() if k[0] == "weights"] == [None]
    qs[2].weight.power_2_scale = qs[0].weight.power_2_scale
    qs[0].__dict__["_plans"].clear()
    monkeypatch.setattr(lean_grouped, "_grouped", lambda group: True)  # amaxes reduced over a group
    assert lean_weights(stacked, qs) is None
    monkeypatch.undo()
    monkeypatch.setenv("MEGATRON_FP8_LEAN", "1")
    qs[0].__dict__["_plans"].clear()
    monkeypatch.setattr(kernels, "capturing", lambda device: True)
    assert lean_weights(stacked, qs) is None and not qs[0].__dict__["_plans"]
    monkeypatch.setattr(kernels, "capturing", lambda device: False)
    assert lean_weights(stacked, qs) is not None
