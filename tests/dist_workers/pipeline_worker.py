"""torchrun worker (2 ranks, gloo, CPU): pipeline parallelism through megatron-core's own schedule
with the plug-in's spec.

A 4-layer GPT built through ``plugin.layer_spec`` (each stage's block spec: its two layers, the
first stage the embedding, the last the final norm and output layer) trains one step of four
micro-batches with megatron-core's 1F1B schedule (``get_forward_backward_func``) at PP=2, and
the same model at PP=1 (weights copied, layer numbers offset) with its no-pipelining schedule.
Categories of the JSON report:

* ``pp``: at PP=2, and at PP=2 with 2 virtual stages a rank (the interleaved schedule, one layer a
  chunk), FP8 off, tensorwise and blocks (stateless recipes: each cast depends only on its
  tensor): every micro-batch loss (last stage) and every gradient bitwise equal to PP=1's;
  delayed scaling: finite losses within ``DELAYED_RTOL`` of PP=1's (its histories advance per
  outermost FP8 region, and 1F1B runs a stage's backward passes after later micro-batches'
  forwards, so its scales may differ from PP=1's).

``batch_p2p_comm`` is off: with it on, the interleaved schedule's gradients came out wrong under
gloo on the CPU with megatron-core's own local spec too (not our layers; GPUs run NCCL).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
from common import Checker, init_gloo, shutdown
from mcore_worker import _cpu_shims

warnings.filterwarnings("ignore")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from megatron_fp8.audit import cpu_accommodations  # noqa: E402
from megatron_fp8.megatron import plugin  # noqa: E402

VOCAB, SEQ, MBS, MICRO, LAYERS = 512, 64, 2, 4, 4
DELAYED_RTOL = 5e-2
RECIPES = (None, ("tensorwise", "hybrid"), ("blockwise", "hybrid"), ("delayed", "hybrid"))


def _cuda_to_cpu_shims() -> None:
    """megatron-core's schedules create a few tensors on ``device="cuda"`` outright (test-only:
    they go to the CPU here)."""
    for name in ("zeros", "ones", "tensor", "empty"):
        real = getattr(torch, name)

        def make(*a: Any, device: Any = None, _real: Any = real, **k: Any) -> torch.Tensor:
            if device is not None and str(device).startswith("cuda"):
                device = "cpu"
            return _real(*a, device=device, **k)

        setattr(torch, name, make)


def _config(pp: int, fp8: tuple[str, str] | None, vp: int | None = None) -> TransformerConfig:
    kw = dict(num_layers=LAYERS, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512,
              pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp, batch_p2p_comm=False,
              use_cpu_initialization=True, params_dtype=torch.float32,
              pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
              bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
              persist_layer_norm=False, normalization="RMSNorm")
    if fp8 is not None:
        kw.update(fp8=fp8[1], fp8_recipe=fp8[0], fp8_amax_history_len=8, fp8_amax_compute_algo="max")
    return TransformerConfig(**kw)


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(MICRO):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        out.append(dict(tokens=tokens, pos=torch.arange(SEQ).expand(MBS, SEQ),
                        mask=torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).tril().logical_not(), labels=tokens))
    return out


def _global(name: str, offset: int) -> str:
    """A chunk's parameter name with its layer number made global (``decoder.layers.i`` of a
    chunk whose first layer is ``offset`` is layer ``offset + i``)."""
    parts = name.split(".")
    if name.startswith("decoder.layers."):
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def _chunk(cfg: TransformerConfig, vp_stage: int | None) -> tuple[GPTModel, int]:
    """This rank's model chunk (``vp_stage``: its virtual stage) and its first layer's number."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    first = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    kw = {} if vp_stage is None else {"vp_stage": vp_stage}
    torch.manual_seed(0)
    model = GPTModel(config=cfg, transformer_layer_spec=plugin.layer_spec(cfg, vp_stage=vp_stage), vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="rope", pre_process=first, post_process=last,
                     **kw)
    return model, get_transformer_layer_offset(cfg, vp_stage=vp_stage)


def _train_step(pp: int, fp8: tuple[str, str] | None, weights: dict[str, torch.Tensor] | None, vp: int | None = None
                ) -> tuple[list[GPTModel], list[torch.Tensor], dict[str, torch.Tensor]]:
    """One training step of ``MICRO`` micro-batches under megatron-core's schedule for this PP
    size (``vp``: virtual stages, the interleaved schedule): this rank's chunks, the losses it saw
    (the last stage: one per micro-batch) and the gradients (global names)."""
    cfg = _config(pp, fp8, vp)
    chunks = [_chunk(cfg, v) for v in (range(vp) if vp else [None])]
    if weights is not None:
        with torch.no_grad():
            for model, offset in chunks:
                for n, p in model.named_parameters():
                    p.copy_(weights[_global(n, offset)])
    batches, losses = iter(_batches()), []

    def forward_step(data: Any, m: GPTModel) -> tuple[torch.Tensor, Any]:
        b = next(data)
        out = m(b["tokens"], b["pos"], b["mask"], labels=b["labels"])

        def loss_func(o: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = o.float().mean()
            losses.append(loss.detach())
            return loss, {"loss": loss.detach()}
        return out, loss_func

    models = [m for m, _ in chunks]
    data = [iter(_batches()) for _ in models] if vp else batches  # one iterator a chunk: each reads its batches
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=models,
                                num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
    grads = {_global(n, offset): p.grad.clone() for m, offset in chunks for n, p in m.named_parameters()
             if p.grad is not None}
    return models, losses, grads


def check_pipeline(ck: Checker, world: int, vp: int | None) -> None:
    for fp8 in RECIPES:
        name = ("FP8 off" if fp8 is None else "/".join(fp8)) + (f", {vp} virtual stages" if vp else "")
        parallel_state.initialize_model_parallel()
        cpu_accommodations()
        (full,), ref_losses, ref_grads = _train_step(1, fp8, None)
        weights = {n: p.detach().clone() for n, p in full.named_parameters()}
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world,
                                                 virtual_pipeline_model_parallel_size=vp)
        cpu_accommodations()
        chunks, losses, grads = _train_step(world, fp8, weights, vp)
        last = parallel_state.is_pipeline_last_stage()
        params = sum(len(list(m.parameters())) for m in chunks)
        ck.true("pp", len(grads) == params and (len(losses) == MICRO) == last,
                f"{name}: {len(grads)} gradients of {params}, {len(losses)} losses on stage "
                f"{parallel_state.get_pipeline_model_parallel_rank()}")
        stateless = fp8 is None or fp8[0] != "delayed"
        if last:
            for i, (got, want) in enumerate(zip(losses, ref_losses)):
                if stateless:
                    ck.bitwise("pp", f"{name} loss {i}", got, want)
                else:
                    ck.close("pp", f"{name} loss {i}", got, want, DELAYED_RTOL)
        if stateless:
            for n, g in grads.items():
                ck.bitwise("pp", f"{name} grad {n}", g, ref_grads.get(n))
        parallel_state.destroy_model_parallel()


def check_stage_specs(ck: Checker, world: int) -> None:
    """Stages megatron-core's local block spec builds, the plug-in's too: one without decoder
    layers (a pipeline layout giving the last stage only the loss) and one with only dense layers
    of a MoE model (``moe_layer_freq``: DeepSeek's first dense layers)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_fp8.config import apply_layer_flags
    from megatron_fp8.megatron import plugin

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
    cpu_accommodations()
    cases = {"a stage without layers": dict(pipeline_model_parallel_layout="E" + "t" * LAYERS + "|L"),
             "a dense-only stage of a MoE model": dict(
                 num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128, moe_grouped_gemm=True,
                 moe_token_dispatcher_type="alltoall", moe_layer_freq=[0] * (LAYERS // 2) + [1] * (LAYERS // 2))}
    base = {**vars(_config(world, ("tensorwise", "hybrid")))}
    for name, extra in cases.items():
        cfg = TransformerConfig(**{k: base[k] for k in ("num_layers", "hidden_size", "num_attention_heads",
                                                        "ffn_hidden_size", "pipeline_model_parallel_size",
                                                        "pipeline_dtype", "normalization", "fp8", "fp8_recipe",
                                                        "add_bias_linear")}, **extra)
        theirs = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
        ours = plugin.layer_spec(cfg)
        ck.true("pp_specs", len(ours.layer_specs) == len(theirs.layer_specs),
                f"{name}: {len(ours.layer_specs)} layers, megatron-core's local spec {len(theirs.layer_specs)}")
    # MEGATRON_FP8_CONFIG's rules name layers as in the whole model: each stage maps its own
    from megatron_fp8.config import parse_config

    model, offset = _chunk(_config(world, ("tensorwise", "hybrid")), None)
    names = plugin.global_names(model)
    ck.true("pp_specs", names["decoder.layers.1.mlp.linear_fc1"] == f"decoder.layers.{offset + 1}.mlp.linear_fc1",
            f"global names {sorted(v for v in names.values() if v.endswith('fc1'))} (offset {offset})")
    rules = parse_config({"layers": [{"match": f"decoder.layers.{LAYERS - 1}.mlp.linear_fc1",
                                      "save_original_input": True}]})
    missed: list[str] = []
    plan = apply_layer_flags(model, rules, names=names, unmatched=missed.append)
    last = parallel_state.is_pipeline_last_stage()
    ck.true("pp_specs", (list(plan) == [f"decoder.layers.{LAYERS - 1}.mlp.linear_fc1"]) == last
            and bool(missed) != last and model.decoder.layers[-1].mlp.linear_fc1.save_original_input == last,
            f"rules on stage {parallel_state.get_pipeline_model_parallel_rank()}: set {plan}, unmatched {missed}")
    parallel_state.destroy_model_parallel()


def main() -> int:
    rank, world = init_gloo()
    _cpu_shims()
    _cuda_to_cpu_shims()
    ck = Checker(rank)
    ck.guard("pp", "pipeline parallelism through megatron-core's schedule", check_pipeline, ck, world, None)
    ck.guard("pp", "interleaved (virtual) pipeline", check_pipeline, ck, world, 2)
    ck.guard("pp_specs", "stages without layers or experts", check_stage_specs, ck, world)
    code = ck.report()
    shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
