"""Output-discarding recompute (megatron_fp8.recompute) and the blocks that use it.

Bitwise: every placement gives torch.equal losses and gradients (inputs and all parameters)
with and without the recompute, per recipe and with FP8 off, dropout inside the recomputed
function, two micro-batches of gradient accumulation. Exact: the saved-bytes accounting.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn

from megatron_fp8 import Linear, fp8_autocast
from megatron_fp8.blocks import ActivationFC2, MLAUpProjAttention, NormProjections, make_norm, swiglu
from megatron_fp8.memory import track_saved_tensors
from megatron_fp8.recipe import DelayedScaling, Float8CurrentScaling, Recipe
from megatron_fp8.recompute import (
    CheckpointWithoutOutput,
    DiscardedOutputError,
    MissingSaveOriginalInputError,
    recompute_discarding_output,
)
from megatron_fp8.recompute.guard import _ModuleWatch

H, FFN, S, B = 128, 128, 64, 2  # multiples of 128 tokens/features: every recipe's block fits
DT = torch.bfloat16


def _lin(i: int, o: int, flag: bool = True) -> Linear:
    return Linear(i, o, params_dtype=DT, save_original_input=flag)


def _norm_drop(kind: str) -> nn.Module:
    return nn.Sequential(make_norm(kind, H, dtype=DT), nn.Dropout(0.1))


# Each placement: (block builder taking recompute, input shapes).
PLACEMENTS: dict[str, tuple[Callable[[bool], nn.Module], list[tuple[int, ...]]]] = {
    "input_ln->qkv": (
        lambda r: NormProjections(_norm_drop("layernorm"), [_lin(H, 3 * H)], recompute=r),
        [(S, B, H)],
    ),
    "input_ln->mla_q_down+kv_down": (
        lambda r: NormProjections(_norm_drop("rmsnorm"), [_lin(H, 128), _lin(H, 256)], recompute=r),
        [(S, B, H)],
    ),
    "pre_mlp_ln->dense_fc1": (
        lambda r: NormProjections(_norm_drop("layernorm"), [_lin(H, 2 * FFN)], recompute=r),
        [(S, B, H)],
    ),
    "pre_mlp_ln->shared_fc1+router": (
        lambda r: NormProjections(make_norm("rmsnorm", H, dtype=DT),
                                  [nn.Linear(H, 8, dtype=DT), _lin(H, 2 * FFN)], recompute=r),
        [(S, B, H)],
    ),
    "moe_act->fc2": (
        lambda r: ActivationFC2(_lin(FFN, H), activation=swiglu, dropout=0.1, recompute=r),
        [(S * B, 2 * FFN)],
    ),
    "mla_up_proj->attn_proj": (
        lambda r: MLAUpProjAttention(128, 128, heads=2, head_dim=64, hidden=H, recompute=r, params_dtype=DT),
        [(S, B, 128), (S, B, 128)],
    ),
}


def _outputs(out: object) -> list[torch.Tensor]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _loss(out: object, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in _outputs(out))  # type: ignore[return-value]


def _train(block: nn.Module, inputs: list[list[torch.Tensor]], recipe: Recipe | None,
           order: str = "accumulate") -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, torch.Tensor]]:
    """Micro-batches through ``block``; ``order``: ``accumulate`` (fwd, bwd, fwd, bwd) or
    ``pipeline`` (fwd, fwd, bwd, bwd). Returns losses, input grads, parameter grads."""
    torch.manual_seed(7)
    xs = [[x.clone().requires_grad_() for x in mb] for mb in inputs]
    losses = []
    for i, mb in enumerate(xs):
        with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            losses.append(_loss(block(*mb), seed=i))
        if order == "accumulate":
            losses[-1].backward()
    if order == "pipeline":
        for loss in losses:
            loss.backward()
    grads = {n: p.grad for n, p in block.named_parameters()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    return [loss.detach() for loss in losses], [x.grad for mb in xs for x in mb], grads


def _assert_bitwise(placement: str, recipe: Recipe | None, order: str = "accumulate") -> None:
    build, shapes = PLACEMENTS[placement]
    torch.manual_seed(0)
    ref_block = build(False)
    rec_block = build(True)
    rec_block.load_state_dict(ref_block.state_dict())
    inputs = [[torch.randn(s, dtype=DT) for s in shapes] for _ in range(2)]
    ref = _train(ref_block, inputs, recipe, order)
    rec = _train(rec_block, inputs, recipe, order)
    for a, b in zip(ref[0], rec[0]):
        assert torch.equal(a, b), (placement, a, b)
    for a, b in zip(ref[1], rec[1]):
        assert torch.equal(a, b), f"{placement}: input grad differs"
    assert ref[2].keys() == rec[2].keys()
    for name in ref[2]:
        assert torch.equal(ref[2][name], rec[2][name]), f"{placement}: grad of {name} differs"


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_placement_bitwise_per_recipe(placement: str, recipe: Recipe) -> None:
    _assert_bitwise(placement, recipe)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_placement_bitwise_fp8_off(placement: str) -> None:
    _assert_bitwise(placement, None)


@pytest.mark.parametrize("placement", ["mla_up_proj->attn_proj", "moe_act->fc2"])
def test_pipelined_microbatches_delayed_scaling(placement: str) -> None:
    """Both forwards before both backwards: the first recompute runs after the second FP8 step
    began; it must cast with its own step's delayed scales (MLA: FP8 linears inside fn)."""
    _assert_bitwise(placement, DelayedScaling(amax_history_len=4), order="pipeline")


def test_recompute_leaves_delayed_history_untouched() -> None:
    torch.manual_seed(0)
    ref, rec = MLAUpProjAttention(128, 128, 2, 64, H, params_dtype=DT), None
    rec = copy.deepcopy(ref)
    rec.recompute = True
    inputs = [[torch.randn(S, B, 128, dtype=DT) for _ in range(2)] for _ in range(2)]
    recipe = DelayedScaling(amax_history_len=4)
    _train(ref, inputs, recipe, order="pipeline")
    _train(rec, inputs, recipe, order="pipeline")
    for name in ("q_up", "kv_up"):
        for role in ("input", "weight"):
            qa = getattr(getattr(ref, name)._quantizers["weight"], role)
            qb = getattr(getattr(rec, name)._quantizers["weight"], role)
            assert torch.equal(qa.amax_history, qb.amax_history) and torch.equal(qa.scale, qb.scale)


# ---- saved-bytes accounting ----


def test_accounting_layernorm_output_discarded_exactly() -> None:
    """[4096, 2, 1024] bf16 layernorm output: exactly 16 MiB gone at the end of forward."""
    hidden = 1024
    torch.manual_seed(0)
    norm = make_norm("layernorm", hidden, dtype=DT)
    lin = Linear(hidden, 128, bias=False, params_dtype=DT, save_original_input=True)
    x = torch.randn(4096, 2, hidden, dtype=DT, requires_grad=True)
    out_bytes = x.numel() * 2
    assert out_bytes == 16 * 2**20

    def forward(recompute: bool) -> tuple[int, int, int, torch.Tensor]:
        block = NormProjections(norm, [lin], recompute=recompute)
        with track_saved_tensors(block) as saved, fp8_autocast(fp8_recipe=Float8CurrentScaling()):
            (y,) = block(x)
        stats = sum(r.nbytes for r in saved.records if r.shape == (4096, 2, 1))  # norm mean, rstd
        return saved.activation_bytes, saved.live_bytes(), stats, y

    base_recorded, base_live, base_stats, _ = forward(False)
    rec_recorded, rec_live, rec_stats, y = forward(True)
    assert base_recorded == base_live  # nothing freed without recompute
    assert rec_recorded - rec_live == out_bytes  # the discarded norm output, to the byte
    # vs. no recompute: the norm output and the norm's own statistics are not kept
    assert base_stats == 2 * 4096 * 2 * torch.empty((), dtype=DT).element_size() and rec_stats == 0
    assert base_live - rec_live == out_bytes + base_stats
    y.float().sum().backward()  # the recompute refills the storage; backward completes
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


# bytes each placement discards (bf16): norm outputs, the activation output, MLA q + k + v
DISCARDED_BYTES = {
    "input_ln->qkv": S * B * H * 2,
    "input_ln->mla_q_down+kv_down": S * B * H * 2,
    "pre_mlp_ln->dense_fc1": S * B * H * 2,
    "pre_mlp_ln->shared_fc1+router": S * B * H * 2,
    "moe_act->fc2": S * B * FFN * 2,
    "mla_up_proj->attn_proj": 3 * S * B * 128 * 2,
}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_each_placement_frees_its_output(placement: str) -> None:
    build, shapes = PLACEMENTS[placement]
    block = build(True)
    xs = [torch.randn(s, dtype=DT, requires_grad=True) for s in shapes]
    with track_saved_tensors(block) as saved, fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        out = block(*xs)
    assert saved.activation_bytes - saved.live_bytes() == DISCARDED_BYTES[placement]
    _loss(out, 0).backward()
    assert all(x.grad is not None for x in xs)


def test_consumer_without_flag_fails_loudly_and_saves_nothing() -> None:
    norm = make_norm("layernorm", H, dtype=DT)
    lin = _lin(H, H, flag=False)
    x = torch.randn(S, B, H, dtype=DT, requires_grad=True)
    ckpt = CheckpointWithoutOutput("input_layernorm")
    with track_saved_tensors() as saved, fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        h = ckpt.checkpoint(norm, x)
        y = lin(h)
    # the consumer saved its own FP8 copy: no saved storage is the norm output's
    key = h.untyped_storage()._cdata
    assert all(r.storage._cdata != key for r in saved.records)
    live = saved.live_bytes()
    with pytest.raises(MissingSaveOriginalInputError, match=r"Linear .*save_original_input=True"):
        ckpt.discard_output_and_register_recompute(y)
    assert saved.live_bytes() == live and h.untyped_storage().nbytes() == h.numel() * 2  # not freed
    assert ckpt.state == "checkpointed"
    y.float().sum().backward()  # still trains: the checkpoint replays in its own backward
    assert x.grad is not None and norm.weight.grad is not None


def test_consumer_without_flag_fails_with_fp8_off_too() -> None:
    """Documented choice: the flag is checked regardless of FP8 (no failure when FP8 turns on)."""
    ckpt = CheckpointWithoutOutput("pre_mlp_layernorm")
    x = torch.randn(4, H, requires_grad=True)
    y = Linear(H, H)(ckpt.checkpoint(nn.LayerNorm(H), x))
    with pytest.raises(MissingSaveOriginalInputError, match="pre_mlp_layernorm"):
        ckpt.discard_output_and_register_recompute(y)


def test_consumer_reading_the_output_by_keyword_is_checked_too() -> None:
    ckpt = CheckpointWithoutOutput("pre_mlp_layernorm")
    x = torch.randn(4, H, requires_grad=True)
    y = Linear(H, H)(x=ckpt.checkpoint(nn.LayerNorm(H), x))
    with pytest.raises(MissingSaveOriginalInputError, match="pre_mlp_layernorm"):
        ckpt.discard_output_and_register_recompute(y)


def test_block_rejects_consumer_without_flag_at_construction() -> None:
    with pytest.raises(MissingSaveOriginalInputError, match="ActivationFC2.*Linear.*save_original_input=True"):
        ActivationFC2(_lin(FFN, H, flag=False), recompute=True)
    with pytest.raises(MissingSaveOriginalInputError, match="NormProjections"):
        NormProjections(nn.LayerNorm(H), [_lin(H, H), _lin(H, H, flag=False)], recompute=True)
    NormProjections(nn.LayerNorm(H), [_lin(H, H, flag=False)], recompute=False)  # fine without


def test_generic_consumer_check_uses_the_attribute() -> None:
    """Any module with a ``save_original_input`` attribute is checked (parallel/grouped linears)."""

    class Grouped(nn.Module):
        save_original_input = False

        def forward(self, x: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
            return x * 2

    ckpt = CheckpointWithoutOutput("moe_act")
    x = torch.randn(4, 8, requires_grad=True)
    y = Grouped()(ckpt.checkpoint(torch.nn.functional.gelu, x), [4])
    with pytest.raises(MissingSaveOriginalInputError, match="Grouped"):
        ckpt.discard_output_and_register_recompute(y)


# ---- safety ----


def _discarded(name: str = "ln") -> tuple[CheckpointWithoutOutput, torch.Tensor, torch.Tensor, Linear]:
    norm, lin = nn.LayerNorm(H), Linear(H, H, save_original_input=True)
    ckpt = CheckpointWithoutOutput(name)
    h = ckpt.checkpoint(norm, torch.randn(4, H, requires_grad=True))
    view = h[:2]
    y = lin(h)
    ckpt.discard_output_and_register_recompute(y)
    return ckpt, h, view, y


def test_forward_reading_discarded_output_raises() -> None:
    ckpt, h, view, _ = _discarded("input_layernorm")
    assert ckpt.state == "discarded" and h.untyped_storage().nbytes() == 0
    with pytest.raises(DiscardedOutputError, match=r"torch op 'add' reads the output of 'input_layernorm'"):
        h + 1
    with pytest.raises(DiscardedOutputError, match="module Linear reads the output of 'input_layernorm'"):
        Linear(H, H)(h)
    with pytest.raises(DiscardedOutputError, match="input_layernorm"):
        view.sum()  # a view made before the discard is guarded too
    with pytest.raises(DiscardedOutputError):
        repr(h)
    assert h.shape == (4, H) and h.dtype == torch.float32  # metadata stays readable


def test_output_readable_again_after_recompute() -> None:
    torch.manual_seed(3)
    norm, lin = nn.LayerNorm(H), Linear(H, H, save_original_input=True)
    x = torch.randn(4, H, requires_grad=True)
    expected = norm(x).detach()
    ckpt = CheckpointWithoutOutput()
    h = ckpt.checkpoint(norm, x)
    y = lin(h)
    ckpt.discard_output_and_register_recompute(y)
    y.sum().backward()
    assert ckpt.state == "recomputed" and torch.equal(h.detach(), expected)


def test_recompute_runs_once_with_several_hook_tensors() -> None:
    calls = []
    norm = nn.LayerNorm(H)

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        return norm(x)

    a, b = Linear(H, H, save_original_input=True), Linear(H, H, save_original_input=True)
    x = torch.randn(4, H, requires_grad=True)
    out = recompute_discarding_output(fn, [x], lambda h: (a(h), b(h)))
    (out[0].sum() + out[1].sum()).backward()
    assert calls == [False, True]  # the forward (no graph) and exactly one recompute
    del out
    gc.collect()
    assert _ModuleWatch.users == 0 and _ModuleWatch.handles == []  # the global hooks are gone


def test_branch_without_grad_frees_saved_inputs() -> None:
    norm, lin = nn.LayerNorm(H), Linear(H, H, save_original_input=True)
    base = torch.randn(4, H, requires_grad=True)
    x = base * 2  # a non-leaf input: only the checkpoint would keep it alive
    ref = weakref.ref(x)
    ckpt = CheckpointWithoutOutput()
    h = ckpt.checkpoint(norm, x)
    y = lin(h).detach()  # this branch carries no grad: the hook can never fire
    ckpt.discard_output_and_register_recompute(y)
    assert ckpt.state == "released"
    del x, h, y
    gc.collect()
    assert ref() is None


def test_step_without_backward_frees_saved_inputs() -> None:
    norm, lin = nn.LayerNorm(H), Linear(H, H, save_original_input=True)
    x = torch.randn(4, H, requires_grad=True) * 2
    ref = weakref.ref(x)
    ckpt = CheckpointWithoutOutput()
    y = lin(ckpt.checkpoint(norm, x))
    ckpt.discard_output_and_register_recompute(y)
    del x, y  # e.g. an evaluation step with grad on, or a dropped micro-batch
    gc.collect()
    assert ref() is None and ckpt.state == "released"


def test_no_grad_evaluation_is_a_noop() -> None:
    torch.manual_seed(0)
    build, shapes = PLACEMENTS["input_ln->qkv"]
    ref, rec = build(False), build(True)
    rec.load_state_dict(ref.state_dict())
    ref.eval(), rec.eval()
    x = torch.randn(shapes[0], dtype=DT)
    with torch.no_grad():
        (a,), (b,) = ref(x), rec(x)
    assert torch.equal(a, b)
    ckpt = CheckpointWithoutOutput()
    with torch.no_grad():
        h = ckpt.checkpoint(nn.LayerNorm(H), torch.randn(2, H))
        ckpt.discard_output_and_register_recompute(Linear(H, H)(h))
    assert ckpt.state == "eager" and type(h) is torch.Tensor and h.untyped_storage().nbytes() > 0


def test_misuse_errors() -> None:
    ckpt = CheckpointWithoutOutput("ident")
    x = torch.randn(4, H, requires_grad=True)
    with pytest.raises(ValueError, match="shares storage with an input"):
        ckpt.checkpoint(lambda t: t[:2], x)
    ckpt = CheckpointWithoutOutput("ln")
    h = ckpt.checkpoint(nn.LayerNorm(H), x)
    with pytest.raises(ValueError, match="output of the checkpoint itself"):
        ckpt.discard_output_and_register_recompute(h)
    with pytest.raises(RuntimeError, match="one-shot"):
        ckpt.checkpoint(nn.LayerNorm(H), x)


# ---- checkpoint_layers: megatron-core's layer recompute under FP8 (recompute/layers.py) ----
def test_checkpoint_layers_equals_plain_backward_and_keeps_a_returned_parameter_a_leaf() -> None:
    """A block with dropout and an FP8 linear, returning its bias as it is (a row linear with
    skip_bias_add does): outputs and every gradient bitwise those of the plain block; the bias
    stays a leaf (autograd would otherwise make the parameter an output of the checkpoint, and its
    backward would call itself without end)."""
    from megatron_fp8.recompute import checkpoint_layers

    torch.manual_seed(0)
    lin = Linear(64, 64, bias=False)
    bias = torch.nn.Parameter(torch.randn(64))

    def block(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.nn.functional.dropout(lin(t), 0.3), bias

    x = torch.randn(16, 64)
    results = []
    for ckpt in (False, True):
        xi = x.clone().requires_grad_()
        lin.zero_grad()
        bias.grad = None
        torch.manual_seed(1)
        with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
            out, b = checkpoint_layers(block, xi) if ckpt else block(xi)
        assert b.is_leaf == (not ckpt) and bias.is_leaf and bias.grad_fn is None
        ((out + b) ** 2).sum().backward()
        results.append((out.detach(), xi.grad, lin.weight.grad.clone(), bias.grad.clone()))
    for a, b_ in zip(*results):
        assert torch.equal(a, b_)


def test_checkpoint_layers_gives_parameters_gradients_without_input_grads_and_refuses_autograd_grad() -> None:
    from megatron_fp8.recompute import checkpoint_layers

    lin = torch.nn.Linear(8, 8)
    checkpoint_layers(lin, torch.randn(4, 8)).sum().backward()  # no input needs grad: an anchor does
    assert lin.weight.grad is not None and lin.bias.grad is not None
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"needs \.backward\(\)"):
        torch.autograd.grad(checkpoint_layers(lin, x).sum(), x)
