"""torchrun worker: megatron-core ``GPTModel``s built through the Megatron-LM plug-in exactly as
Megatron-LM builds them, trained with ``config.fp8`` set and no FP8 region opened by this file
(gloo, CPU, 2 ranks; the dense model at TP=2, the MoE model at TP=1 on each rank, and both at
TP=2 with sequence parallelism).

Categories of the JSON report:

* ``build``: main's builder path (``layer_spec(model_config, vp_stage=...)`` on a
  ``GPTModelConfig``-like object) and the older path (the function passed through uncalled as
  ``transformer_layer_spec``) build the same model: same parameters, same loss bitwise;
  ``baseline_spec`` builds Megatron's own linears with the SDPA core attention.
* ``gemms``: per recipe (Megatron's names and formats), one forward+backward of the model runs
  three FP8 GEMMs per decoder linear (``gemm.record_gemms()``), none of them high precision;
  the loss is within ``LOSS_RTOL`` of the FP8-off loss.
* ``yaml``: ``MEGATRON_FP8_CONFIG``'s rule (``*.self_attention.linear_proj``) is applied at the
  first forward, rank 0's start-up summary names those modules, and (megatron-core's local
  attention hands ``linear_proj`` a fresh copy) rank 0 reports that the flag costs memory there.
* ``recompute``: ``recompute_granularity="selective"`` with ``recompute_modules=["layernorm"]``
  (dense) / ``["layernorm", "moe_act"]`` (MoE), per recipe: the loss, and the last layer's
  gradients up to its pre-MLP norm (that norm's and the MLP's), bitwise equal to recompute off;
  every other gradient within ``RECOMPUTE_FP8_RTOL`` in norm. Not all bitwise, because of
  Megatron's layer, not the recompute: a layer's input feeds the norm (whose torch decomposition
  uses it twice) and the residual, and with the norm checkpointed the three gradient terms are
  summed in another order (megatron-core's own ``CheckpointWithoutOutput`` does the same, and
  ours equals it bitwise, loss and every gradient, FP8 off, where Megatron's runs without TE).
  That moves the last bits of the gradient entering the last layer's attention; whether it
  moves any depends on the values, so on the machine's float kernels (an AMD EPYC with AVX2
  showed it where the earlier CI machines had not); FP8 current scaling then turns a last-bit
  change into a whole FP8 step wherever a value sits at a rounding boundary, so the earlier
  layers' gradients differ by a few tenths of a percent in norm (0.37% at most on that machine).
  A wrong recomputed tensor (stale, rescaled) moves them by O(1).
* ``sp``: ``sequence_parallel=True`` at TP=2 (megatron-core's torch norms refuse it; the
  plug-in's ``norm.Norm`` takes it): norm parameters marked, loss and gradients (norms' summed
  over the TP group, as ``finalize_model_grads`` sums them) equal the model without it within
  float reordering, BF16 and tensorwise; an MoE GPT at TP=2 (megatron-core requires sequence
  parallelism there) builds and trains under FP8.
* ``warn``: under ``config.fp8``, a model holding megatron-core's own linears (the baseline
  spec) is named once on rank 0 at its first forward (they train in high precision); ours is not.
* ``errors``: ``layer_spec()`` without a config, or with something that is not Megatron's
  config, and a ``MEGATRON_FP8_CONFIG`` file with an ``fp8:`` section raise, naming the fix.
* ``moe``: an MoE GPT (4 experts, top-2, shared expert, grouped GEMM, real router: uneven
  splits) under each recipe: FP8 GEMMs ran, splits were padded to the recipe's alignment.
* ``layers``: megatron-core's full recompute and its ``mlp`` / ``moe`` / ``shared_experts`` module
  recompute under ``config.fp8`` without TE (its ``te_checkpoint`` replaced): two micro-batches in
  a pipeline's order, losses, gradients and delayed scaling's amax histories bitwise those of
  the model without recompute.
* ``fusion``: ``gradient_accumulation_fusion=True`` (Megatron-LM's default) without apex: the model
  builds (megatron-core's output layer alone raises there), the output layer runs unfused on a
  copy of the config, our linears add their wgrads into ``main_grad`` themselves, and every
  parameter's gradient (``main_grad`` plus what Megatron's DDP hook would add) equals the model
  built with the fusion off bit for bit (FP32 parameters: both wgrads are FP32), tensorwise and
  FP8 off, dense at TP=2 (also with the output layer tied to the embedding) and MoE (grouped
  experts, shared expert) at TP=1, with apex's extension reported missing whether it is or not;
  rank 0 notes the unfused output layer once.
* ``padding``: Megatron's ``moe_router_padding_for_quantization`` (and its alias) under
  ``config.fp8`` builds (megatron-core alone refuses it without TE) and trains, every expert's
  tokens a multiple of megatron-core's alignment; the allgather dispatcher is refused.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import sys
import tempfile
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
from common import Checker, init_gloo, shutdown
from mcore_worker import _cpu_shims
from spec_worker import gpt_batch

warnings.filterwarnings("ignore")
_rules = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
_rules.write('layers:\n  - match: "*.self_attention.linear_proj"\n    save_original_input: true\n')
_rules.close()
os.environ["MEGATRON_FP8_CONFIG"] = _rules.name

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402

from megatron_fp8 import gemm  # noqa: E402
from megatron_fp8.audit import cpu_accommodations  # noqa: E402
from megatron_fp8.megatron import plugin  # noqa: E402
from megatron_fp8.modules.base import FP8Module  # noqa: E402

LOSS_RTOL = 2e-3
SP_RTOL = 1e-5  # sequence parallelism reorders float sums (reduce-scatter and all-gather for all-reduce)
# |g - g_ref| / |g_ref| (Frobenius): float sums reordered, then FP8 rounding steps (module docstring)
RECOMPUTE_FP8_RTOL = 2e-2
VOCAB, SEQ, BATCH = 512, 64, 2
RECIPES = (("delayed", "hybrid"), ("tensorwise", "hybrid"), ("blockwise", "hybrid"), ("mxfp8", "e4m3"))


def _config(tp: int, fp8: tuple[str, str] | None, recompute: list[str] | None = None, moe: bool = False,
            sp: bool = False, **extra: object) -> TransformerConfig:
    kw = dict(num_layers=2, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512,
              tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True,
              params_dtype=torch.float32,
              hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, bias_dropout_fusion=False,
              masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
              normalization="RMSNorm")
    if fp8 is not None:
        kw.update(fp8=fp8[1], fp8_recipe=fp8[0], fp8_amax_history_len=8, fp8_amax_compute_algo="max")
    if recompute:
        kw.update(recompute_granularity="selective", recompute_modules=recompute)
    if moe:
        kw.update(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128, moe_grouped_gemm=True,
                  moe_token_dispatcher_type="allgather", moe_shared_expert_intermediate_size=128,
                  moe_router_load_balancing_type="none")
    kw.update(extra)
    return TransformerConfig(**kw)


def _main_builder_spec(model_config: SimpleNamespace, vp_stage: int | None) -> object:
    """Megatron-LM main's ``GPTModelBuilder.build_model`` resolution of ``--spec``, verbatim in logic."""
    spec = plugin.layer_spec
    if not isinstance(spec, ModuleSpec) and callable(spec):
        if "vp_stage" in inspect.signature(spec).parameters:
            return spec(model_config, vp_stage=vp_stage)
        return spec(model_config)
    return spec


def _build(cfg: TransformerConfig, older_path: bool = False, tied: bool = False) -> GPTModel:
    plugin.install()  # what importing the plug-in did; re-arms the first-forward hook
    torch.manual_seed(0)
    spec = plugin.layer_spec if older_path else _main_builder_spec(SimpleNamespace(transformer=cfg), None)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", share_embeddings_and_output_weights=tied)


def _step(model: GPTModel) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[gemm.GemmCall], str]:
    tokens, pos, mask, labels = gpt_batch(VOCAB, SEQ, BATCH)
    model.zero_grad(set_to_none=True)
    out = io.StringIO()
    with gemm.record_gemms() as calls, contextlib.redirect_stdout(out):
        loss = model(tokens, pos, mask, labels=labels).float().mean()
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, list(calls), out.getvalue()


def _ours(model: GPTModel) -> dict[str, FP8Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FP8Module)}


def check_builders(ck: Checker, tp: int) -> None:
    cfg = _config(tp, ("tensorwise", "hybrid"))
    main_model, older = _build(cfg), _build(cfg, older_path=True)
    a = {n: p for n, p in main_model.named_parameters()}
    b = {n: p for n, p in older.named_parameters()}
    ck.true("build", sorted(a) == sorted(b), "the two builder paths give different parameters")
    ck.true("build", len(_ours(main_model)) == 8, f"{len(_ours(main_model))} megatron_fp8 linears, expected 8")
    with torch.no_grad():
        for n, p in b.items():
            p.copy_(a[n])
    ck.bitwise("build", "loss, main vs older builder path", _step(older)[0], _step(main_model)[0])
    unnamed = {n: m.name for n, m in _ours(older).items() if m.name != n}  # (the hook's model: the first run)
    ck.true("names", not unnamed, f"layers not named after their module paths at the first forward: {unnamed}")


def check_dense(ck: Checker, tp: int) -> None:
    ref_loss, *_ = _step(_build(_config(tp, None)))
    for recipe in RECIPES:
        name = "/".join(recipe)
        model = _build(_config(tp, recipe))
        loss, grads, calls, printed = _step(model)
        fp8_calls = [c for c in calls if c.name.startswith(("fprop", "dgrad", "wgrad"))]
        ck.true("gemms", len(calls) == 24 and len(fp8_calls) == 24,
                f"{name}: {len(calls)} GEMMs recorded ({len(fp8_calls)} fprop/dgrad/wgrad), expected 24")
        rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        ck.max_rel[f"loss {name}"] = rel
        ck.true("gemms", rel <= LOSS_RTOL, f"{name}: FP8 loss {loss.item():.6f} vs {ref_loss.item():.6f}")
        flags = {n: m.save_original_input for n, m in _ours(model).items()}
        want = {n: n.endswith("self_attention.linear_proj") for n in flags}
        ck.true("yaml", flags == want, f"{name}: save_original_input after the first forward: {flags}")
        if dist.get_rank() == 0:
            ck.true("yaml", "save_original_input on: decoder.layers.{0,1}.self_attention.linear_proj" in printed,
                    f"{name}: start-up summary was {printed!r}")
            # megatron-core's local attention hands linear_proj a fresh copy: the flag costs there, and is said
            cost = [line for line in printed.splitlines() if "linear_proj: save_original_input is on" in line]
            ck.true("yaml", len(cost) == 2 and all("the flag costs" in c for c in cost),
                    f"{name}: the flag's cost was not reported: {printed!r}")
        re_model = _build(_config(tp, recipe, recompute=["layernorm"]))
        copy_weights(model, re_model)
        model_again = _build(_config(tp, recipe))
        copy_weights(model, model_again)
        compare_recompute(ck, name, _step(model_again), _step(re_model), last="decoder.layers.1.")


def copy_weights(src: GPTModel, dst: GPTModel) -> None:
    with torch.no_grad():
        for (_, p), (_, q) in zip(src.named_parameters(), dst.named_parameters()):
            q.copy_(p)


def compare_recompute(ck: Checker, name: str, off: tuple, on: tuple, last: str) -> None:
    """Recompute on vs off: the loss and the gradients the reordered sum cannot reach (the last
    layer's pre-MLP norm and MLP: ``last``) bitwise, the rest close in norm (module docstring)."""
    (loss0, grads0, _, _), (loss1, grads1, _, _) = off, on
    ck.bitwise("recompute", f"{name} loss", loss1, loss0)
    ck.true("recompute", sorted(grads0) == sorted(grads1), f"{name}: different parameters got gradients")
    exact = (f"{last}pre_mlp_layernorm.", f"{last}mlp.")
    ck.true("recompute", any(n.startswith(exact) for n in grads0), f"{name}: no gradient under {exact}")
    for n, g in grads0.items():
        if n.startswith(exact):
            ck.bitwise("recompute", f"{name} grad {n}", grads1.get(n), g)
        else:
            ck.close("recompute", f"{name} grad {n}", grads1.get(n), g, RECOMPUTE_FP8_RTOL, norm=True)


def _interleaved(model: GPTModel) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[gemm.GemmCall], str]:
    """Two micro-batches as a pipeline schedule runs them: both forwards, then both backwards
    (the first one's recompute runs after the second forward, i.e. after delayed scaling moved
    on to a new step and scale)."""
    tokens, pos, mask, labels = gpt_batch(VOCAB, SEQ, BATCH)
    model.zero_grad(set_to_none=True)
    out = io.StringIO()
    with gemm.record_gemms() as calls, contextlib.redirect_stdout(out):
        first = model(tokens, pos, mask, labels=labels).float().mean()
        second = model(tokens.roll(1, dims=1), pos, mask, labels=labels.roll(1, dims=1)).float().mean()
        first.backward()
        second.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.stack([first.detach(), second.detach()]), grads, list(calls), out.getvalue()


def _histories(model: GPTModel) -> dict[str, torch.Tensor]:
    """Every delayed-scaling quantizer's amax history (name.key.role)."""
    out = {}
    for name, mod in _ours(model).items():
        for key, lq in mod._quantizers.items():
            for role in ("input", "weight", "grad_output"):
                hist = getattr(getattr(lq, role), "amax_history", None)
                if hist is not None:
                    out[f"{name}.{key}.{role}"] = hist.clone()
    return out


def check_layer_recompute(ck: Checker) -> None:
    """megatron-core's full recompute (layer chunks) and its ``mlp`` / ``moe`` / ``shared_experts``
    module recompute under ``config.fp8`` go through TE's checkpoint, which the plug-in replaces
    without TE (``recompute.checkpoint_layers``): per recipe, two micro-batches in a pipeline's
    order (``_interleaved``), the losses and every gradient bitwise those of the same model without
    recompute, and delayed scaling's amax histories too (the recompute casts with its forward's
    scales, not the later micro-batch's, and records nothing)."""
    cases = [("full", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), False),
             ("mlp", dict(recompute_granularity="selective", recompute_modules=["mlp"]), False),
             ("moe, shared_experts",
              dict(recompute_granularity="selective", recompute_modules=["moe", "shared_experts"]), True)]
    for recipe in RECIPES[:3]:
        for what, kw, moe in cases:
            name = f"{what} {'/'.join(recipe)}"
            base = _build(_config(1, recipe, moe=moe))
            again = _build(_config(1, recipe, moe=moe, **kw))
            copy_weights(base, again)
            off, on = _interleaved(base), _interleaved(again)
            # the recomputed forwards' GEMMs are recorded too: more than without recompute
            ck.true("layers", len(on[2]) > len(off[2]), f"{name}: {len(on[2])} FP8 GEMMs against {len(off[2])}")
            ck.bitwise("layers", f"{name} loss", on[0], off[0])
            ck.true("layers", sorted(off[1]) == sorted(on[1]), f"{name}: different parameters got gradients")
            for n, g in off[1].items():
                ck.bitwise("layers", f"{name} grad {n}", on[1].get(n), g)
            hist0, hist1 = _histories(base), _histories(again)
            same = sorted(hist0) == sorted(hist1) and all(torch.equal(hist1[k], v) for k, v in hist0.items())
            ck.true("layers", same, f"{name}: amax histories differ after the step")


def check_distributed_recompute(ck: Checker, tp: int) -> None:
    """Full recompute at TP=``tp`` with ``distribute_saved_activations`` (each rank keeps 1/tp of
    a chunk's input, gathered for backward): losses and gradients bitwise without recompute."""
    kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
              distribute_saved_activations=True)
    for recipe in (("tensorwise", "hybrid"), ("blockwise", "hybrid")):
        name = f"TP={tp} distributed {'/'.join(recipe)}"
        base, again = _build(_config(tp, recipe)), _build(_config(tp, recipe, **kw))
        copy_weights(base, again)
        off, on = _interleaved(base), _interleaved(again)
        ck.bitwise("layers", f"{name} loss", on[0], off[0])
        ck.true("layers", sorted(off[1]) == sorted(on[1]) and len(on[2]) > len(off[2]),
                f"{name}: parameters with gradients or GEMM counts differ")
        for n, g in off[1].items():
            ck.bitwise("layers", f"{name} grad {n}", on[1].get(n), g)
    _check_share_in_place(ck, tp)


def _check_share_in_place(ck: Checker, tp: int) -> None:
    """A first input the caller keeps (a pipeline stage's input) holds only this rank's share
    between forward and backward, as with megatron-core's checkpoint; a view, or an input the
    function also hands back, stays whole."""
    from megatron_fp8.recompute import checkpoint_layers

    group = parallel_state.get_tensor_model_parallel_group()
    torch.manual_seed(5)
    lin = torch.nn.Linear(8, 8)

    def passing_on(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return lin(t), t

    for case in ("tensor", "view", "handed back"):
        fn = passing_on if case == "handed back" else lin
        base = torch.randn(4, 2, 8)
        ref = base.clone().requires_grad_()
        out = fn(ref)
        sum(o.square().sum() for o in (out if isinstance(out, tuple) else (out,))).backward()
        lin.zero_grad()
        x = base.clone().requires_grad_()
        arg = x.view(4, 2, 8) if case == "view" else x
        out = checkpoint_layers(fn, arg, distribute_saved_activations=True, tp_group=group)
        kept = arg.untyped_storage().nbytes() // arg.element_size()
        ck.true("layers", kept == (64 // tp if case == "tensor" else 64),
                f"distributed input ({case}): {kept} elements kept between forward and backward")
        sum(o.square().sum() for o in (out if isinstance(out, tuple) else (out,))).backward()
        ck.true("layers", tuple(arg.shape) == (4, 2, 8), f"distributed input ({case}): shape {tuple(arg.shape)} "
                "after backward")
        ck.bitwise("layers", f"distributed input ({case}): its gradient", x.grad, ref.grad)


def check_megatron_recompute_equal(ck: Checker) -> None:
    """FP8 off (megatron-core's class then needs no TE): our recompute equals Megatron's own."""
    import megatron.core.tensor_parallel as mtp

    from megatron_fp8.megatron.compat import MegatronCheckpointWithoutOutput

    class Theirs(mtp.random.CheckpointWithoutOutput):  # megatron-core's, in its TE-free mode
        def __init__(self, fp8: object = None, **kwargs: object) -> None:  # 0.20: retain_input_tensors, ...
            super().__init__(fp8=None, **kwargs)
            self.fp8 = False

    for moe in (False, True):
        modules = ["layernorm", "moe_act"] if moe else ["layernorm"]
        ours, theirs = (_build(_config(1, None, recompute=modules, moe=moe)) for _ in range(2))
        copy_weights(ours, theirs)
        results = []
        for model, cls in ((ours, MegatronCheckpointWithoutOutput), (theirs, Theirs)):
            mtp.CheckpointWithoutOutput = cls
            results.append(_step(model))
        mtp.CheckpointWithoutOutput = MegatronCheckpointWithoutOutput
        (loss0, grads0, _, _), (loss1, grads1, _, _) = results
        what = "moe" if moe else "dense"
        ck.bitwise("recompute", f"{what}: ours vs megatron-core's recompute, loss", loss0, loss1)
        for n, g in grads1.items():
            ck.bitwise("recompute", f"{what}: ours vs megatron-core's recompute, grad {n}", grads0.get(n), g)


def check_moe(ck: Checker) -> None:
    for recipe in RECIPES:
        name = "/".join(recipe)
        base = _build(_config(1, recipe, moe=True))
        again = _build(_config(1, recipe, moe=True))
        re_model = _build(_config(1, recipe, recompute=["layernorm", "moe_act"], moe=True))
        ck.true("moe", type(base.decoder.layers[0].mlp.experts).__name__ == "GroupedMLP",
                f"experts are {type(base.decoder.layers[0].mlp.experts).__name__}")
        copy_weights(base, again)
        copy_weights(base, re_model)
        off = _step(again)
        linears = len(_ours(again))
        ck.true("moe", len(off[2]) >= 3 * linears, f"{name}: {len(off[2])} FP8 GEMMs for {linears} linears")
        on = _step(re_model)
        ck.true("moe", re_model.decoder.layers[0].mlp.experts.linear_fc2.save_original_input,
                f"{name}: moe_act recompute did not set save_original_input on the experts' fc2")
        compare_recompute(ck, f"moe {name}", off, on, last="decoder.layers.1.")


class _HostStream:
    """Stands in for the CUDA stream megatron-core's alltoall dispatcher copies token counts to the
    host on (test-only, CPU): the copies are synchronous here."""

    def wait_stream(self, other: object) -> None:
        pass

    def record_event(self) -> SimpleNamespace:
        return SimpleNamespace(synchronize=lambda: None)


def _alltoall_on_cpu() -> None:
    """megatron-core's alltoall dispatcher makes a CUDA stream at construction and copies on it
    (test-only shims, as ``_cpu_shims``): a host stand-in, current as well, so no side stream."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    stream = _HostStream()
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream
    torch.cuda.current_stream = lambda *a, **k: stream  # type: ignore[assignment]
    torch.cuda.stream = lambda s: contextlib.nullcontext()  # type: ignore[assignment]


def check_router_padding(ck: Checker) -> None:
    """``moe_router_padding_for_quantization`` (Megatron-LM's ``--moe-router-padding-for-quantization``,
    and its older alias): megatron-core refuses it with ``fp8`` unset, which the plug-in's config
    check hides from it; the config builds, the router pads every expert's tokens to megatron-core's
    FP8 alignment (16; MXFP8 32), the model trains with every decoder GEMM in FP8, its loss within
    ``LOSS_RTOL`` of the unpadded router's (the padding tokens carry zero probability; only the
    casts' amaxes see them). A dispatcher that cannot pad is refused naming the fix."""
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    _alltoall_on_cpu()
    for recipe, alias in ((("tensorwise", "hybrid"), False), (("blockwise", "hybrid"), True),
                          (("mxfp8", "e4m3"), False)):
        name = "/".join(recipe)
        plain = _build(_config(1, recipe, moe=True, moe_token_dispatcher_type="alltoall"))
        flag = "moe_router_padding_for_fp8" if alias else "moe_router_padding_for_quantization"
        padded_cfg = _config(1, recipe, moe=True, moe_token_dispatcher_type="alltoall", **{flag: True})
        ck.true("padding", padded_cfg.moe_router_padding_for_quantization and padded_cfg.fp8 == recipe[1],
                f"{name}, {flag}: after __post_init__: padding {padded_cfg.moe_router_padding_for_quantization}, "
                f"fp8 {padded_cfg.fp8!r}")
        padded = _build(padded_cfg)
        copy_weights(plain, padded)
        splits: list[list[int]] = []
        hooks = [layer.mlp.experts.register_forward_pre_hook(lambda m, a, seen=splits: seen.append(a[1].tolist()))
                 for layer in padded.decoder.layers]
        ref, got = _step(plain), _step(padded)
        for h in hooks:
            h.remove()
        align = get_align_size_for_quantization(padded_cfg)
        ck.true("padding", len(splits) == 2 and all(m % align == 0 for s in splits for m in s),
                f"{name}: tokens per expert {splits}, alignment {align}")
        ck.true("padding", len(got[2]) >= 3 * len(_ours(padded)) and bool(torch.isfinite(got[0]))
                and abs(got[0].item() - ref[0].item()) <= LOSS_RTOL * abs(ref[0].item()),
                f"{name}: {len(got[2])} FP8 GEMMs; loss {got[0].item()} against {ref[0].item()} unpadded")
    try:
        _config(1, ("tensorwise", "hybrid"), moe=True, moe_router_padding_for_quantization=True)  # allgather
    except ValueError as e:
        ck.true("padding", "allgather" in str(e) and "alltoall" in str(e), f"raised {e}")
    else:
        ck.fail("padding", "router padding with the allgather dispatcher was accepted")


def check_baseline_spec(ck: Checker, tp: int) -> None:
    """``baseline_spec``: Megatron's own linears, the plug-in's core attention."""
    from megatron.core.tensor_parallel import ColumnParallelLinear as MegatronColumn

    from megatron_fp8.megatron.attention import SDPAttention

    os.environ[plugin.ENV_CORE_ATTENTION] = "sdpa"
    try:
        model = GPTModel(config=_config(tp, None), transformer_layer_spec=plugin.baseline_spec(
            SimpleNamespace(transformer=_config(tp, None))), vocab_size=VOCAB, max_sequence_length=SEQ,
            position_embedding_type="rope")
    finally:
        del os.environ[plugin.ENV_CORE_ATTENTION]
    attn = model.decoder.layers[0].self_attention
    ck.true("build", isinstance(attn.core_attention, SDPAttention) and type(attn.linear_qkv) is MegatronColumn
            and not _ours(model), f"baseline_spec built {type(attn.core_attention)} / {type(attn.linear_qkv)}")


def _norm_params(model: GPTModel) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if "layernorm" in n}


def check_sequence_parallel(ck: Checker, tp: int) -> None:
    """``sequence_parallel=True`` at TP=``tp`` through the plug-in (megatron-core's torch norms
    refuse it; ours take it): every norm's parameters (the final norm's too) are marked for
    Megatron's TP gradient all-reduce; loss and gradients equal the same model without sequence
    parallelism within float reordering, norm gradients once summed over the TP group as
    ``finalize_model_grads`` sums them; FP8 (tensorwise) runs its GEMMs; MoE with TP, which
    megatron-core allows only with sequence parallelism, builds and trains."""
    group = parallel_state.get_tensor_model_parallel_group()
    for fp8 in (None, ("tensorwise", "hybrid")):
        name = "bf16" if fp8 is None else "/".join(fp8)
        plain, sp = _build(_config(tp, fp8)), _build(_config(tp, fp8, sp=True))
        copy_weights(plain, sp)
        norms = _norm_params(sp)
        marks = {n: getattr(p, "sequence_parallel", None) for n, p in norms.items()}
        ck.true("sp", len(marks) == 5 and all(marks.values()), f"{name}: norm parameters marked: {marks}")
        (loss0, grads0, _, _), (loss1, grads1, calls, _) = _step(plain), _step(sp)
        ck.close("sp", f"{name} loss", loss1, loss0, SP_RTOL if fp8 is None else LOSS_RTOL)
        if fp8 is not None:
            ck.true("sp", len(calls) == 24, f"{name}: {len(calls)} FP8 GEMMs with sequence parallelism, expected 24")
        for n, g in grads0.items():
            got = grads1.get(n)
            if n in norms and got is not None:
                got = got.clone()
                dist.all_reduce(got, group=group)  # what finalize_model_grads does for marked parameters
            ck.close("sp", f"{name} grad {n}", got, g, SP_RTOL if fp8 is None else LOSS_RTOL * 10)
    moe = _build(_config(tp, ("tensorwise", "hybrid"), moe=True, sp=True))
    loss, grads, calls, _ = _step(moe)
    marked = [n for n, p in _norm_params(moe).items() if getattr(p, "sequence_parallel", False)]
    ck.true("sp", bool(torch.isfinite(loss)) and len(calls) >= 3 * 6 and len(marked) == 5
            and all(n in grads for n in marked),
            f"MoE at TP={tp} with sequence parallelism: loss {loss.item()}, {len(calls)} FP8 GEMMs, "
            f"marked norms with gradients {[n for n in marked if n in grads]}")


def check_high_precision_warning(ck: Checker, tp: int) -> None:
    """Never silent: under ``config.fp8``, megatron-core's own linears (here the baseline spec's)
    are named at the first forward on rank 0; a model of ours gets no such warning. After either
    model's first forward the plug-in's global forward pre-hook is gone (it would put every
    module call, the baseline's too, on torch's slow path)."""
    for name, spec in (("baseline", plugin.baseline_spec), ("ours", plugin.layer_spec)):
        cfg = _config(tp, ("tensorwise", "hybrid"))
        plugin.install()
        torch.manual_seed(0)
        model = GPTModel(config=cfg, transformer_layer_spec=spec(SimpleNamespace(transformer=cfg)), vocab_size=VOCAB,
                         max_sequence_length=SEQ, position_embedding_type="rope")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _step(model)
        said = [str(w.message) for w in seen if "run in high precision" in str(w.message)]
        ck.true("warn", plugin._hook.handle is None and not torch.nn.modules.module._global_forward_pre_hooks,
                f"{name}: the first-forward hook still armed after the model's first step")
        if name == "ours" or dist.get_rank() != 0:
            ck.true("warn", not said, f"{name}, rank {dist.get_rank()}: warned {said}")
        else:
            ck.true("warn", len(said) == 1 and "decoder.layers.{0,1}.self_attention.linear_qkv" in said[0]
                    and "output_layer" not in said[0], f"baseline under config.fp8: {said}")


def check_hook_with_pipeline_chunks(ck: Checker) -> None:
    """Two virtual-pipeline chunks, the first holding an embedding (a module of Megatron's own with
    a ``config``): each chunk is configured at its first forward, the embedding is not taken for a
    model, and the hook goes once both chunks ran."""
    from megatron_fp8.parallel import ColumnParallelLinear

    class Emb(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config, self.w = SimpleNamespace(fp8=None), torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w(x)

    class Chunk(torch.nn.Module):
        def __init__(self, emb: bool) -> None:
            super().__init__()
            self.config = SimpleNamespace(fp8=None)
            self.emb = Emb() if emb else None
            self.lin = ColumnParallelLinear(8, 8, config=SimpleNamespace(
                tensor_model_parallel_size=1, sequence_parallel=False, params_dtype=torch.float32,
                use_cpu_initialization=True, fp8=None), bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(self.emb(x) if self.emb is not None else x)[0]

    configured: list[str] = []
    chunks, summary, rules = plugin._pipeline_chunks, plugin._summary, os.environ.pop("MEGATRON_FP8_CONFIG", None)
    plugin._pipeline_chunks = lambda: 2
    plugin._summary = lambda root, plan, config, *_: (configured.append(type(root).__name__), "")[1]
    try:
        if plugin._hook.handle is not None:  # re-armed below without this worker's YAML rules
            plugin._hook.handle.remove()
            plugin._hook.handle = None
        plugin.install()
        first, second = Chunk(True), Chunk(False)
        first(torch.randn(2, 8))
        armed = plugin._hook.handle is not None
        second(torch.randn(2, 8))
        ck.true("warn", armed and configured == ["Chunk", "Chunk"] and plugin._hook.handle is None,
                f"chunks configured {configured}, hook armed after the first {armed}, after both "
                f"{plugin._hook.handle is not None}")
    finally:
        plugin._pipeline_chunks, plugin._summary = chunks, summary
        if rules is not None:
            os.environ["MEGATRON_FP8_CONFIG"] = rules


def check_fusion_without_apex(ck: Checker, tp: int, moe: bool = False) -> None:
    from megatron.core.tensor_parallel import layers

    available = layers._grad_accum_fusion_available
    layers._grad_accum_fusion_available = False  # as without apex, where apex is installed too
    try:
        cases = [(("tensorwise", "hybrid"), False), (None, False)] + ([] if moe else [(("tensorwise", "hybrid"), True)])
        for fp8, tied in cases:
            _fusion_case(ck, tp, moe, fp8, tied)
    finally:
        layers._grad_accum_fusion_available = available


def _fusion_case(ck: Checker, tp: int, moe: bool, fp8: tuple[str, str] | None, tied: bool) -> None:
    """One model of ``check_fusion_without_apex`` (``tied``: the output layer reads the embedding's
    weight, Megatron-LM's default)."""
    cfg = _config(tp, fp8, moe=moe, gradient_accumulation_fusion=True)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fused = _build(cfg, tied=tied)
    plain = _build(_config(tp, fp8, moe=moe), tied=tied)
    copy_weights(plain, fused)
    head = fused.output_layer
    ck.true("fusion", cfg.gradient_accumulation_fusion and not head.gradient_accumulation_fusion
            and head.config is not cfg and not head.config.gradient_accumulation_fusion,
            "the output layer was not built unfused on a copy of the config")
    noted = out.getvalue().count("fused_weight_gradient_mlp_cuda is not installed")
    first = fp8 is not None and not moe and not tied  # the process's first such build
    ck.true("fusion", noted == (int(dist.get_rank() == 0) if first else 0),
            f"the unfused output layer noted {noted} times (rank 0: once per process)")
    ours = [m for m in _ours(fused).values() if hasattr(m, "gradient_accumulation_fusion")]
    ck.true("fusion", bool(ours) and all(m.gradient_accumulation_fusion for m in ours),
            "our linears do not fuse under the config's gradient_accumulation_fusion")
    for p in fused.parameters():  # as Megatron's DDP gives every parameter
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        p.grad_added_to_main_grad = False
    _step(fused)
    for p in fused.parameters():  # Megatron's DDP hook
        if p.grad is not None and not p.grad_added_to_main_grad:
            p.main_grad.add_(p.grad)
    weights = [p for m in ours for n, p in m.named_parameters(recurse=False) if n.startswith("weight")]
    ck.true("fusion", bool(weights) and all(p.grad_added_to_main_grad for p in weights),
            "a linear of ours did not add its wgrad into main_grad")
    head_weight = head.weight if head.weight is not None else fused.shared_embedding_or_output_weight()  # tied
    ck.true("fusion", not head_weight.grad_added_to_main_grad, "the output layer claims a fused wgrad")
    _, want, _, _ = _step(plain)
    tag = f"{'moe ' if moe else ''}{'tied ' if tied else ''}{fp8[0] if fp8 else 'bf16'}"
    for n, p in fused.named_parameters():
        ck.bitwise("fusion", f"{tag} {n}", p.main_grad, want.get(n))


def check_errors(ck: Checker) -> None:
    for bad, match in ((None, "needs Megatron's model config"), (object(), "expected Megatron's model config")):
        try:
            plugin.layer_spec(bad)
        except TypeError as e:
            ck.true("errors", match in str(e), f"layer_spec({bad!r}) raised {e}")
        else:
            ck.fail("errors", f"layer_spec({bad!r}) did not raise")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write("fp8:\n  recipe: blockwise\nlayers: []\n")
        f.flush()
        try:
            plugin._load_rules(f.name)
        except ValueError as e:
            ck.true("errors", "--fp8-format" in str(e) and "fp8: section" in str(e), f"raised {e}")
        else:
            ck.fail("errors", "an fp8: section in MEGATRON_FP8_CONFIG was accepted")


def main() -> int:
    rank, world = init_gloo()
    _cpu_shims()
    ck = Checker(rank)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    cpu_accommodations()
    ck.guard("errors", "bad input to the plug-in", check_errors, ck)
    ck.guard("build", "main vs older builder path", check_builders, ck, world)
    ck.guard("build", "the baseline spec", check_baseline_spec, ck, world)
    ck.guard("gemms", "dense GPT under config.fp8", check_dense, ck, world)
    ck.guard("sp", "sequence parallelism through the plug-in", check_sequence_parallel, ck, world)
    ck.guard("warn", "megatron-core's own linears under config.fp8 named", check_high_precision_warning, ck, world)
    ck.guard("warn", "the first-forward hook with pipeline chunks", check_hook_with_pipeline_chunks, ck)
    ck.guard("layers", "full recompute with distributed saved activations", check_distributed_recompute, ck, world)
    ck.guard("fusion", "gradient_accumulation_fusion without apex", check_fusion_without_apex, ck, world)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    ck.guard("moe", "MoE GPT under config.fp8", check_moe, ck)
    ck.guard("fusion", "gradient_accumulation_fusion without apex, MoE", check_fusion_without_apex, ck, 1, True)
    ck.guard("padding", "the router's padding for FP8", check_router_padding, ck)
    ck.guard("recompute", "our recompute vs megatron-core's", check_megatron_recompute_equal, ck)
    ck.guard("layers", "megatron-core's layer recompute under config.fp8", check_layer_recompute, ck)
    code = ck.report()
    parallel_state.destroy_model_parallel()
    shutdown()
    os.unlink(_rules.name)
    return code


if __name__ == "__main__":
    sys.exit(main())
