"""Edge cases found in review: threads, checkpoint round trips, shapes, accounting, dtypes."""

from __future__ import annotations

import re
import threading

import pytest
import torch
from torch import nn

import megatron_fp8 as mf
from megatron_fp8 import gemm as core
from megatron_fp8.parallel import ColumnParallelLinear, ParallelConfig
from megatron_fp8.parallel.grouped import ColumnParallelGroupedLinear
from megatron_fp8.quant.formats import ScaleLayout
from megatron_fp8.recipe import DelayedScaling


def test_delayed_grad_scale_advances_when_backward_runs_on_another_thread() -> None:
    """Autograd runs CUDA backward passes on worker threads: the FP8 step must be process-wide."""
    layer = mf.Linear(64, 64, params_dtype=torch.float32)
    recipe = DelayedScaling(amax_history_len=4)
    for _ in range(3):
        with mf.fp8_autocast(fp8_recipe=recipe):
            y = layer(torch.randn(32, 64, requires_grad=True))
        t = threading.Thread(target=lambda y=y: (y * 1e-3).sum().backward())
        t.start()
        t.join()
    q = layer._quantizers["weight"].grad_output
    assert q.step == mf.autocast.fp8_step() and q.scale.item() != 1.0  # rolled and rescaled


def test_gemm_records_reach_backward_on_another_thread() -> None:
    layer = mf.Linear(128, 128)
    with mf.fp8_autocast(fp8_recipe=mf.recipe.Float8BlockScaling()):
        y = layer(torch.randn(128, 128, requires_grad=True))
    with core.record_gemms() as calls:
        t = threading.Thread(target=lambda: y.sum().backward())
        t.start()
        t.join()
    assert [c.name for c in calls] == ["dgrad", "wgrad"]


def test_loaded_fp8_state_survives_a_save_before_any_forward() -> None:
    recipe = DelayedScaling(amax_history_len=4)
    a = mf.Linear(64, 64)
    for _ in range(2):
        with mf.fp8_autocast(fp8_recipe=recipe):
            a(torch.randn(16, 64)).sum().backward()
    b, c = mf.Linear(64, 64), mf.Linear(64, 64)
    b.load_state_dict(a.state_dict())
    c.load_state_dict(b.state_dict())  # b never ran a forward
    x = torch.randn(16, 64)
    with mf.fp8_autocast(fp8_recipe=recipe):
        ya, yc = a(x), c(x)
    assert torch.equal(ya, yc)
    assert torch.equal(a._quantizers["weight"].input.amax_history, c._quantizers["weight"].input.amax_history)


def test_external_weight_is_not_registered_as_a_parameter() -> None:
    cfg = ParallelConfig(use_cpu_initialization=True)
    layer = ColumnParallelLinear(64, 64, config=cfg, bias=False, skip_weight_param_allocation=True)
    w = nn.Parameter(torch.randn(64, 64))
    with mf.fp8_autocast(fp8_recipe=mf.recipe.Float8CurrentScaling()):
        layer(torch.randn(8, 64), weight=w)
    assert [n for n, _ in layer.named_parameters()] == []
    assert set(layer.state_dict()) <= {"_extra_state"}


def test_expert_fp8_state_follows_its_slot_when_resharded() -> None:
    """Global experts 2 and 3 of a 4-expert layer loaded as local experts 0 and 1."""
    cfg, recipe = ParallelConfig(use_cpu_initialization=True), DelayedScaling(amax_history_len=4)
    kw = dict(config=cfg, bias=False, skip_bias_add=False, is_expert=True)
    a = ColumnParallelGroupedLinear(4, 32, 32, **kw)
    with mf.fp8_autocast(fp8_recipe=recipe):
        a(torch.randn(16, 32), [4, 4, 4, 4])[0].sum().backward()
    b = ColumnParallelGroupedLinear(2, 32, 32, **kw)
    sd = {"weight0": a.weight2.detach(), "weight1": a.weight3.detach(),
          "_extra_state": a.expert_extra_state(2), "_extra_state1": a.expert_extra_state(3)}
    b.load_state_dict(sd)
    with mf.fp8_autocast(fp8_recipe=recipe):
        b(torch.randn(8, 32), [4, 4])
    for local, glob in ((0, 2), (1, 3)):
        hist_a = a._quantizers[f"weight{glob}"].input.amax_history
        hist_b = b._quantizers[f"weight{local}"].input.amax_history
        assert torch.equal(hist_b[1:], hist_a[:-1])  # b's history continues a's, one step on


def test_unaligned_per_tensor_gemm_is_emulated_on_cuda(monkeypatch) -> None:
    monkeypatch.setattr(core, "native_supported", lambda a, b, d: True)
    cuda, t = torch.device("cuda"), ScaleLayout.TENSOR
    assert core.select_backend(t, t, cuda, (128, 256, 512)) is core.Backend.NATIVE
    assert core.select_backend(t, t, cuda, (5, 256, 512)) is core.Backend.EMULATE  # e.g. an expert with 5 tokens
    with core.force_backend("native"), pytest.raises(RuntimeError, match=r"\(5, 256, 512\).*multiples of 16"):
        core.select_backend(t, t, cuda, (5, 256, 512))


def test_parameters_saved_through_views_count_as_parameters() -> None:
    lin = nn.Linear(64, 32, bias=False)  # F.linear saves weight.t()
    x = torch.randn(8, 64, requires_grad=True)
    with mf.memory.track_saved_tensors() as saved:
        lin(x)
    assert saved.parameter_bytes == 64 * 32 * 4 and saved.activation_bytes == 8 * 64 * 4


def test_bias_grad_is_summed_in_fp32_and_has_the_bias_dtype() -> None:
    layer = mf.Linear(64, 64, params_dtype=torch.float32)
    x = torch.randn(4096, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4096, 64, dtype=torch.bfloat16)
    layer(x).backward(dy)
    assert layer.bias.grad.dtype == torch.float32
    assert torch.equal(layer.bias.grad, dy.float().sum(0))


def _sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    return 10 * torch.log10(want.double().pow(2).sum() / (got.double() - want.double()).pow(2).sum()).item()


@pytest.mark.parametrize("recipe", [mf.recipe.Float8BlockScaling(), mf.recipe.MXFP8BlockScaling()],
                         ids=["blockwise", "mxfp8"])
def test_any_token_count_under_block_recipes(recipe: object) -> None:
    """Block recipes scale the wgrad copies along the tokens (1x128 / 1x32); a count that is not a
    multiple is padded with zero rows inside the layer (as Transformer Engine's Linear takes any
    count): 1, 17 and 1872 tokens train, as accurately as an aligned count (SQNR within 1.5 dB of
    2048 tokens'), with the flag on == off bitwise."""
    sqnr = {}
    for tokens in (1, 17, 1872, 2048):
        runs = []
        for flag in (False, True):
            torch.manual_seed(0)
            layer = mf.Linear(256, 128, name="decoder.layers.0.mlp.linear_fc2", save_original_input=flag)
            x = torch.randn(tokens, 256, requires_grad=True)
            with mf.fp8_autocast(fp8_recipe=recipe):
                y = layer(x)
            y.backward(torch.linspace(-1, 1, 128).expand(tokens, 128))
            runs.append((y.detach(), x.grad, layer.weight.grad))
        for got, want in zip(runs[1], runs[0]):
            assert torch.equal(got, want)
        assert runs[0][0].shape == (tokens, 128)
        ref = x.detach() @ layer.weight.detach().t() + layer.bias.detach()
        sqnr[tokens] = _sqnr_db(runs[0][0], ref)
    assert all(v > sqnr[2048] - 1.5 for v in sqnr.values()), sqnr


def test_token_blocked_casts_under_tensor_parallel_sequence_shards_still_fail_with_the_rule() -> None:
    """Under sequence parallelism padding would interleave the gathered shards: the shape check
    names the rule instead (the unaligned count of tokens for the weight gradient)."""
    from megatron_fp8.ops.linear import _token_padding

    class _Comm:  # a column layer's hooks under sequence parallelism
        sequence_parallel = True

    layer = mf.Linear(256, 256)
    with mf.fp8_autocast(fp8_recipe=mf.recipe.Float8BlockScaling()):
        q = layer.fp8_quantizers("weight")
    assert _token_padding(torch.randn(100, 256), q, None) == 28
    assert _token_padding(torch.randn(100, 256), q, _Comm()) == 0  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tokens .* is 100, which must be a multiple of the block size 128"):
        q.input.check_shape((100, 256), rowwise=False, columnwise=True)


def test_no_wgrad_no_token_blocked_cast() -> None:
    """Without a weight gradient (inference, frozen weight) no copy is blocked along the tokens:
    nothing is padded and nothing of x is kept."""
    recipe = mf.recipe.Float8BlockScaling()
    layer = mf.Linear(256, 256)
    with torch.no_grad(), mf.fp8_autocast(fp8_recipe=recipe):
        assert layer(torch.randn(100, 256)).shape == (100, 256)
    layer.weight.requires_grad_(False)
    x = torch.randn(100, 256, requires_grad=True)
    with mf.memory.track_saved_tensors() as saved, mf.fp8_autocast(fp8_recipe=recipe):
        y = layer(x)
    y.sum().backward()  # dgrad only: no token-blocked cast needed
    assert x.grad is not None and saved.activation_bytes == 0  # nothing of x kept for a wgrad


def test_fp8_group_must_contain_the_tp_group(monkeypatch) -> None:
    tp, other = object(), object()
    ranks = {id(tp): [0, 1], id(other): [0, 2]}
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda g: ranks[id(g)])
    layer = ColumnParallelLinear(64, 64, config=ParallelConfig(use_cpu_initialization=True), bias=False)
    layer.tp_group = tp
    with pytest.raises(ValueError, match=r"fp8_group=\.\.\.\) lacks tensor-parallel ranks \[1\]"):
        layer._check_contains_tp(other)
    ranks[id(other)] = [0, 1, 2, 3]
    layer._check_contains_tp(other)  # a data+TP group is fine


def test_recipe_change_warns_when_it_drops_delayed_history() -> None:
    layer = mf.Linear(128, 128, name="proj")
    with mf.fp8_autocast(fp8_recipe=DelayedScaling()):
        layer(torch.randn(128, 128))
    with pytest.warns(RuntimeWarning, match=r"Linear\(proj\): the FP8 recipe changed .* history is dropped"):
        with mf.fp8_autocast(fp8_recipe=mf.recipe.Float8BlockScaling()):
            layer(torch.randn(128, 128))


def test_wgrad_fusion_setting_overrides_the_config(monkeypatch) -> None:
    """``MEGATRON_FP8_WGRAD_FUSION=on`` makes a parallel layer add its wgrad into ``main_grad``
    (Megatron's DDP then skips its own add: ``grad_added_to_main_grad``) whatever the config
    says; ``config`` follows ``gradient_accumulation_fusion``; anything else raises."""
    cfg = ParallelConfig(use_cpu_initialization=True)
    assert not ColumnParallelLinear(64, 32, config=cfg, bias=False).gradient_accumulation_fusion
    monkeypatch.setenv("MEGATRON_FP8_WGRAD_FUSION", "on")
    layer = ColumnParallelLinear(64, 32, config=cfg, bias=False)
    assert layer.gradient_accumulation_fusion
    layer.weight.main_grad = torch.zeros(32, 64)
    layer.weight.grad_added_to_main_grad = False
    x = torch.randn(16, 64)
    with mf.fp8_autocast(fp8_recipe=mf.recipe.Float8CurrentScaling()):
        layer(x)[0].sum().backward()
    assert layer.weight.grad_added_to_main_grad and layer.weight.main_grad.abs().sum() > 0
    monkeypatch.setenv("MEGATRON_FP8_WGRAD_FUSION", "off")
    assert not ColumnParallelLinear(64, 32, config=ParallelConfig(gradient_accumulation_fusion=True),
                                    bias=False).gradient_accumulation_fusion
    monkeypatch.setenv("MEGATRON_FP8_WGRAD_FUSION", "yes")
    with pytest.raises(ValueError, match="MEGATRON_FP8_WGRAD_FUSION='yes'.*'config'.*'on'.*'off'"):
        ColumnParallelLinear(64, 32, config=cfg, bias=False)


def test_fused_wgrad_without_main_grad_names_the_layer() -> None:
    layer = mf.Linear(64, 32, bias=False, fuse_wgrad_accumulation=True, name="proj")
    with mf.fp8_autocast(fp8_recipe=mf.recipe.Float8CurrentScaling()), \
            pytest.raises(RuntimeError, match=r"Linear\(proj\): fuse_wgrad_accumulation=True needs weight.main_grad"
                                              r".*MEGATRON_FP8_WGRAD_FUSION=off"):
        layer(torch.randn(16, 64))


def test_fused_wgrad_without_main_grad_is_fine_where_no_wgrad_is_computed() -> None:
    """Inference (no grad, or a frozen weight) needs no ``main_grad``: megatron-core's own linears
    fuse only where it exists, and Megatron-LM builds models for generation without its DDP."""
    x = torch.randn(16, 64)
    for recipe in (None, mf.recipe.Float8CurrentScaling()):
        layer = mf.Linear(64, 32, bias=False, fuse_wgrad_accumulation=True, name="proj")
        plain = mf.Linear(64, 32, bias=False, name="proj")
        plain.load_state_dict(layer.state_dict())
        with mf.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            with torch.no_grad():
                assert torch.equal(layer(x), plain(x))
            layer.weight.requires_grad_(False)
            assert torch.equal(layer(x), plain(x))
        grouped = mf.GroupedLinear(2, 64, 32, bias=False, fuse_wgrad_accumulation=True)
        with mf.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe), torch.no_grad():
            assert grouped(x, [8, 8]).shape == (16, 32)


def test_a_layer_built_without_a_name_takes_its_module_path() -> None:
    """``adopt_name`` (the Megatron plug-in passes each layer's module path at the first forward):
    the layer's errors name it from then on, quantizers made before are renamed, and a layer built
    with a name keeps it."""
    cfg = ParallelConfig(use_cpu_initialization=True)
    monkey = pytest.MonkeyPatch()
    monkey.setenv("MEGATRON_FP8_WGRAD_FUSION", "on")
    try:
        layer = ColumnParallelLinear(64, 32, config=cfg, bias=False)
    finally:
        monkey.undo()
    with mf.fp8_autocast(fp8_recipe=mf.recipe.Float8CurrentScaling()):
        q = layer.fp8_quantizers()
    assert q is not None and q.input.name == "ColumnParallelLinear input"
    path = "decoder.layers.0.mlp.linear_fc1"
    layer.adopt_name(path)
    owner = f"ColumnParallelLinear({path})"
    assert layer.name == path and layer._owner == owner
    assert [t.name for t in (q.input, q.weight, q.grad_output)] == [f"{owner} input", f"{owner} weight",
                                                                    f"{owner} output gradient"]
    with mf.fp8_autocast(fp8_recipe=mf.recipe.Float8CurrentScaling()), \
            pytest.raises(RuntimeError, match=re.escape(owner) + r": fuse_wgrad_accumulation=True needs"):
        layer(torch.randn(16, 64))
    named = mf.Linear(64, 32, name="proj")
    named.adopt_name(path)
    assert named.name == "proj"
