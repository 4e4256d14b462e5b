"""torchrun worker: a 2-layer megatron-core ``GPTModel`` built from Megatron's local layer spec
vs from ``megatron_fp8.megatron.get_gpt_layer_spec`` (gloo, CPU, TP = world size).

Checks (categories of the JSON report):

* ``names``: both models have the same parameter names and shapes, and ours holds
  megatron_fp8 linears in every linear slot of the decoder layers.
* ``hp``: FP8 off, same weights: loss and every parameter gradient *bitwise* equal.
* ``fp8``: under ``fp8_context`` for Megatron's recipes delayed/tensorwise/blockwise/mxfp8
  the loss is within ``LOSS_RTOL`` of the high-precision loss, and the decoder linears' weight
  gradients have SQNR >= ``GRAD_SQNR_DB`` against it.
* ``soi``: ``save_original_input`` set on ``*.self_attention.linear_proj`` by
  ``config.apply_layer_flags``: loss and gradients bitwise equal to the flag off, per recipe.
* ``moe``: an MoE ``TransformerLayer`` (4 experts, top-2, shared expert, allgather
  dispatcher): our spec with SequentialMLP experts, and with ``moe_grouped_gemm=True``
  (``TEGroupedMLP`` holding our grouped linears, Megatron's expert weights copied in), are
  *bitwise* equal to Megatron's local spec (output, input grad, every weight grad), FP8 off;
  the grouped layer under each FP8 recipe is within ``MOE_FP8_RTOL`` of it. Run in eval mode:
  megatron-core refuses MoE + TP without SP in training mode, and its local spec's torch norm
  refuses SP; eval only affects dropout (0 here).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from common import Checker, init_gloo, shutdown
from mcore_worker import _cpu_shims

from megatron_fp8.audit import cpu_accommodations
from megatron_fp8.config import FP8Config, LayerRule, apply_layer_flags
from megatron_fp8.megatron import fp8_context, get_gpt_layer_spec
from megatron_fp8.parallel import ColumnParallelLinear, RowParallelLinear

warnings.filterwarnings("ignore")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402

LOSS_RTOL = 2e-3  # |loss_fp8 - loss_hp| / |loss_hp|
GRAD_SQNR_DB = 14.0  # decoder-linear weight gradients, FP8 vs high precision
MOE_FP8_RTOL = 2e-2  # max|y_fp8 - y_hp| / max|y_hp| of the MoE layer output
VOCAB, SEQ, BATCH = 512, 64, 2
MEGATRON_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def _config(tp: int) -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512,
                             tensor_model_parallel_size=tp, use_cpu_initialization=True,
                             params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                             add_bias_linear=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
                             gradient_accumulation_fusion=False, persist_layer_norm=False)


def _build(spec: object, tp: int) -> GPTModel:
    return GPTModel(config=_config(tp), transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="learned_absolute")


def _weights(tp: int) -> dict[str, torch.Tensor]:
    """Weights of Megatron's own model, biases made non-zero (Megatron zero-initialises them)."""
    torch.manual_seed(0)
    ref = _build(get_gpt_layer_local_spec(), tp)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    return {n: (p.detach() + 0.02 * torch.randn(p.shape, generator=g) if n.endswith("bias") else p.detach()).clone()
            for n, p in ref.named_parameters()}


def _load(model: GPTModel, weights: dict[str, torch.Tensor]) -> GPTModel:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    return model


def gpt_batch(vocab: int = VOCAB, seq: int = SEQ, batch: int = BATCH) -> tuple[torch.Tensor, ...]:
    """Tokens, positions, the causal mask and labels of a GPT step (the workers share it)."""
    g = torch.Generator().manual_seed(5)  # the same tokens on every rank (TP replicates the input)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    pos = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).tril().logical_not()  # True: masked out
    return tokens, pos, mask, labels


def run_checks(checks: list[tuple[str, str, Callable[..., None], tuple[Any, ...]]], tp: int | None = None,
               shims: tuple[Callable[[], None], ...] = ()) -> int:
    """A megatron-core worker's life: gloo, the CPU shims, parallel_state at TP=``tp`` (default
    the world), each check guarded (``ck`` first, then its args), the report, the teardown."""
    rank, world = init_gloo()
    _cpu_shims()
    for shim in shims:
        shim()
    ck = Checker(rank)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp or world)
    cpu_accommodations()
    for cat, name, fn, args in checks:
        ck.guard(cat, name, fn, ck, *args)
    code = ck.report()
    parallel_state.destroy_model_parallel()
    shutdown()
    return code


def _step(model: GPTModel, ctx: object | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    tokens, pos, mask, labels = gpt_batch()
    model.zero_grad(set_to_none=True)
    if ctx is None:
        loss = model(tokens, pos, mask, labels=labels).float().mean()
    else:
        with ctx:  # type: ignore[attr-defined]
            loss = model(tokens, pos, mask, labels=labels).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    noise = (got.double() - want.double()).pow(2).sum().item()
    return float("inf") if noise == 0 else 10 * torch.log10(want.double().pow(2).sum() / noise).item()


def check_structure(ck: Checker, theirs: GPTModel, ours: GPTModel) -> None:
    a = {n: tuple(p.shape) for n, p in theirs.named_parameters()}
    b = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    ck.true("names", a == b, f"parameter names/shapes differ: {sorted(set(a.items()) ^ set(b.items()))[:6]}")
    want = {"self_attention.linear_qkv": ColumnParallelLinear, "self_attention.linear_proj": RowParallelLinear,
            "mlp.linear_fc1": ColumnParallelLinear, "mlp.linear_fc2": RowParallelLinear}
    modules = dict(ours.named_modules())
    for i in range(2):
        for slot, cls in want.items():
            name = f"decoder.layers.{i}.{slot}"
            ck.true("names", type(modules.get(name)) is cls, f"{name} is {type(modules.get(name)).__name__}")


def compare(ck: Checker, tp: int) -> None:
    weights = _weights(tp)
    theirs = _load(_build(get_gpt_layer_local_spec(), tp), weights)
    ours = _load(_build(get_gpt_layer_spec(), tp), weights)
    check_structure(ck, theirs, ours)
    loss_t, grads_t = _step(theirs)
    loss_o, grads_o = _step(ours)
    ck.bitwise("hp", "loss", loss_o, loss_t)
    ck.true("hp", sorted(grads_o) == sorted(grads_t), "different parameters received gradients")
    for n, g in grads_t.items():
        ck.bitwise("hp", f"grad {n}", grads_o.get(n), g)

    soi = FP8Config(layers=[LayerRule(match="*.self_attention.linear_proj", save_original_input=True)])
    for name in MEGATRON_RECIPES:
        settings = SimpleNamespace(fp8="hybrid", fp8_recipe=name, fp8_margin=0, fp8_amax_history_len=16,
                                   fp8_amax_compute_algo="max")
        if name in ("blockwise", "mxfp8"):
            settings.fp8 = "e4m3"
        runs = []
        for flag in (False, True):
            model = _load(_build(get_gpt_layer_spec(), tp), weights)
            if flag:
                plan = apply_layer_flags(model, soi)
                ck.true("soi", sorted(plan) == [f"decoder.layers.{i}.self_attention.linear_proj" for i in range(2)],
                        f"apply_layer_flags matched {sorted(plan)}")
            runs.append(_step(model, fp8_context(settings)))
        (loss_f, grads_f), (loss_s, grads_s) = runs
        rel = abs(loss_f.item() - loss_t.item()) / abs(loss_t.item())
        ck.max_rel[f"fp8 loss {name}"] = rel
        ck.true("fp8", rel <= LOSS_RTOL, f"{name}: loss {loss_f.item():.6f} vs {loss_t.item():.6f} (rel {rel:.2e})")
        for n, g in grads_t.items():
            if n.startswith("decoder.layers.") and n.endswith(".weight") and "linear_" in n:
                db = _sqnr_db(grads_f[n], g)
                key = f"fp8 grad noise/signal {name}"  # the report keeps the worst (largest)
                ck.max_rel[key] = max(ck.max_rel.get(key, 0.0), 10 ** (-db / 10))
                ck.true("fp8", db >= GRAD_SQNR_DB, f"{name}: grad {n} SQNR {db:.1f} dB < {GRAD_SQNR_DB}")
        ck.bitwise("soi", f"{name} loss", loss_s, loss_f)
        for n, g in grads_f.items():
            ck.bitwise("soi", f"{name} grad {n}", grads_s.get(n), g)


def _moe_config(tp: int) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512,
                             tensor_model_parallel_size=tp, use_cpu_initialization=True,
                             params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                             add_bias_linear=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                             gradient_accumulation_fusion=False, persist_layer_norm=False, num_moe_experts=4,
                             moe_router_topk=2, moe_ffn_hidden_size=256, moe_token_dispatcher_type="allgather",
                             moe_shared_expert_intermediate_size=256)


def _moe_run(layer: torch.nn.Module, ctx: object) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    x = torch.randn(SEQ, BATCH, 256, generator=torch.Generator().manual_seed(3)).requires_grad_()
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).tril().logical_not()
    layer.zero_grad(set_to_none=True)
    with ctx:  # type: ignore[attr-defined]
        y, _ = layer(x, attention_mask=mask)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(4)))
    assert x.grad is not None
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}


def _expert_name(name: str) -> str:
    """Our grouped ``mlp.experts.linear_fc1.weight2`` -> Megatron's sequential
    ``mlp.experts.local_experts.2.linear_fc1.weight``."""
    m = re.fullmatch(r"mlp\.experts\.(linear_fc\d)\.weight(\d+)", name)
    return f"mlp.experts.local_experts.{m.group(2)}.{m.group(1)}.weight" if m else name


def compare_moe(ck: Checker, tp: int) -> None:
    cfg = _moe_config(tp)
    layers = {}
    for kind, spec in (("megatron", get_gpt_layer_local_spec(num_experts=4)),
                       ("sequential", get_gpt_layer_spec(num_experts=4)),
                       ("grouped", get_gpt_layer_spec(num_experts=4, moe_grouped_gemm=True))):
        torch.manual_seed(0)
        layers[kind] = build_module(spec, config=cfg, layer_number=1).eval()
    ref = dict(layers["megatron"].named_parameters())
    with torch.no_grad():
        for n, p in layers["grouped"].named_parameters():
            p.copy_(ref[_expert_name(n)])
    ck.true("moe", type(layers["grouped"].mlp.experts.linear_fc1).__name__ == "ColumnParallelGroupedLinear",
            f"grouped experts hold {type(layers['grouped'].mlp.experts.linear_fc1).__name__}")
    y0, dx0, g0 = _moe_run(layers["megatron"], contextlib.nullcontext())
    for kind in ("sequential", "grouped"):
        y, dx, grads = _moe_run(layers[kind], contextlib.nullcontext())
        ck.bitwise("moe", f"{kind} out", y, y0)
        ck.bitwise("moe", f"{kind} dx", dx, dx0)
        ck.true("moe", sorted(_expert_name(n) for n in grads) == sorted(g0), f"{kind}: gradient names differ")
        for n, g in grads.items():
            ck.bitwise("moe", f"{kind} grad {n}", g, g0.get(_expert_name(n)))
    for name in MEGATRON_RECIPES:
        settings = SimpleNamespace(fp8="e4m3", fp8_recipe=name, fp8_amax_history_len=16, fp8_amax_compute_algo="max")
        y, dx, _ = _moe_run(layers["grouped"], fp8_context(settings))
        ck.close("moe", f"grouped {name} out", y, y0, MOE_FP8_RTOL)


def main() -> int:
    world = int(os.environ["WORLD_SIZE"])
    return run_checks([("hp", "GPTModel: Megatron local spec vs megatron_fp8 spec", compare, (world,)),
                       ("moe", "MoE layer: Megatron local spec vs megatron_fp8 spec", compare_moe, (world,))])


if __name__ == "__main__":
    sys.exit(main())
