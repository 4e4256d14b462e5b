"""Loading FP8 state replaces the layer's own: recipes switched at resume, rollbacks, devices,
expert layouts, and the cached FP8 weight after anything that changes the weight."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

import megatron_fp8 as mf
from megatron_fp8.modules.base import tensor_bytes
from megatron_fp8.parallel import ParallelConfig
from megatron_fp8.parallel.grouped import ColumnParallelGroupedLinear
from megatron_fp8.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

CURRENT = Float8CurrentScaling()


def _trained(recipe: object, steps: int = 2, scale: float = 1.0) -> mf.Linear:
    layer = mf.Linear(128, 128)
    for _ in range(steps):
        with mf.fp8_autocast(fp8_recipe=recipe):
            layer(torch.randn(128, 128) * scale).sum().backward()
    return layer


def _blob(t: torch.Tensor) -> dict:
    return torch.load(io.BytesIO(tensor_bytes(t)), weights_only=True)


@pytest.mark.parametrize("saved, ran", [(DelayedScaling(amax_history_len=4), CURRENT), (CURRENT, Float8BlockScaling())])
def test_a_checkpoint_loads_whole_into_a_model_that_ran_another_recipe(saved: object, ran: object) -> None:
    torch.manual_seed(0)
    src = torch.nn.Sequential(mf.Linear(256, 128), mf.Linear(128, 128))
    dst = torch.nn.Sequential(mf.Linear(256, 128), mf.Linear(128, 128))
    for model, recipe in ((src, saved), (dst, ran)):
        with mf.fp8_autocast(fp8_recipe=recipe):
            model(torch.randn(128, 256))
    dst.load_state_dict(src.state_dict())  # every layer loads; nothing raises halfway
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(src, dst))
    x = torch.randn(128, 256)
    with mf.fp8_autocast(fp8_recipe=saved):
        assert torch.equal(src(x), dst(x))  # dst resumes src, its state included


@pytest.mark.parametrize("saved, resumed", [(CURRENT, DelayedScaling()), (Float8BlockScaling(), MXFP8BlockScaling())])
def test_a_stateless_checkpoint_resumes_under_any_recipe(saved: object, resumed: object) -> None:
    layer = mf.Linear(128, 128)
    layer.load_state_dict(_trained(saved).state_dict())
    with mf.fp8_autocast(fp8_recipe=resumed):
        layer(torch.randn(128, 128))


def test_a_delayed_checkpoint_is_still_refused_under_another_recipe_and_kept_under_its_own_label() -> None:
    a, b = DelayedScaling(amax_history_len=4), DelayedScaling(amax_history_len=4, margin=4)
    src = _trained(a)
    layer = mf.Linear(128, 128)
    layer.load_state_dict(src.state_dict())
    with pytest.raises(ValueError, match=r"Linear: the FP8 state loaded from '_extra_state' is for DelayedScaling\("
                                         r"margin=0.*now runs DelayedScaling\(margin=4"):
        with mf.fp8_autocast(fp8_recipe=b):
            layer(torch.randn(128, 128))
    saved = _blob(layer.state_dict()["_extra_state"])  # the refused state, under its own recipe's name
    assert saved["recipe"] == a.describe()
    assert torch.equal(saved["quantizers"]["weight"]["input"]["amax_history"],
                       src._quantizers["weight"].input.amax_history)
    x = torch.randn(128, 128)
    with mf.fp8_autocast(fp8_recipe=a):  # and it resumes under that recipe
        assert torch.equal(layer(x), src(x))


def test_loading_a_checkpoint_without_fp8_state_makes_the_layer_fresh() -> None:
    """A checkpoint saved before any FP8 step: a trained layer rolled back to it computes what a
    fresh layer loading it computes (its old delayed-scaling history goes)."""
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    ckpt = mf.Linear(128, 128).state_dict()
    used, fresh = _trained(recipe, steps=3, scale=100.0), mf.Linear(128, 128)
    used.load_state_dict(ckpt)
    fresh.load_state_dict(ckpt)
    x = torch.randn(128, 128)
    for _ in range(2):
        with mf.fp8_autocast(fp8_recipe=recipe):
            assert torch.equal(used(x), fresh(x))


def test_fp8_state_is_saved_on_the_cpu_and_a_gpu_checkpoint_loads_without_one() -> None:
    src = _trained(DelayedScaling(amax_history_len=4))
    sd = src.state_dict()
    assert _blob(sd["_extra_state"])["quantizers"]["weight"]["input"]["scale"].device.type == "cpu"
    # the blob as a CUDA tensor's state writes it: the storage location cuda:0 in its pickle
    old = zipfile.ZipFile(io.BytesIO(tensor_bytes(sd["_extra_state"])))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as new:
        for info in old.infolist():
            data = old.read(info.filename)
            if info.filename.endswith("data.pkl"):
                assert b"X\x03\x00\x00\x00cpu" in data
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            new.writestr(info, data)
    layer = mf.Linear(128, 128)
    layer.load_state_dict({**sd, "_extra_state": torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)})
    x = torch.randn(128, 128)
    with mf.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4)):
        assert torch.equal(layer(x), src(x))


def _fresh_output(layer: mf.Linear, x: torch.Tensor) -> torch.Tensor:
    other = mf.Linear(layer.in_features, layer.out_features, params_dtype=layer.weight.dtype)
    other.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()}, strict=False)
    with mf.fp8_autocast(fp8_recipe=CURRENT):
        return other(x)


def test_the_cached_fp8_weight_goes_when_the_weight_is_loaded_or_moved() -> None:
    x = torch.randn(64, 128)
    layer, other = mf.Linear(128, 128), mf.Linear(128, 128)
    with mf.fp8_autocast(fp8_recipe=CURRENT):
        layer(x, is_first_microbatch=True)
    layer.load_state_dict(other.state_dict())
    with mf.fp8_autocast(fp8_recipe=CURRENT):
        assert torch.equal(layer(x, is_first_microbatch=False), _fresh_output(other, x))
    with mf.fp8_autocast(fp8_recipe=CURRENT):
        layer(x, is_first_microbatch=True)
    layer.to(torch.bfloat16)
    with mf.fp8_autocast(fp8_recipe=CURRENT):
        assert torch.equal(layer(x.bfloat16(), is_first_microbatch=False), _fresh_output(layer, x.bfloat16()))


def test_an_fp8_off_forward_leaves_megatrons_first_microbatch_flag_for_the_next_fp8_one() -> None:
    x = torch.randn(64, 128)
    layer = mf.Linear(128, 128)
    layer.is_first_microbatch = True
    with mf.fp8_autocast(fp8_recipe=CURRENT):
        layer(x)  # step 1: cast and kept
    with torch.no_grad():
        layer.weight.add_(1.0)  # the optimizer step
    layer.is_first_microbatch = True  # Megatron's set_is_first_microbatch() at step 2
    with mf.fp8_autocast(enabled=False):
        layer(x)
    with mf.fp8_autocast(fp8_recipe=CURRENT):
        assert torch.equal(layer(x), _fresh_output(layer, x))  # the updated weight, cast anew
    assert layer.is_first_microbatch is False


def _experts(n: int) -> ColumnParallelGroupedLinear:
    return ColumnParallelGroupedLinear(n, 32, 32, config=ParallelConfig(use_cpu_initialization=True), bias=False,
                                       skip_bias_add=False, is_expert=True)


def test_a_one_expert_layer_takes_the_state_of_the_expert_its_slot_holds() -> None:
    recipe = DelayedScaling(amax_history_len=4)
    a = _experts(2)  # expert parallelism 2: local experts 0 and 1
    for _ in range(2):
        with mf.fp8_autocast(fp8_recipe=recipe):
            a(torch.randn(16, 32), [8, 8])[0].sum().backward()
    b = _experts(1)  # expert parallelism 4: global expert 1 is this rank's only one
    b.load_state_dict({"weight0": a.weight1.detach(), "_extra_state": a.expert_extra_state(1)})
    with mf.fp8_autocast(fp8_recipe=recipe):
        b(torch.randn(8, 32), [8])
    hist_a, hist_b = a._quantizers["weight1"].input.amax_history, b._quantizers["weight0"].input.amax_history
    assert torch.equal(hist_b[1:], hist_a[:-1])  # b's history continues a's expert 1, one step on
    assert not (b._pending_state or {}).get("quantizers")


def test_per_expert_blobs_without_fp8_state_load() -> None:
    """Transformer Engine's grouped linear writes an empty tensor per expert without FP8."""
    a, b = _experts(2), _experts(2)
    empty = torch.empty(0, dtype=torch.uint8)
    b.load_state_dict({"weight0": a.weight0.detach(), "weight1": a.weight1.detach(), "_extra_state": empty,
                       "_extra_state1": empty})
    assert torch.equal(b.weight1, a.weight1)


def test_a_per_expert_blob_that_is_not_ours_names_its_key() -> None:
    b = _experts(2)
    with pytest.raises(ValueError, match=r"ColumnParallelGroupedLinear.*'_extra_state1' is not megatron_fp8 FP8"):
        b.load_state_dict({"weight0": b.weight0.detach(), "weight1": b.weight1.detach(),
                           "_extra_state1": torch.tensor([1, 2, 3], dtype=torch.uint8)})


@pytest.mark.parametrize("reentrant", [True, False])
def test_torch_checkpoint_recomputing_outside_the_fp8_region_raises_naming_ours(reentrant: bool) -> None:
    """torch.utils.checkpoint recomputes in backward, outside the FP8 region the forward ran in:
    the gradients would be high precision (reentrant) or a saved-tensor mismatch (non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    from megatron_fp8.recompute import checkpoint_layers

    layer = mf.Linear(64, 64, name="ckpt")
    x = torch.randn(16, 64, requires_grad=True)
    with mf.fp8_autocast(fp8_recipe=CURRENT):
        y = checkpoint(layer, x, use_reentrant=reentrant)
    with pytest.raises(RuntimeError, match=r"Linear\(ckpt\): its forward runs again inside a backward pass outside "
                                           r"every FP8 region.*checkpoint_layers"):
        y.sum().backward()
    ref = mf.Linear(64, 64)
    ref.load_state_dict(layer.state_dict())
    with mf.fp8_autocast(fp8_recipe=CURRENT):
        y, y_ref = checkpoint_layers(layer, x), ref(x)
    (y.sum() + y_ref.sum()).backward()
    assert torch.equal(layer.weight.grad, ref.weight.grad)  # ours recomputes in the forward's FP8 state
