"""megatron_fp8.megatron (skips without megatron-core): GPT layer specs with our linears and
the FP8 region from Megatron's fp8 settings.

One torchrun launch (TP=2, gloo, CPU; ``dist_workers/spec_worker.py``) builds a 2-layer
``GPTModel`` from megatron-core's local spec and from ours with the same weights:

* FP8 off: loss and every gradient **bitwise** equal;
* under ``fp8_context`` for delayed / tensorwise / blockwise / mxfp8: loss within 2e-3 relative
  of the FP8-off (fp32) loss, decoder-linear weight gradients >= 14 dB SQNR;
* ``save_original_input`` on ``*.self_attention.linear_proj`` via ``apply_layer_flags``:
  loss and gradients **bitwise** equal to the flag off, for every recipe;
* an MoE layer (sequential experts, and grouped experts in ``TEGroupedMLP``) **bitwise** equal
  to Megatron's with FP8 off, and within 2e-2 (max-abs relative) under each recipe.
"""

from __future__ import annotations

import functools
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from tests.dist_workers.launch import worker_report

pytest.importorskip("megatron.core")

from megatron_fp8.megatron import fp8_context, get_gpt_layer_spec, recipe_from_megatron, to_fp8_spec  # noqa: E402
from megatron_fp8.parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron_fp8.recipe import (  # noqa: E402
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
)


@pytest.fixture(scope="module")
def report() -> dict:
    return worker_report("spec_worker.py")


# ---- torchrun: whole models ----
@pytest.mark.distributed
@pytest.mark.megatron
def test_gpt_model_matches_megatron_local_spec_bitwise(report: dict) -> None:
    # per rank: 1 name/shape check + 2 layers x 4 linears; loss + grad-name check + 29 grads
    assert report["counts"]["names"] == 9 * report["world"]
    assert report["counts"]["hp"] == 31 * report["world"]
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_gpt_model_fp8_recipes_close_to_high_precision(report: dict) -> None:
    # per rank and recipe: the loss + 8 decoder-linear weight gradients
    assert report["counts"]["fp8"] == 4 * 9 * report["world"]
    for name in ("delayed", "tensorwise", "blockwise", "mxfp8"):
        assert report["max_rel"][f"fp8 loss {name}"] <= 2e-3
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_save_original_input_on_linear_proj_is_bitwise_neutral(report: dict) -> None:
    # per rank and recipe: the rule's match check, the loss and 29 gradients
    assert report["counts"]["soi"] == 4 * 31 * report["world"]
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_moe_layer_sequential_and_grouped_experts(report: dict) -> None:
    # per rank: container check; 2 kinds x (out, dx, names, 17 grads); 4 FP8 recipes
    assert report["counts"]["moe"] == (1 + 2 * 20 + 4) * report["world"]
    assert report["max_rel"]["moe"] <= 2e-2
    assert report["failures"] == 0


# ---- in process: specs and the recipe mapping ----
def _submodules(entry: Any) -> Any:
    """A spec entry's submodules: a ModuleSpec's, or (megatron-core 0.17+) a partial's keyword."""
    return entry.keywords["submodules"] if isinstance(entry, functools.partial) else entry.submodules


def test_layer_spec_replaces_linears_and_keeps_local_structure() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    ours, theirs = get_gpt_layer_spec(qk_layernorm=True), get_gpt_layer_local_spec(qk_layernorm=True)
    attn, mlp = _submodules(ours.submodules.self_attention), _submodules(ours.submodules.mlp)
    assert (attn.linear_qkv, attn.linear_proj) == (ColumnParallelLinear, RowParallelLinear)
    assert (mlp.linear_fc1, mlp.linear_fc2) == (ColumnParallelLinear, RowParallelLinear)
    # separate norms kept; megatron-core's torch norm becomes ours (the same module, sequence parallelism allowed)
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_fp8.megatron.norm import Norm

    def expected(norm: type) -> type:
        return Norm if norm is WrappedTorchNorm else norm

    assert ours.submodules.input_layernorm is expected(theirs.submodules.input_layernorm)
    assert ours.submodules.pre_mlp_layernorm is expected(theirs.submodules.pre_mlp_layernorm)
    assert attn.q_layernorm is expected(_submodules(theirs.submodules.self_attention).q_layernorm)
    # the input spec is left untouched
    assert _submodules(theirs.submodules.self_attention).linear_qkv is not ColumnParallelLinear


def test_to_fp8_spec_rejects_specs_without_local_linears() -> None:
    from megatron.core.transformer.spec_utils import ModuleSpec

    with pytest.raises(ValueError, match="no megatron-core ColumnParallelLinear"):
        to_fp8_spec(ModuleSpec(module=object))


def _experts_entry(spec: Any) -> Any:
    """The experts entry of a layer spec's MoE submodules."""
    return _submodules(spec.submodules.mlp).experts


def _module_of(entry: Any) -> type:
    """The class a spec entry builds: a partial's function or a ModuleSpec's module."""
    return entry.func if isinstance(entry, functools.partial) else entry.module


def test_grouped_experts_from_either_megatron_spec_form() -> None:
    """moe_grouped_gemm=True gives our GroupedMLP (a TEGroupedMLP) holding our grouped linears, whether the local
    spec built the legacy GroupedMLP (0.16) or SequentialMLP (0.17+ ignores the flag there):
    ``grouped_experts=True`` converts the second, as a ModuleSpec (0.16's form, built here) or
    as a partial (0.17+'s form, made here), keeping the form; shared experts stay dense."""
    from megatron.core import tensor_parallel as mtp
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import mlp as mcore_mlp
    from megatron.core.transformer.moe import experts

    from megatron_fp8.megatron.experts import GroupedMLP
    from megatron_fp8.parallel.grouped import ColumnParallelGroupedLinear, RowParallelGroupedLinear

    assert issubclass(GroupedMLP, experts.TEGroupedMLP)
    want_sub = getattr(experts, "GroupedMLPSubmodules", mcore_mlp.MLPSubmodules)
    sequential = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    assert _module_of(_experts_entry(sequential)) is experts.SequentialMLP
    converted = [get_gpt_layer_spec(num_experts=4, moe_grouped_gemm=True),
                 to_fp8_spec(sequential, grouped_experts=True)]
    for spec in converted:
        entry = _experts_entry(spec)
        assert _module_of(entry) is GroupedMLP
        sub = _submodules(entry)
        assert type(sub) is want_sub
        assert (sub.linear_fc1, sub.linear_fc2) == (ColumnParallelGroupedLinear, RowParallelGroupedLinear)
        shared = _submodules(spec.submodules.mlp).shared_experts  # 0.19: a builder function's partial
        assert _module_of(shared) is not GroupedMLP
        assert (_submodules(shared).linear_fc1, _submodules(shared).linear_fc2) == (ColumnParallelLinear,
                                                                                    RowParallelLinear)
    # 0.17+'s form: a partial of SequentialMLP becomes a partial of our GroupedMLP
    as_partial = functools.partial(experts.SequentialMLP, submodules=mcore_mlp.MLPSubmodules(
        linear_fc1=mtp.ColumnParallelLinear, linear_fc2=mtp.RowParallelLinear))
    grouped = to_fp8_spec(as_partial, grouped_experts=True)
    assert isinstance(grouped, functools.partial) and grouped.func is GroupedMLP
    assert type(grouped.keywords["submodules"]) is want_sub
    # without the flag, SequentialMLP experts stay sequential, on our linears
    kept = _experts_entry(to_fp8_spec(sequential))
    assert _module_of(kept) is experts.SequentialMLP
    sub = _submodules(kept)
    assert (sub.linear_fc1, sub.linear_fc2) == (ColumnParallelLinear, RowParallelLinear)
    assert _module_of(_experts_entry(sequential)) is experts.SequentialMLP  # input untouched


def test_grouped_experts_without_experts_is_an_error() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    with pytest.raises(ValueError, match="no MoE experts"):
        to_fp8_spec(get_gpt_layer_local_spec(), grouped_experts=True)
    # a dense layer asked for grouped GEMMs is simply dense (Megatron ignores the flag there too)
    dense = get_gpt_layer_spec(moe_grouped_gemm=True)
    assert _submodules(dense.submodules.mlp).linear_fc1 is ColumnParallelLinear


def test_multi_latent_attention_spec_uses_our_projections() -> None:
    """MLA: megatron-core's MLASelfAttention (our subclass passes its down-projection class check)
    with our five projections and the SDPA core; converting megatron-core's own MLA spec replaces
    its attention class too, and asks for the SDPA core (its local attention cannot take MLA's head
    sizes). Built and trained in tests/test_mla.py."""
    from megatron.core import tensor_parallel as mtp
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_fp8.megatron.attention import SDPAttention
    from megatron_fp8.megatron.mla import __getattr__ as mla_class

    ours = mla_class("MLASelfAttention")
    assert issubclass(ours, MLASelfAttention)
    spec = get_gpt_layer_spec(multi_latent_attention=True, qk_layernorm=True)
    attn = spec.submodules.self_attention
    assert attn.module is ours
    sub = attn.submodules
    assert (sub.linear_q_down_proj, sub.linear_kv_down_proj, sub.linear_q_up_proj, sub.linear_kv_up_proj) == \
        (ColumnParallelLinear,) * 4 and sub.linear_proj is RowParallelLinear and sub.core_attention is SDPAttention
    with pytest.raises(ValueError, match="multi-latent attention needs core_attention='sdpa'"):
        get_gpt_layer_spec(multi_latent_attention=True, core_attention="local")
    theirs = MLASelfAttentionSubmodules(linear_q_down_proj=mtp.ColumnParallelLinear,
                                        linear_kv_down_proj=mtp.ColumnParallelLinear,
                                        linear_proj=mtp.RowParallelLinear, q_layernorm=IdentityOp,
                                        kv_layernorm=IdentityOp)
    converted = to_fp8_spec(ModuleSpec(module=MLASelfAttention, submodules=theirs), core_attention="sdpa")
    assert converted.module is ours and converted.submodules.linear_kv_down_proj is ColumnParallelLinear
    with pytest.raises(ValueError, match=r"the spec holds \['MLASelfAttention'\].*core_attention='sdpa'"):
        to_fp8_spec(ModuleSpec(module=MLASelfAttention, submodules=theirs))


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        (dict(fp8="hybrid", fp8_recipe="delayed", fp8_margin=1, fp8_amax_history_len=8, fp8_amax_compute_algo="max"),
         DelayedScaling(margin=1, fp8_format=Format.HYBRID, amax_history_len=8, amax_compute_algo="max")),
        (dict(fp8="e4m3", fp8_recipe="tensorwise"), Float8CurrentScaling(fp8_format=Format.E4M3)),
        (dict(fp8="e4m3", fp8_recipe="blockwise"), Float8BlockScaling(fp8_format=Format.E4M3)),
        (dict(fp8="e4m3", fp8_recipe="mxfp8"), MXFP8BlockScaling(fp8_format=Format.E4M3)),
        (dict(fp8=None, fp8_recipe="mxfp8"), None),
    ],
    ids=["delayed", "tensorwise", "blockwise", "mxfp8", "off"],
)
def test_recipe_from_megatron_fields(fields: dict[str, Any], want: object) -> None:
    assert recipe_from_megatron(SimpleNamespace(**fields)) == want


def test_recipe_from_megatron_transformer_config() -> None:
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, fp8="hybrid",
                            fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max")
    assert recipe_from_megatron(cfg) == DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4,
                                                       amax_compute_algo="max")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(fp8="e5m2"), "config.fp8='e5m2'"),
        (dict(fp8="e4m3", fp8_recipe="custom"), "config.fp8_recipe='custom'"),
        (dict(fp8="e4m3", fp8_param=True), "config.fp8_param=True"),
        (dict(fp8="e4m3", fp8_wgrad=False), "config.fp8_wgrad=False"),
        (dict(fp8="e4m3", first_last_layers_bf16=True), "config.first_last_layers_bf16=True"),
        (dict(fp8="e4m3", fp8_recipe="mxfp8", fp8_output_proj=True), "config.fp8_output_proj=True"),
        (dict(fp8="hybrid", fp4="e2m1"), "config.fp4='e2m1' with config.fp8='hybrid'"),
        (dict(fp8="hybrid", quant_recipe=object()), "config.quant_recipe .Megatron-LM's --te-precision-config-file"),
        (dict(fp8=None, quant_recipe=object()), "config.quant_recipe"),
    ],
)
def test_recipe_from_megatron_errors_name_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        recipe_from_megatron(SimpleNamespace(**fields))


@pytest.mark.parametrize(("start", "end", "ok"), [(1, 1, True), (0, 4, True), (5, 0, False), (0, -1, False)])
def test_bf16_layer_counts_checked_per_stage(start: int, end: int, ok: bool) -> None:
    """``first_last_layers_bf16`` (honoured per layer): megatron-core bounds the BF16 layer counts
    by one pipeline stage's layers only where TE is installed; we check them ourselves."""
    cfg = SimpleNamespace(fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True, num_layers=8,
                          pipeline_model_parallel_size=2, num_layers_at_start_in_bf16=start,
                          num_layers_at_end_in_bf16=end)
    if ok:
        assert recipe_from_megatron(cfg, per_layer=True) == Float8CurrentScaling(fp8_format=Format.HYBRID)
    else:
        with pytest.raises(ValueError, match=r"num_layers_at_(start|end)_in_bf16=.*between 0 and .* \(4\)"):
            recipe_from_megatron(cfg, per_layer=True)
    cfg.fp8_recipe, cfg.num_layers_at_start_in_bf16, cfg.num_layers_at_end_in_bf16 = "delayed", 1, 1
    # megatron-core's block opens one region for the whole forward under delayed scaling: no BF16 layers
    with pytest.raises(ValueError, match=r"first_last_layers_bf16=True with fp8_recipe='delayed'"):
        recipe_from_megatron(cfg, per_layer=True)


def test_get_fp8_context_keeps_first_and_last_layers_in_bf16() -> None:
    """Megatron's transformer block asks ``get_fp8_context(config, layer_no)`` per layer (all
    recipes but delayed): under ``first_last_layers_bf16`` the first ``num_layers_at_start_in_bf16``
    and last ``num_layers_at_end_in_bf16`` layers get a disabled region, the others ours."""
    from megatron_fp8.autocast import current_fp8_state
    from megatron_fp8.megatron.fp8 import get_fp8_context

    cfg = SimpleNamespace(fp8="hybrid", fp8_recipe="blockwise", first_last_layers_bf16=True, num_layers=5,
                          num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=2)
    enabled = []
    for layer_no in range(5):
        with get_fp8_context(cfg, layer_no) as state:
            assert current_fp8_state() is state and state.recipe == Float8BlockScaling(fp8_format=Format.HYBRID)
            enabled.append(state.enabled)
    assert enabled == [False, True, True, False, False]


def test_fp8_context_enables_our_autocast() -> None:
    from megatron_fp8.autocast import current_fp8_state

    with fp8_context(SimpleNamespace(fp8="e4m3", fp8_recipe="mxfp8")) as state:
        assert current_fp8_state() is state
        assert state.recipe == MXFP8BlockScaling()
    with pytest.raises(ValueError, match="config.fp8 is unset"):
        fp8_context(SimpleNamespace(fp8=None), enabled=True)


def test_missing_megatron_core_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "megatron.core.models.gpt.gpt_layer_specs", None)  # import fails
    with pytest.raises(ImportError, match="pip install megatron-core"):
        get_gpt_layer_spec()


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_is_megatrons_torch_norm_with_sequence_parallelism(normalization: str) -> None:
    """``norm.Norm`` builds the module megatron-core's ``WrappedTorchNorm`` builds (class, shape,
    eps, outputs bitwise), takes ``sequence_parallel`` (its parameters marked for Megatron's TP
    gradient all-reduce) and ``persist_layer_norm``, both of which megatron-core's refuses, and
    refuses zero-centred gamma by name."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_fp8.megatron.norm import Norm

    def config(**kw: Any) -> TransformerConfig:
        return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, normalization=normalization,
                                 persist_layer_norm=False, **kw)

    theirs, ours = WrappedTorchNorm(config(), 64, eps=1e-6), Norm(config(), 64, eps=1e-6)
    assert type(ours) is type(theirs) and ours.eps == theirs.eps
    assert not any(hasattr(p, "sequence_parallel") for p in ours.parameters())
    x = torch.randn(8, 64)
    assert torch.equal(ours(x), theirs(x))
    sp = config()
    sp.sequence_parallel, sp.persist_layer_norm = True, True  # set after the config's own checks (TP=1 here)
    with pytest.raises(AssertionError):
        WrappedTorchNorm(sp, 64)
    marked = Norm(sp, 64)
    assert [getattr(p, "sequence_parallel", None) for p in marked.parameters()] == [True] * len(list(
        marked.parameters())) and len(list(marked.parameters())) == (2 if normalization == "LayerNorm" else 1)
    gamma = config()
    gamma.layernorm_zero_centered_gamma = True
    with pytest.raises(ValueError, match="layernorm_zero_centered_gamma=True"):
        Norm(gamma, 64)


def test_block_spec_converts_the_final_norm_and_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``get_gpt_block_spec(config)``: megatron-core's decoder block spec for the config with our
    linears and norms, its final norm included (what a GPTModel needs for sequence parallelism);
    with MLA, every layer's attention is our MLA whatever its MLP (``moe_layer_freq``). (One pipeline stage: the stage's
    layer count and offset, which need megatron-core's process groups, are given here; the
    torchrun workers build through it with real groups.)"""
    import megatron.core.models.gpt.gpt_layer_specs as mcore_specs
    import torch

    monkeypatch.setattr(mcore_specs, "get_num_layers_to_build", lambda config, **kw: config.num_layers)
    monkeypatch.setattr(mcore_specs, "get_transformer_layer_offset", lambda config, **kw: 0)
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_fp8.megatron import get_gpt_block_spec
    from megatron_fp8.megatron.norm import Norm

    cfg = TransformerConfig(num_layers=3, hidden_size=64, num_attention_heads=4, normalization="RMSNorm",
                            persist_layer_norm=False, params_dtype=torch.float32)
    block = get_gpt_block_spec(cfg, core_attention="local")
    assert isinstance(block, TransformerBlockSubmodules) and block.layer_norm is Norm and len(block.layer_specs) == 3
    for layer in block.layer_specs:
        attn = _submodules(layer.submodules.self_attention)
        assert (attn.linear_qkv, attn.linear_proj) == (ColumnParallelLinear, RowParallelLinear)
        assert layer.submodules.input_layernorm is Norm
    # DeepSeek's first dense layer: MLA everywhere, dense MLP then MoE (moe_layer_freq a list)
    mla = MLATransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
                               qk_head_dim=16, qk_pos_emb_head_dim=16, v_head_dim=16, num_moe_experts=2,
                               moe_layer_freq=[0, 1], moe_ffn_hidden_size=64, moe_grouped_gemm=True,
                               qk_layernorm=True, params_dtype=torch.float32)
    from megatron_fp8.megatron.attention import SDPAttention
    from megatron_fp8.megatron.mla import MLASelfAttention

    block = get_gpt_block_spec(mla)
    assert block.layer_norm is Norm and len(block.layer_specs) == 2
    for layer, moe in zip(block.layer_specs, (False, True)):
        attn = layer.submodules.self_attention
        assert attn.module is MLASelfAttention and attn.submodules.core_attention is SDPAttention
        assert attn.submodules.linear_kv_down_proj is ColumnParallelLinear and attn.submodules.q_layernorm is Norm
        assert ("experts" in vars(_submodules(layer.submodules.mlp))) is moe


@pytest.mark.parametrize(("impl", "scope", "refused"), [("local", None, True), ("local", ["full_iteration"], False),
                                                        ("full_iteration", None, False), ("none", None, False)])
def test_per_layer_megatron_graphs_with_fp8_are_refused_naming_the_fix(impl: str, scope: Any, refused: bool) -> None:
    """megatron-core's per-layer CUDA graphs keep FP8 state in Transformer Engine; without it the
    plug-in's config check refuses them and names the whole-iteration graph; that graph (both
    spellings) and no graph pass."""
    from megatron_fp8.megatron.compat import _post_init_without_te, have_te

    if have_te():
        pytest.skip("Transformer Engine is installed: megatron-core's own FP8 graph state applies")
    ran = []
    checked = _post_init_without_te(lambda cfg: ran.append(cfg.fp8))
    cfg = SimpleNamespace(fp8="hybrid", fp8_recipe="tensorwise", cuda_graph_impl=impl, cuda_graph_scope=scope)
    if refused:
        with pytest.raises(ValueError, match="--cuda-graph-impl full_iteration"):
            checked(cfg)
    else:
        checked(cfg)
    assert ran == [None] and cfg.fp8 == "hybrid"  # megatron-core's checks ran with fp8 hidden, then restored


def test_per_layer_graph_check_reads_megatron_cores_config() -> None:
    """The check on a real ``TransformerConfig`` of the installed megatron-core."""
    from megatron.core.transformer import TransformerConfig

    from megatron_fp8.megatron.compat import per_layer_graphs

    assert per_layer_graphs(TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                                              cuda_graph_impl="local"))
    assert not per_layer_graphs(TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4))
    if "full_iteration" in str(TransformerConfig.__annotations__.get("cuda_graph_impl")):
        whole = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, cuda_graph_impl="full_iteration")
    else:  # megatron-core <= 0.16: the whole iteration is a scope of the local graphs
        whole = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, cuda_graph_impl="local",
                                  cuda_graph_scope=["full_iteration"])
    assert not per_layer_graphs(whole)


def test_te_checkpoint_is_ours_with_or_without_transformer_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core recomputes under ``config.fp8`` through ``te_checkpoint``. The FP8 region is
    the plug-in's whether TE is installed or not, so every module that calls it gets ours, even
    where one holds TE's real function (stood in for here: TE cannot be installed)."""
    import megatron.core.transformer.transformer_block as block

    from megatron_fp8.megatron import compat

    ext = pytest.importorskip("megatron.core.extensions.transformer_engine")

    def te_own(*args: Any, **kwargs: Any) -> None:  # what TE's checkpoint would be
        raise AssertionError("TE's checkpoint was called")

    monkeypatch.setattr(compat, "have_te", lambda: True)
    monkeypatch.setattr(ext, "te_checkpoint", te_own)
    monkeypatch.setattr(block, "te_checkpoint", te_own)
    compat._patch_te_checkpoint()
    assert ext.te_checkpoint is compat.te_checkpoint and block.te_checkpoint is compat.te_checkpoint


@pytest.mark.parametrize(("fields", "refused"), [
    ({"moe_token_dispatcher_type": "alltoall"}, None),
    ({"moe_token_dispatcher_type": "allgather"}, "allgather"),
    ({"moe_token_dispatcher_type": "alltoall_seq"}, "alltoall_seq"),
    ({"moe_token_dispatcher_type": "alltoall", "transformer_impl": "inference_optimized", "num_moe_experts": 8},
     "inference_optimized"),
    ({"moe_token_dispatcher_type": "alltoall", "transformer_impl": "inference_optimized", "num_moe_experts": None},
     None),
])
def test_router_padding_rules_megatron_core_skips_with_fp8_hidden(fields: dict[str, Any], refused: str | None) -> None:
    """The router padding's rules, which megatron-core checks only with ``fp8`` visible (the plug-in
    hides it): the alias turns the flag on; what cannot take a padded routing map is refused by name."""
    from megatron_fp8.megatron.compat import _router_padding

    cfg = SimpleNamespace(moe_router_padding_for_fp8=True, moe_router_padding_for_quantization=False, **fields)
    if refused:
        with pytest.raises(ValueError, match=refused):
            _router_padding(cfg)
    else:
        _router_padding(cfg)
        assert cfg.moe_router_padding_for_quantization
