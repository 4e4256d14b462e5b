"""Memory audit: where ``save_original_input`` and output-discarding recompute pay, and where they
cost, measured on one step of the user's model (``mf.memory.audit(model, step)``).

``step()`` runs one forward+backward. During its forward the audit records, by storage identity
(no guesses from module types):

* every tensor autograd saves, and which module saved it;
* the input of every megatron_fp8 linear (anything with a ``save_original_input`` flag) and the
  FP8 recipe it ran under;
* the output of every norm module (output-discarding recompute candidates).

Per linear the flag saves the columnwise FP8 copy of its input (tokens x K bytes, plus 1x128 or
1x32 scales for the block recipes) *if another module saves that input anyway*; otherwise the
layer would keep the high-precision input alive by itself and the flag costs
``input bytes - copy bytes``. FP8 off: the flag changes nothing. The report recommends the flag
exactly where it saves bytes, and writes that as the ``layers:`` section of a megatron_fp8 YAML.

``python -m megatron_fp8.audit --model gpt|moe|mla [--core-attention sdpa|local] [--config X.yaml]
[--write-config out.yaml] [--json] [--plot audit.png]`` audits a small megatron-core GPT built
from our spec on CPU (megatron-core needed).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import yaml
from torch import nn

from .autocast import current_fp8_state
from .memory import _is_parameter, keeps_saved_tensors
from .recipe import Float8BlockScaling, MXFP8BlockScaling, Recipe

__all__ = ["audit", "AuditReport", "GPTShape", "LinearAudit", "RecomputeCandidate", "Recorder", "columnwise_copy_bytes",
           "example_gpt"]


def columnwise_copy_bytes(recipe: Recipe | None, tokens: int, k: int) -> int:
    """Bytes of the columnwise FP8 copy of a ``[tokens, k]`` input that a linear saves without the
    flag: one byte an element, plus 1x128 (block) or 1x32 (MXFP8) scales along the tokens; a
    per-tensor scale is saved on both paths, so it does not count. 0 with FP8 off."""
    if recipe is None:
        return 0
    if isinstance(recipe, Float8BlockScaling):
        return tokens * k + 4 * k * -(-tokens // 128)
    if isinstance(recipe, MXFP8BlockScaling):
        return tokens * k + k * -(-tokens // 32)
    return tokens * k


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass
class LinearAudit:
    """One linear: its input, who else saves it, and what the flag does there.

    Linears that read the same input (``shares_input_with``: e.g. MLA's q and kv
    down-projections) are decided together: with the flag on all of them they keep that one
    storage instead of one FP8 copy each. ``flag_saves`` is this layer's share of what the flag
    on the whole group saves (negative: costs) against the flag off; the group's total decides."""

    name: str
    input_shape: tuple[int, ...]
    input_bytes: int
    recipe: str
    flag: bool
    saved_by_others: list[str]  # modules other than the group's linears that save the input
    shares_input_with: list[str]
    copy_bytes: int  # the columnwise FP8 copy the layer saves without the flag
    flag_saves: int
    group_saves: int  # what the flag on every linear of the group saves

    @property
    def recommended(self) -> bool:
        return self.group_saves > 0


@dataclass
class RecomputeCandidate:
    """A norm whose output could be discarded after forward and recomputed before backward
    (Megatron's ``--recompute-modules layernorm``)."""

    name: str
    output_bytes: int
    saved_by: list[str]  # modules that save the output now
    consumers_without_flag: list[str]  # megatron_fp8 linears reading it: discarding needs their flag on
    frees: int  # bytes saved against now by discarding it with those flags on


@dataclass
class AuditReport:
    linears: list[LinearAudit]
    recompute: list[RecomputeCandidate]
    activation_bytes: int  # unique non-parameter storages saved in forward, now
    notes: list[str] = field(default_factory=list)

    def _group_bytes(self, members: list[LinearAudit], flagged: set[str]) -> int:
        """What a group of linears reading one input keeps for it: the FP8 copies of the
        unflagged ones, and the input itself where a flagged one keeps it alone."""
        keeps_input = any(m.name in flagged for m in members) and not members[0].saved_by_others
        return sum(m.copy_bytes for m in members if m.name not in flagged) + (members[0].input_bytes
                                                                            if keeps_input else 0)

    def _groups(self) -> list[list[LinearAudit]]:
        groups: dict[tuple[str, ...], list[LinearAudit]] = {}
        for lin in self.linears:
            groups.setdefault(tuple(sorted([lin.name, *lin.shares_input_with])), []).append(lin)
        return list(groups.values())

    def _bytes_with(self, flagged: set[str]) -> int:
        now = {lin.name for lin in self.linears if lin.flag}
        return self.activation_bytes - sum(self._group_bytes(g, now) - self._group_bytes(g, flagged)
                                           for g in self._groups())

    @property
    def with_recommendation(self) -> int:
        """Saved-activation bytes with ``recommend()`` applied (flags on where they pay, off
        where they cost)."""
        return self._bytes_with({lin.name for lin in self.linears if lin.recommended})

    @property
    def floor(self) -> int:
        """Every recompute candidate discarded (its consumers flagged), and the recommendation
        applied to the other linears."""
        flagged = {n for c in self.recompute for n in c.consumers_without_flag}
        rest = {lin.name for lin in self.linears if lin.recommended and lin.name not in flagged}
        return self._bytes_with(rest | {lin.name for lin in self.linears if lin.flag and lin.name in flagged}) - \
            sum(c.frees for c in self.recompute)

    def recommend(self) -> dict[str, dict[str, bool]]:
        """``{module name: {"save_original_input": flag}}`` for every linear whose best flag
        differs from its flag now, and every one where the flag pays."""
        return {lin.name: {"save_original_input": lin.recommended} for lin in self.linears
                if lin.recommended or lin.flag}

    def to_yaml(self, path: str | None = None) -> str:
        """The recommendation as a megatron_fp8 config's ``layers:`` section (loadable as is)."""
        rules = [{"match": name, "save_original_input": v["save_original_input"]}
                 for name, v in self.recommend().items()]
        text = "# written by megatron_fp8.audit: save_original_input where another module saves the input\n"
        text += yaml.safe_dump({"layers": rules}, sort_keys=False)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "linears": [dict(asdict(lin), recommended=lin.recommended) for lin in self.linears],
            "recompute": [asdict(c) for c in self.recompute],
            "totals": {"activation_bytes": self.activation_bytes, "with_recommendation": self.with_recommendation,
                       "floor": self.floor},
            "notes": self.notes,
        }

    def table(self) -> str:
        rows = [f"{'linear':48} {'input':>16} {'recipe':>24} {'flag':>5} {'flag saves':>12}  saved also by"]
        for lin in self.linears:
            also = ", ".join(lin.saved_by_others) or "-"
            if lin.shares_input_with:
                also += f" (decided with {', '.join(lin.shares_input_with)}: {lin.group_saves:,} together)"
            rows.append(f"{lin.name:48} {str(lin.input_shape):>16} {lin.recipe:>24} {str(lin.flag):>5} "
                        f"{lin.flag_saves:>12,}  {also}")
        if self.recompute:
            rows.append("")
            rows.append(f"{'recompute candidate':48} {'frees':>12}  consumers that need the flag")
            for c in self.recompute:
                rows.append(f"{c.name:48} {c.frees:>12,}  {', '.join(c.consumers_without_flag) or '-'}")
        rows.append("")
        rows.append(f"saved activations now {self.activation_bytes:,} B; with the recommendation "
                    f"{self.with_recommendation:,} B; floor (every candidate recomputed) {self.floor:,} B")
        rows.extend(self.notes)
        return "\n".join(rows)

    def plot(self, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 0.3 * len(self.linears) + 1.5))
        vals = [lin.flag_saves / 2**20 for lin in self.linears]
        ax.barh([lin.name for lin in self.linears], vals, color=["tab:green" if v > 0 else "tab:red" for v in vals])
        ax.axvline(0, color="k", lw=0.8)
        ax.set_xlabel("MiB the flag saves (green) or costs (red)")
        ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(path, dpi=110)


class Recorder:
    """The forward's saves, the linears' inputs and the norms' outputs, by storage."""

    def __init__(self, model: nn.Module) -> None:
        while isinstance(getattr(model, "module", None), nn.Module):  # Megatron's DDP / Float16Module
            self.wrappers = getattr(self, "wrappers", ()) + (model,)
            model = model.module
        self.names = {id(m): n or type(m).__name__ for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.savers: dict[int, set[str]] = {}
        self.nbytes: dict[int, int] = {}
        self.params: set[int] = set()
        self.keep: list[torch.Tensor] = []  # storages stay alive (and their keys unique) while recorded
        self.inputs: list[tuple[str, nn.Module, torch.Tensor, Recipe | None]] = []
        self.norm_outputs: list[tuple[str, torch.Tensor]] = []

    def pre(self, mod: nn.Module, args: Any) -> None:
        name = self.names.get(id(mod), type(mod).__name__)
        self.stack.append(name)
        if hasattr(mod, "save_original_input") and args and isinstance(args[0], torch.Tensor):
            state = current_fp8_state()
            recipe = state.recipe if state is not None and state.enabled else None
            self.inputs.append((name, mod, args[0], recipe))
            self.keep.append(args[0])

    def post(self, mod: nn.Module, args: Any, out: Any) -> None:
        name = self.stack.pop() if self.stack else type(mod).__name__
        if "Norm" in type(mod).__name__ and isinstance(out, torch.Tensor) and not name.endswith("final_layernorm"):
            self.norm_outputs.append((name, out))
            self.keep.append(out)

    @keeps_saved_tensors
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() != -1:  # inside backward (a recompute): not the forward's
            return t
        key = _key(t)
        self.savers.setdefault(key, set()).add(self.stack[-1] if self.stack else "<no module>")
        self.nbytes[key] = t.untyped_storage().nbytes()
        if _is_parameter(t):
            self.params.add(key)
        self.keep.append(t)
        return t

    def report(self) -> AuditReport:
        """The audit of what was recorded (one forward suffices: saves happen there)."""
        return _report(self)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        h1 = nn.modules.module.register_module_forward_pre_hook(self.pre)
        h2 = nn.modules.module.register_module_forward_hook(self.post, always_call=True)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
                yield
        finally:
            h1.remove()
            h2.remove()


def _recipe_name(recipe: Recipe | None) -> str:
    if recipe is None:
        return "off"
    fmt = getattr(recipe, "fp8_format", None)
    return f"{type(recipe).__name__.replace('Scaling', '')}/{getattr(fmt, 'value', fmt)}"


def audit(model: nn.Module, step: Callable[[], Any]) -> AuditReport:
    """Run ``step()`` (one forward+backward of ``model``) once and report, per megatron_fp8
    linear, what ``save_original_input`` saves or costs there, and per norm what discarding its
    output would free (module docstring)."""
    rec = Recorder(model)
    with rec.recording():
        step()
    return rec.report()


def _report(rec: Recorder) -> AuditReport:
    """What a recorded forward says (``Recorder.report``)."""
    readers: dict[int, set[str]] = {}
    for name, _, x, _ in rec.inputs:
        readers.setdefault(_key(x), set()).add(name)
    linears: dict[str, LinearAudit] = {}
    for name, mod, x, recipe in rec.inputs:
        if name in linears:  # a layer called twice in a step: its first call decides
            continue
        key, group = _key(x), readers[_key(x)]
        others = sorted(s for s in rec.savers.get(key, ()) if s not in group)
        tokens, k = x.numel() // x.shape[-1], x.shape[-1]
        copy = columnwise_copy_bytes(recipe, tokens, k)
        size = x.untyped_storage().nbytes()
        share = 0 if others or recipe is None else size // len(group) + (size % len(group) if name == min(group)
                                                                         else 0)
        linears[name] = LinearAudit(name, tuple(x.shape), size, _recipe_name(recipe), bool(mod.save_original_input),
                                    others, sorted(group - {name}), copy, copy - share if recipe else 0, 0)
    for lin in linears.values():  # the group decides together
        lin.group_saves = sum(linears[n].flag_saves for n in [lin.name, *lin.shares_input_with])
    consumers: dict[int, set[str]] = {}
    for name, mod, x, _ in rec.inputs:
        if not mod.save_original_input:
            consumers.setdefault(_key(x), set()).add(name)
    recompute = []
    for name, out in rec.norm_outputs:  # discarding frees the output where someone keeps it, and
        # flagging its consumers for it drops their FP8 copies
        need = sorted(consumers.get(_key(out), ()))
        saved_by = sorted(rec.savers.get(_key(out), ()))
        frees = (out.untyped_storage().nbytes() if saved_by else 0) + sum(linears[n].copy_bytes for n in need)
        recompute.append(RecomputeCandidate(name, out.untyped_storage().nbytes(), saved_by, need, frees))
    activations = sum(n for key, n in rec.nbytes.items() if key not in rec.params)
    notes = []
    if not rec.inputs:
        notes.append("no megatron_fp8 linear ran in the step (nothing to audit)")
    return AuditReport(list(linears.values()), recompute, activations, notes)


# ---- command line: a small megatron-core GPT from our spec, on CPU ----
@dataclass(frozen=True)
class GPTShape:
    """Sizes of the example GPT (the command's defaults: small enough for a CPU step in seconds)."""

    layers: int = 2
    hidden: int = 256
    heads: int = 4
    ffn: int = 512
    seq: int = 256
    batch: int = 2
    vocab: int = 1024


def example_gpt(kind: str, core_attention: str, shape: GPTShape = GPTShape(), device: str = "cpu"
                ) -> tuple[nn.Module, Callable[[], Any]]:
    """A megatron-core GPTModel from our spec (``kind``: ``gpt`` dense, ``moe`` with grouped and
    shared experts, ``mla`` multi-latent attention), BF16 in Megatron's ``Float16Module``, and a
    ``step()`` doing one forward+backward on fixed random tokens. Initialises a one-rank process
    group and megatron-core's model parallelism where none is."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from .megatron import get_gpt_layer_spec

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29541", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    moe, mla, h = kind == "moe", kind == "mla", shape.hidden
    experts = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=shape.ffn // 2, moe_grouped_gemm=True,
                   moe_token_dispatcher_type="allgather", moe_shared_expert_intermediate_size=shape.ffn // 2,
                   moe_router_load_balancing_type="none")
    common = dict(num_layers=shape.layers, hidden_size=h, num_attention_heads=shape.heads, ffn_hidden_size=shape.ffn,
                  use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True, hidden_dropout=0.0,
                  attention_dropout=0.0, add_bias_linear=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                  gradient_accumulation_fusion=False, persist_layer_norm=False, normalization="RMSNorm")
    if mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        # DeepSeek's RoPE dim, 64: kv_down's output (kv_lora_rank + 64) ends in a partial 128x128 block
        cfg = MLATransformerConfig(**common, q_lora_rank=h, kv_lora_rank=h // 2, qk_head_dim=h // shape.heads,
                                   qk_pos_emb_head_dim=64, v_head_dim=h // shape.heads, rope_type="rope",
                                   qk_layernorm=True)  # as the spec (megatron-core 0.20 checks they agree)
    else:
        cfg = TransformerConfig(**common, num_query_groups=max(1, shape.heads // 2), **(experts if moe else {}))
    cpu_accommodations()
    spec = get_gpt_layer_spec(num_experts=4 if moe else None, moe_grouped_gemm=moe, normalization="RMSNorm",
                              multi_latent_attention=mla, qk_layernorm=mla, core_attention=core_attention)
    torch.manual_seed(0)
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=shape.vocab, max_sequence_length=shape.seq,
                   position_embedding_type="rope" if mla else "learned_absolute")  # MLA applies RoPE itself
    from megatron.core.transformer.module import Float16Module

    model = Float16Module(cfg, gpt).to(device)  # BF16 as Megatron trains it (names keep the "module." prefix)
    b, s = shape.batch, shape.seq
    tokens = torch.randint(0, shape.vocab, (b, s), device=device)
    pos = torch.arange(s, device=device).expand(b, s)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=device).tril().logical_not()

    def step() -> None:
        model(tokens, pos, mask, labels=tokens).float().mean().backward()

    return model, step


def cpu_accommodations() -> None:
    """Run megatron-core's models on the CPU (this command; the test workers too): megatron-core
    assumes CUDA in three places a model's step reaches, which this process points at the CPU:
    the local attention's CUDA RNG fork (for a dropout of 0), the router moving its weight to
    ``torch.cuda.current_device()``, and megatron-core 0.16's router testing a TE-only name."""
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
        # (MLA's RoPE moves its frequencies there too)
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def main(argv: list[str] | None = None) -> int:
    import argparse

    from .config import apply_layer_flags, load_config

    ap = argparse.ArgumentParser(prog="python -m megatron_fp8.audit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("gpt", "moe", "mla"), default="gpt")
    ap.add_argument("--core-attention", choices=("sdpa", "local"), default="sdpa")
    ap.add_argument("--config", help="a megatron_fp8 YAML: its recipe, and its layers: flags applied first")
    ap.add_argument("--write-config", help="write the recommendation as a layers: section here")
    ap.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    ap.add_argument("--plot", help="write a bar chart of what the flag saves or costs per linear")
    args = ap.parse_args(argv)
    model, step = example_gpt(args.model, args.core_attention)
    cfg = load_config(args.config) if args.config else None
    if cfg is not None and cfg.layers:
        apply_layer_flags(model.module, cfg)  # names as in a GPTModel (inside Float16Module)
    recipe = cfg.recipe() if cfg is not None else Float8BlockScaling()
    report = audit(model, lambda: _in_region(step, recipe))
    print(json.dumps(report.to_json(), indent=1) if args.json else report.table())
    if args.write_config:
        report.to_yaml(args.write_config)
    if args.plot:
        report.plot(args.plot)
    return 0


def _in_region(step: Callable[[], Any], recipe: Recipe) -> None:
    from . import fp8_autocast

    with fp8_autocast(fp8_recipe=recipe):
        step()


if __name__ == "__main__":
    raise SystemExit(main())
