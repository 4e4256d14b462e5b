"""MoE on the FP8 layers: GroupedMLP vs per-expert Linear MLPs (bitwise), the shared experts'
memory win next to the router (exact bytes from shapes), and clear errors.

Bitwise (torch.equal): GroupedMLP out / dx / every expert's dw vs one Linear fc1 -> act -> fc2
per expert, per recipe and activation; MoELayer outputs and grads with the shared experts'
flag on vs off, and with recompute of the pre-MLP norm vs without.
"""

from __future__ import annotations

import pytest
import torch

import megatron_fp8 as mf
from megatron_fp8.moe import ACTIVATIONS, GroupedMLP, MoELayer, num_local_experts
from megatron_fp8.recompute import MissingSaveOriginalInputError

from .conftest import RECIPES

H, FFN = 128, 128
SPLITS = [128, 0, 256, 128]  # multiples of every block: each expert has a plain-Linear twin


def _reference_mlp(mlp: GroupedMLP, i: int, act: str) -> tuple[mf.Linear, mf.Linear]:
    fn, width = ACTIVATIONS[act]
    fc1, fc2 = mf.Linear(H, width * FFN, bias=False), mf.Linear(FFN, H, bias=False)
    with torch.no_grad():
        fc1.weight.copy_(mlp.linear_fc1.weights[i])
        fc2.weight.copy_(mlp.linear_fc2.weights[i])
    return fc1, fc2


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_mlp_equals_per_expert_linear_mlps(name: str, act: str) -> None:
    recipe = RECIPES[name]
    mlp = GroupedMLP(len(SPLITS), H, FFN, activation=act)
    x = torch.randn(sum(SPLITS), H, requires_grad=True)
    dy = torch.randn(sum(SPLITS), H)
    with mf.fp8_autocast(fp8_recipe=recipe):
        y, bias = mlp(x, torch.tensor(SPLITS))
    y.backward(dy)
    assert bias is None
    fn = ACTIVATIONS[act][0]
    for i, (xi, di) in enumerate(zip(x.detach().split(SPLITS), dy.split(SPLITS))):
        fc1, fc2 = _reference_mlp(mlp, i, act)
        xr = xi.clone().requires_grad_()
        with mf.fp8_autocast(fp8_recipe=recipe):
            yr = fc2(fn(fc1(xr)))
        yr.backward(di)
        assert torch.equal(y.detach().split(SPLITS)[i], yr)
        assert torch.equal(x.grad.split(SPLITS)[i], xr.grad)
        assert torch.equal(mlp.linear_fc1.weights[i].grad, fc1.weight.grad)
        assert torch.equal(mlp.linear_fc2.weights[i].grad, fc2.weight.grad)


# ---- the shared experts next to the router: exact bytes -----------------------------------------
T = 256  # tokens through the pre-MLP norm (a multiple of every block)


def _col_copy_bytes(name: str, m: int, k: int) -> int:
    """A columnwise FP8 copy of an ``[m, k]`` input: data plus scales (blocks along m)."""
    scales = {"delayed": 4, "current": 4, "block": k * (m // 128) * 4, "mxfp8": k * (m // 32)}[name]
    return m * k + scales


def _moe_step(flag: bool, recipe, recompute: bool = False) -> tuple[list[torch.Tensor], mf.memory.SavedTensors, int]:
    torch.manual_seed(0)
    layer = MoELayer(H, FFN, 4, topk=2, shared_ffn_hidden_size=FFN, params_dtype=torch.bfloat16,
                     shared_save_original_input=flag, recompute_norm=recompute)
    torch.manual_seed(1)
    x = torch.randn(T // 2, 2, H, dtype=torch.bfloat16, requires_grad=True)
    with mf.memory.track_saved_tensors(layer) as saved, mf.fp8_autocast(fp8_recipe=recipe):
        y, _ = layer(x)
    live = saved.live_bytes()
    y.float().square().sum().backward()
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    return [y, *grads], saved, live


@pytest.mark.parametrize("name", list(RECIPES))
def test_shared_experts_flag_drops_exactly_the_columnwise_copy(name: str) -> None:
    recipe = RECIPES[name]
    (off, saved_off, _), (on, saved_on, _) = _moe_step(False, recipe), _moe_step(True, recipe)
    for a, b in zip(off, on):
        assert torch.equal(a, b)
    per_tensor_scale = 4 if name in ("delayed", "current") else 0
    fc1 = "norm_mlp.projections.1.linear_fc1"
    by_off, by_on = saved_off.by_module(activations_only=True), saved_on.by_module(activations_only=True)
    assert by_off[fc1] == _col_copy_bytes(name, T, H)
    assert by_on.get(fc1, 0) == per_tensor_scale  # the norm output is the router's saved storage
    assert by_on["norm_mlp.projections.0.router"] >= T * H * 2  # h itself (bf16), saved by the router
    drop = saved_off.activation_bytes - saved_on.activation_bytes
    assert drop == _col_copy_bytes(name, T, H) - per_tensor_scale
    assert {k: v for k, v in by_off.items() if k != fc1} == {k: v for k, v in by_on.items() if k != fc1}


@pytest.mark.parametrize("name", ["current", "block"])
def test_recomputed_norm_is_bitwise_and_frees_the_norm_output(name: str) -> None:
    (plain, _, live_plain), (recomputed, _, live_rec) = (_moe_step(True, RECIPES[name]),
                                                        _moe_step(True, RECIPES[name], True))
    for a, b in zip(plain, recomputed):
        assert torch.equal(a, b)
    assert live_plain - live_rec >= T * H * 2  # the bf16 norm output is gone until backward
    with pytest.raises(MissingSaveOriginalInputError, match="save_original_input=False"):
        MoELayer(H, FFN, 4, shared_ffn_hidden_size=FFN, shared_save_original_input=False, recompute_norm=True)


def test_recomputed_activation_is_bitwise() -> None:
    res = []
    for recompute in (False, True):
        torch.manual_seed(0)
        mlp = GroupedMLP(4, H, FFN, recompute_activation=recompute)
        x = torch.randn(sum(SPLITS), H, requires_grad=True)
        with mf.fp8_autocast(fp8_recipe=RECIPES["block"]):
            y, _ = mlp(x, SPLITS)
        y.sum().backward()
        res.append([y, x.grad, *(p.grad for p in mlp.parameters())])
    assert mlp.linear_fc2.save_original_input
    for a, b in zip(*res):
        assert torch.equal(a, b)


# ---- bad input ----------------------------------------------------------------------------------
def test_expert_count_not_divisible_by_ep_size_is_a_clear_error() -> None:
    assert num_local_experts(8, 4) == 2
    with pytest.raises(ValueError, match=r"GroupedMLP\(experts\): num_experts=6 is not divisible by the "
                                         r"expert-parallel size 4; choose a number of experts"):
        GroupedMLP(6, H, FFN, expert_parallel_size=4)


def test_bad_activation_and_tokens_per_expert() -> None:
    with pytest.raises(ValueError, match=r"activation='relu6'; choose one of \['gelu', 'swiglu'\]"):
        GroupedMLP(2, H, FFN, activation="relu6")
    mlp = GroupedMLP(2, H, FFN)
    with pytest.raises(ValueError, match=r"GroupedLinear\(experts.linear_fc1\): m_splits has 3 entries"):
        mlp(torch.randn(6, H), [2, 2, 2])
