"""torchrun worker (2 ranks, TP=2, gloo, CPU): our SDPA core attention against megatron-core's
``DotProductAttention``, and what it does for ``save_original_input`` on ``linear_proj``.

Categories of the JSON report:

* ``core``: forward and the grads of q, k, v within ``CORE_RTOL`` of megatron-core's local core
  attention (FP32, causal and padding masks, GQA 4 heads / 2 groups and MHA).
* ``view``: in a GPTModel built with ``core_attention="sdpa"``, every layer's ``linear_proj``
  input shares its storage with the output SDPA saved for backward.
* ``bytes``: per recipe, ``save_original_input`` on every ``linear_proj`` lowers the model's
  saved-activation bytes by exactly each layer's columnwise FP8 copy of that input (its data
  and, for block scaling, its 1x128 scales); loss and grads bitwise equal with the flag on/off.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
from common import Checker
from spec_worker import gpt_batch, run_checks

warnings.filterwarnings("ignore")
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

import megatron_fp8 as mf  # noqa: E402
from megatron_fp8.config import FP8Config, LayerRule, apply_layer_flags  # noqa: E402
from megatron_fp8.megatron import get_gpt_layer_spec  # noqa: E402
from megatron_fp8.megatron.attention import SDPAttention  # noqa: E402
from megatron_fp8.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling  # noqa: E402

CORE_RTOL = 1e-5
S, B, VOCAB = 128, 2, 512


def _config(tp: int, groups: int | None) -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=groups,
                             ffn_hidden_size=512, tensor_model_parallel_size=tp, use_cpu_initialization=True,
                             params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                             add_bias_linear=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                             gradient_accumulation_fusion=False, persist_layer_norm=False)


def compare_core(ck: Checker, tp: int) -> None:
    for groups in (None, 2):
        cfg = _config(tp, groups)
        heads, kv = 4 // tp, (groups or 4) // tp
        for mask_type in (AttnMaskType.causal, AttnMaskType.padding):
            theirs = DotProductAttention(cfg, 1, mask_type, "self")
            ours = SDPAttention(cfg, 1, mask_type, "self")
            g = torch.Generator().manual_seed(3)
            q = torch.randn(S, B, heads, 64, generator=g, requires_grad=True)
            k = torch.randn(S, B, kv, 64, generator=g, requires_grad=True)
            v = torch.randn(S, B, kv, 64, generator=g, requires_grad=True)
            mask = torch.ones(S, S, dtype=torch.bool).tril().logical_not().expand(B, 1, S, S).clone()
            if mask_type is AttnMaskType.padding:
                mask[1, :, :, S - 7:] = True  # the second sequence's last tokens are padding
            dy = torch.randn(S, B, heads * 64, generator=g)
            outs = []
            for core in (theirs, ours):
                for t in (q, k, v):
                    t.grad = None
                y = core(q, k, v, mask)
                y.backward(dy)
                outs.append((y.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()))
            what = f"groups={groups} {mask_type.name}"
            for name, a, b in zip(("out", "dq", "dk", "dv"), outs[1], outs[0]):
                ck.close("core", f"{what} {name}", a, b, CORE_RTOL)


def _model(tp: int) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(config=_config(tp, 2), transformer_layer_spec=get_gpt_layer_spec(core_attention="sdpa"),
                    vocab_size=VOCAB, max_sequence_length=S, position_embedding_type="rope")


def _sdpa_outputs(loss: torch.Tensor) -> list[torch.Tensor]:
    """The outputs every SDPA backward node of the graph saved."""
    found, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if "ScaledDotProduct" in type(fn).__name__:
            found.append(fn._saved_output)
        todo.extend(f for f, _ in fn.next_functions)
    return found


def check_view(ck: Checker, tp: int) -> None:
    model = _model(tp)
    inputs: list[torch.Tensor] = []
    hooks = [layer.self_attention.linear_proj.register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
             for layer in model.decoder.layers]
    tokens, pos, mask, labels = gpt_batch(VOCAB, S, B)
    loss = model(tokens, pos, mask, labels=labels).float().mean()
    for h in hooks:
        h.remove()
    saved = {t.untyped_storage().data_ptr() for t in _sdpa_outputs(loss)}
    ck.true("view", len(saved) == 2, f"{len(saved)} SDPA outputs saved, expected one per layer")
    for i, x in enumerate(inputs):
        ck.true("view", x.untyped_storage().data_ptr() in saved,
                f"layer {i}: linear_proj's input is not the storage SDPA saved (shape {tuple(x.shape)}, "
                f"strides {x.stride()})")


def _columnwise_bytes(recipe: object, tokens: int, k: int) -> int:
    """Bytes of the columnwise FP8 copy of a [tokens, k] input: data, plus 1x128 scales for blocks
    (a per-tensor scale is saved on both paths)."""
    scales = 4 * k * (tokens // 128) if isinstance(recipe, Float8BlockScaling) else 0
    return tokens * k + scales


def check_bytes(ck: Checker, tp: int) -> None:
    for recipe in (DelayedScaling(amax_history_len=8), Float8CurrentScaling(), Float8BlockScaling()):
        runs = []
        for flag in (False, True):
            model = _model(tp)
            if flag:
                apply_layer_flags(model, FP8Config(layers=[LayerRule(match="*.linear_proj",
                                                                     save_original_input=True)]))
            tokens, pos, mask, labels = gpt_batch(VOCAB, S, B)
            with mf.fp8_autocast(fp8_recipe=recipe), mf.memory.track_saved_tensors(model) as saved:
                loss = model(tokens, pos, mask, labels=labels).float().mean()
            loss.backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
            runs.append((saved.activation_bytes, loss.detach(), grads))
        (off, loss0, g0), (on, loss1, g1) = runs
        want = 2 * _columnwise_bytes(recipe, S * B, 256 // tp)  # two layers; proj's input is [S*B, hidden/TP]
        name = type(recipe).__name__
        ck.true("bytes", off - on == want, f"{name}: the flag saved {off - on} bytes, expected {want}")
        ck.bitwise("bytes", f"{name} loss", loss1, loss0)
        for n, g in g0.items():
            ck.bitwise("bytes", f"{name} grad {n}", g1[n], g)


def main() -> int:
    tp = int(os.environ["WORLD_SIZE"])
    return run_checks([("core", "SDPA core vs DotProductAttention", compare_core, (tp,)),
                       ("view", "linear_proj reads SDPA's saved output", check_view, (tp,)),
                       ("bytes", "save_original_input on linear_proj", check_bytes, (tp,))])


if __name__ == "__main__":
    sys.exit(main())
