"""torchrun worker (2 ranks, gloo, CPU): multi-latent attention with megatron_fp8's projections
(``get_gpt_layer_spec(multi_latent_attention=True)``), at TP=2 and TP=1.

Categories of the JSON report:

* ``build``: every MLA projection is ours, the core attention is the SDPA one; two training
  steps under block scaling give finite, falling losses.
* ``flags``: ``save_original_input`` on ``linear_q_down_proj`` and ``linear_kv_down_proj``: loss
  and every gradient bitwise equal to the flags off.
* ``bytes``: with those flags and ``--recompute-modules layernorm`` (the input layernorm's output,
  which both read, discarded after forward and recomputed; the pre-MLP norm's too, so ``fc1``
  is flagged as well), the saved activations still live at the end of forward drop by exactly
  the columnwise FP8 copies of those three inputs per layer.
* ``up_proj``: ``--recompute-modules mla_up_proj`` (q/k/v of the up-projections discarded):
  loss bitwise, gradients within ``RECOMPUTE_RTOL``.
* ``sp`` (TP=2): sequence parallelism through the plug-in's block spec (our norms take it):
  norms marked, loss and gradients against the same model without it, FP8 off and blocks;
  DeepSeek's layout (MLA + MoE: megatron-core needs sequence parallelism for MoE with TP) trains.
* ``deepseek`` (TP=1): MLA with grouped MoE experts and a shared expert (DeepSeek-V3's layout,
  small; kv_down 192 wide: a partial 128x128 weight block) trains under block scaling; the flags on
  q/kv_down and the shared expert's fc1 bitwise neutral; with a first dense layer
  (``moe_layer_freq=[0, 1]``) through the plug-in, MLA in both layers, it trains.

The plug-in is imported: megatron-core's output-discarding recompute runs on ours here.
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
from common import Checker, init_gloo, shutdown
from mcore_worker import _cpu_shims

warnings.filterwarnings("ignore")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig  # noqa: E402

import megatron_fp8 as mf  # noqa: E402
from megatron_fp8.audit import columnwise_copy_bytes, cpu_accommodations  # noqa: E402
from megatron_fp8.config import FP8Config, LayerRule, apply_layer_flags  # noqa: E402
from megatron_fp8.megatron import get_gpt_layer_spec, plugin  # noqa: E402
from megatron_fp8.parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron_fp8.recipe import Float8BlockScaling, Float8CurrentScaling  # noqa: E402

S, B, VOCAB, HIDDEN = 128, 2, 512, 256
RECOMPUTE_RTOL = 1e-5
RECIPE = Float8BlockScaling()


MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=256, moe_grouped_gemm=True,
           moe_token_dispatcher_type="allgather", moe_shared_expert_intermediate_size=256,
           moe_router_load_balancing_type="none")


def _config(tp: int, recompute: list[str] | None = None, moe: bool = False, sp: bool = False,
            first_dense: bool = False) -> MLATransformerConfig:
    extra = dict(recompute_granularity="selective", recompute_modules=recompute) if recompute else {}
    extra.update(MOE if moe else {})
    if first_dense:  # DeepSeek's first layers are dense: layer 0 an MLP, layer 1 MoE
        extra["moe_layer_freq"] = [0, 1]
    return MLATransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=512, tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        q_lora_rank=256, kv_lora_rank=128, qk_head_dim=64, qk_pos_emb_head_dim=64, v_head_dim=64,
        rope_type="rope", qk_layernorm=True, use_cpu_initialization=True, params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0, add_bias_linear=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, normalization="RMSNorm", **extra)


def _model(tp: int, recompute: list[str] | None = None, flags: bool = False, moe: bool = False) -> GPTModel:
    torch.manual_seed(0)
    spec = get_gpt_layer_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm",
                              num_experts=MOE["num_moe_experts"] if moe else None, moe_grouped_gemm=moe)
    model = GPTModel(config=_config(tp, recompute, moe), transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=S, position_embedding_type="rope")
    if flags:  # the down-projections; with layernorm recompute, the pre-MLP norm's consumer too
        rules = ["*.linear_q_down_proj", "*.linear_kv_down_proj"] + (["*.mlp.linear_fc1"] if recompute else [])
        rules += ["*.shared_experts.linear_fc1"] if moe else []  # reads what the router reads
        apply_layer_flags(model, FP8Config(layers=[LayerRule(match=r, save_original_input=True) for r in rules]))
    return model


_RECIPE = object()  # _step's default: the module's RECIPE at the time of the call


def _step(model: GPTModel, track: bool = False, recipe: object = _RECIPE
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """One forward+backward under ``recipe`` (None: FP8 off): loss, gradients, live saved bytes."""
    recipe = RECIPE if recipe is _RECIPE else recipe
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (B, S), generator=g)
    pos = torch.arange(S).expand(B, S)
    mask = torch.ones(1, 1, S, S, dtype=torch.bool).tril().logical_not()
    model.zero_grad(set_to_none=True)
    with mf.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe), \
            mf.memory.track_saved_tensors(model) as saved:
        loss = model(tokens, pos, mask, labels=tokens).float().mean()
    live = saved.live_bytes()  # at the end of forward: a discarded output counts 0
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, live


def check_build(ck: Checker, tp: int) -> None:
    from megatron_fp8.megatron.attention import SDPAttention

    model = _model(tp)
    attn = model.decoder.layers[0].self_attention
    cols = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
    ck.true("build", all(type(getattr(attn, n)) is ColumnParallelLinear for n in cols)
            and type(attn.linear_proj) is RowParallelLinear and isinstance(attn.core_attention, SDPAttention),
            f"TP={tp}: MLA holds {[type(getattr(attn, n)).__name__ for n in cols]}")
    _check_trains(ck, "build", model, tp)


def _check_trains(ck: Checker, category: str, model: GPTModel, tp: int) -> None:
    """Two SGD steps: finite losses, the second lower."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(2):
        loss, _, _ = _step(model)
        opt.step()
        losses.append(loss.item())
    ck.true(category, all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0],
            f"TP={tp}: losses {losses}")


def _check_flags_neutral(ck: Checker, category: str, tp: int, moe: bool = False) -> tuple[int, int]:
    """The loss and every gradient bitwise equal with the flags on and off; the live bytes of each."""
    loss0, grads0, live0 = _step(_model(tp, moe=moe))
    loss1, grads1, live1 = _step(_model(tp, flags=True, moe=moe))
    ck.bitwise(category, f"TP={tp} loss", loss1, loss0)
    for n, g in grads0.items():
        ck.bitwise(category, f"TP={tp} grad {n}", grads1.get(n), g)
    return live0, live1


def check_flags_and_bytes(ck: Checker, tp: int) -> None:
    live0, _ = _check_flags_neutral(ck, "flags", tp)
    recomputed = _model(tp, recompute=["layernorm"], flags=True)
    _, _, live2 = _step(recomputed)
    norm = recomputed.decoder.layers[0].input_layernorm  # what a norm saves for its own backward, which a
    with mf.memory.track_saved_tensors() as own:         # norm run without a graph (then replayed) does not
        norm(torch.randn(S, B, HIDDEN, requires_grad=True))
    copies = 3 * columnwise_copy_bytes(RECIPE, S * B, HIDDEN)  # q_down, kv_down, fc1 (2-D input: S*B tokens)
    want = 2 * (copies + 2 * (own.activation_bytes - S * B * HIDDEN * 4))  # two layers, two norms; less the input
    ck.true("bytes", live0 - live2 == want, f"TP={tp}: live bytes dropped by {live0 - live2}, expected {want} "
                                            f"({copies} in FP8 copies a layer, the norms' own {own.table()})")


def check_deepseek_shape(ck: Checker, tp: int) -> None:
    """DeepSeek-V3's layout in small: MLA (RoPE dim 64: kv_down's out features end in a partial
    128x128 block) with grouped MoE experts and a shared expert under block scaling: trains, and
    the flags on q/kv_down and the shared expert's fc1 are bitwise neutral."""
    _check_trains(ck, "deepseek", _model(tp, moe=True), tp)
    _check_flags_neutral(ck, "deepseek", tp, moe=True)
    first_dense = _plugin_model(_config(tp, moe=True, first_dense=True))  # through the plug-in's block spec
    kinds = [type(layer.mlp).__name__ for layer in first_dense.decoder.layers]
    ck.true("deepseek", kinds == ["MLP", "MoELayer"] and all(type(layer.self_attention).__name__ == "MLASelfAttention"
                                                            for layer in first_dense.decoder.layers),
            f"moe_layer_freq [0, 1]: MLPs {kinds}")
    _check_trains(ck, "deepseek", first_dense, tp)


def _plugin_model(cfg: MLATransformerConfig) -> GPTModel:
    """An MLA GPT as Megatron-LM builds it through the plug-in (its block spec: our final norm)."""
    torch.manual_seed(0)
    return GPTModel(config=cfg, transformer_layer_spec=plugin.layer_spec(cfg), vocab_size=VOCAB,
                    max_sequence_length=S, position_embedding_type="rope")


def check_sequence_parallel(ck: Checker, tp: int) -> None:
    """MLA at TP=``tp`` with sequence parallelism, through the plug-in (megatron-core's torch
    norms refuse it): every norm parameter (input, q/kv latents, pre-MLP, final) marked for
    Megatron's TP gradient all-reduce; FP8 off and under block scaling, the loss and every
    gradient (norms' summed over the TP group, as ``finalize_model_grads`` sums them) equal to the
    same model without sequence parallelism within float reordering; DeepSeek's layout (MLA with
    MoE, which megatron-core allows with TP only under sequence parallelism) trains."""
    group = parallel_state.get_tensor_model_parallel_group()
    for recipe in (None, Float8BlockScaling()):
        name = "FP8 off" if recipe is None else "blocks"
        plain, sp = _plugin_model(_config(tp)), _plugin_model(_config(tp, sp=True))
        with torch.no_grad():
            for p, q in zip(plain.parameters(), sp.parameters()):
                q.copy_(p)
        norms = {n for n, _ in sp.named_parameters() if "layernorm" in n}
        marks = {n: getattr(p, "sequence_parallel", None) for n, p in sp.named_parameters() if n in norms}
        ck.true("sp", len(marks) == 9 and all(marks.values()), f"{name}: norm parameters marked {marks}")
        (loss0, grads0, _), (loss1, grads1, _) = _step(plain, recipe=recipe), _step(sp, recipe=recipe)
        rtol = 1e-5 if recipe is None else 1e-2
        ck.close("sp", f"{name} loss", loss1, loss0, rtol)
        for n, g in grads0.items():
            got = grads1.get(n)
            if n in norms and got is not None:
                got = got.clone()
                dist.all_reduce(got, group=group)
            ck.close("sp", f"{name} grad {n}", got, g, rtol)
    _check_trains(ck, "sp", _plugin_model(_config(tp, moe=True, sp=True)), tp)


def check_up_proj_recompute(ck: Checker, tp: int) -> None:
    global RECIPE
    RECIPE = Float8CurrentScaling()
    try:
        loss0, grads0, _ = _step(_model(tp))
        loss1, grads1, _ = _step(_model(tp, recompute=["mla_up_proj"]))
    finally:
        RECIPE = Float8BlockScaling()
    ck.bitwise("up_proj", f"TP={tp} loss", loss1, loss0)
    for n, g in grads0.items():
        ck.close("up_proj", f"TP={tp} grad {n}", grads1.get(n), g, RECOMPUTE_RTOL)


def main() -> int:
    rank, world = init_gloo()
    _cpu_shims()
    plugin.install()
    ck = Checker(rank)
    for tp in (world, 1):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        cpu_accommodations()
        ck.guard("build", f"MLA GPT at TP={tp}", check_build, ck, tp)
        ck.guard("flags", f"MLA flags at TP={tp}", check_flags_and_bytes, ck, tp)
        ck.guard("up_proj", f"mla_up_proj recompute at TP={tp}", check_up_proj_recompute, ck, tp)
        if tp == 1:  # MoE with TP needs sequence parallelism: check_sequence_parallel trains it at TP=2
            ck.guard("deepseek", "MLA + MoE at TP=1", check_deepseek_shape, ck, tp)
        else:
            ck.guard("sp", f"MLA with sequence parallelism at TP={tp}", check_sequence_parallel, ck, tp)
        parallel_state.destroy_model_parallel()
    code = ck.report()
    shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
