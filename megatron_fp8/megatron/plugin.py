"""The Megatron-LM plug-in: ``--spec megatron_fp8.megatron.plugin layer_spec``.

Megatron-LM resolves ``--spec MODULE NAME`` by importing ``MODULE``; importing this one calls
``install()``, and ``layer_spec`` is the spec. Nothing in Megatron-LM is edited:

* ``layer_spec(config, vp_stage=None)``: Megatron-LM's builder calls it with the model config (a
  ``TransformerConfig``, or main's ``GPTModelConfig`` holding one as ``.transformer``) and gets
  megatron-core's local decoder block spec with our linears and norms (``specs.to_fp8_spec``),
  built from the config (``num_moe_experts``, ``moe_grouped_gemm``, ``moe_layer_freq``,
  ``qk_layernorm``, ``normalization``, ``qk_l2_norm``; pipeline stages are Megatron's), with the
  SDPA core attention on CUDA (``MEGATRON_FP8_CORE_ATTENTION=local`` keeps megatron-core's). The older builder
  (``gpt_builders.py``) passes the function through uncalled; the transformer block then calls
  it with its config (``compat.py``).
* ``--fp8-format`` / ``--fp8-recipe`` / ``--fp8-margin`` / ``--fp8-amax-history-len`` /
  ``--fp8-amax-compute-algo`` open our FP8 region wherever Megatron opens its own, with TE or
  without; ``--recompute-granularity selective --recompute-modules layernorm moe_act`` run on our
  output-discarding recompute (``compat.py`` lists every replacement).
* ``MEGATRON_FP8_CONFIG=flags.yaml``: the ``layers:`` rules of a megatron_fp8 YAML config
  (``save_original_input`` per module-name glob, names as in a ``GPTModel``:
  ``decoder.layers.0.self_attention.linear_proj``), applied at the model's first forward.
  Rank 0 prints, at that first forward, the FP8 recipe, every module whose
  ``save_original_input`` is on (from the YAML, or set by Megatron for its recompute), and the
  recompute modules. Our layers built without a name take their module path there
  (``FP8Module.adopt_name``), so their warnings and errors say which layer.
* Megatron-LM's whole-iteration CUDA graph (``--cuda-graph-impl full_iteration``; megatron-core
  <= 0.16: ``--cuda-graph-impl local --cuda-graph-scope full_iteration``) captures our layers as
  they run: the first forward puts the capture's settings in force for the run
  (``graphed.run_as_captured``), so the eager warm-up iterations build what the capture launches.
  megatron-core's per-layer graphs (``--cuda-graph-impl local`` with other scopes) need TE's FP8
  state and are refused at config time (``compat.py``).

Without Transformer Engine, start the script through ``python -m megatron_fp8.megatron.launch``
(``launch.py``), which installs the plug-in first: megatron-core checks its ``TransformerConfig``
against TE before Megatron-LM imports the spec, and refuses MoE with ``--fp8-format``, or
``--fp8-format`` with ``--recompute-modules layernorm`` / ``moe_act``, for TE's reasons.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

from torch import nn

from ..config import FP8Config, apply_layer_flags, load_config
from ..modules.base import FP8Module
from ..ops.graph_buffers import ENV as GRAPHS_ENV
from ..ops.graph_buffers import held_note
from ..ops.graphed import graphs_on, run_as_captured
from . import rope
from .compat import patch_megatron, pipeline_stage, print_stage, stage_rank0, whole_iteration_graph
from .compat import print0 as _print0
from .fp8 import recipe_from_megatron
from .specs import default_core_attention, get_gpt_block_spec, import_megatron, with_core_attention

__all__ = ["layer_spec", "baseline_spec", "install", "ENV_CONFIG", "ENV_CORE_ATTENTION"]

ENV_CONFIG = "MEGATRON_FP8_CONFIG"
ENV_CORE_ATTENTION = "MEGATRON_FP8_CORE_ATTENTION"


def _transformer_config(config: Any) -> Any:
    """The ``TransformerConfig`` in what Megatron-LM passes (main's ``GPTModelConfig`` holds it
    as ``.transformer``)."""
    tcfg = getattr(config, "transformer", config)
    if not hasattr(tcfg, "num_layers") or not hasattr(tcfg, "hidden_size"):
        raise TypeError(
            f"megatron_fp8.megatron.plugin.layer_spec(config): expected Megatron's model config (a "
            f"TransformerConfig, or a GPTModelConfig holding one), got {type(config).__name__}; Megatron-LM "
            f"calls it with its config when run with `--spec megatron_fp8.megatron.plugin layer_spec`")
    return tcfg


def layer_spec(config: Any = None, vp_stage: int | None = None) -> Any:
    """The decoder block spec for ``config`` with megatron_fp8's linears and norms
    (``specs.get_gpt_block_spec``; see the module docstring)."""
    if config is None:
        raise TypeError("megatron_fp8.megatron.plugin.layer_spec needs Megatron's model config: Megatron-LM "
                        "calls it as layer_spec(config) or layer_spec(config, vp_stage=...)")
    install()
    return get_gpt_block_spec(_transformer_config(config), vp_stage, core_attention=core_attention())


def baseline_spec(config: Any = None, vp_stage: int | None = None) -> Any:
    """Megatron's own local spec (its linears, no FP8) with this plug-in's core attention: what
    ``scripts/bench_megatron.py`` compares our layers against, attention for attention
    (``--spec megatron_fp8.megatron.plugin baseline_spec``)."""
    if config is None:
        raise TypeError("megatron_fp8.megatron.plugin.baseline_spec needs Megatron's model config")
    install()
    cfg = _transformer_config(config)
    specs = import_megatron("megatron.core.models.gpt.gpt_layer_specs", "megatron_fp8.megatron.plugin")
    if getattr(cfg, "num_moe_experts", None):
        spec = specs.get_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                                normalization=getattr(cfg, "normalization", None),
                                                qk_l2_norm=getattr(cfg, "qk_l2_norm", False), vp_stage=vp_stage)
    else:
        spec = specs.get_gpt_layer_local_spec(getattr(cfg, "num_moe_experts", None), False,
                                              bool(getattr(cfg, "qk_layernorm", False)),
                                              normalization=getattr(cfg, "normalization", None))
    return with_core_attention(spec, core_attention())


def core_attention() -> str:
    """``MEGATRON_FP8_CORE_ATTENTION`` (``sdpa`` or ``local``), else ``sdpa`` on CUDA and
    megatron-core's ``local`` elsewhere."""
    return os.environ.get(ENV_CORE_ATTENTION) or default_core_attention()


# ---- per-layer flags from YAML, applied at the first forward ----
class _FirstForward:
    """A global forward pre-hook that configures each model (the outermost module called) at
    its first forward: applies the YAML rules and prints the start-up summary. It removes itself
    once as many models as there are pipeline chunks have run their first forward (ours, or
    Megatron's own such as the benchmark's baseline: a global hook puts every module call of the
    process on torch's slow path, ~1-3 us each); ``install()`` re-arms it."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.done: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.rules: FP8Config | None = None
        self.models = 0  # models configured since armed

    def arm(self) -> None:
        if self.handle is None:
            path = os.environ.get(ENV_CONFIG)
            self.rules = _load_rules(path) if path else None
            self.models = 0
            self.handle = nn.modules.module.register_module_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: Any) -> None:
        if module in self.done:
            return
        root = _unwrapped(module)
        ours = {path: m for path, m in root.named_modules() if isinstance(m, FP8Module)}
        if not ours:  # nothing to configure below: never walk this subtree again (Megatron's own
            self.done.update(root.modules())  # layers, e.g. the baseline, pay one set lookup a call)
            self.done.add(module)
            config = getattr(root, "config", None)
            _warn_high_precision_linears(root, config)
            if config is not None:  # a Megatron model of its own layers (not some small module run first)
                self._model_done()
            return
        self.done.add(module)
        self.done.update(root.modules())  # its own parts (an embedding, a block) are not models of their own
        for path, m in ours.items():  # warnings and errors name the layer, not only its class
            m.adopt_name(path)
        names = global_names(root)
        unmatched: list[str] = []  # (a pipeline stage holds some layers: a rule may match another's)
        plan: dict[str, bool] = {}
        if self.rules is not None and self.rules.layers:
            plan = apply_layer_flags(root, self.rules, names=names,
                                     unmatched=unmatched.append if pipeline_stage()[1] > 1 else None)
        config = getattr(next(iter(ours.values())), "config", None)
        notes = _whole_iteration_graph(config) if config is not None and whole_iteration_graph(config) else []
        notes += [f"megatron_fp8: {ENV_CONFIG}: {u} on this pipeline stage" for u in unmatched]
        ruled = self.rules is not None and bool(self.rules.layers)
        print_stage("\n".join([_summary(root, plan, config, names, ruled), *notes]))
        _warn_high_precision_linears(root, config)
        _at_first_forward_end(module, root)
        self._model_done()

    def _model_done(self) -> None:
        """Count a configured model; remove the hook once every pipeline chunk's has run."""
        self.models += 1
        if self.models >= _pipeline_chunks() and self.handle is not None:
            self.handle.remove()
            self.handle = None


_hook = _FirstForward()


def _whole_iteration_graph(config: Any) -> list[str]:
    """Megatron-LM captures whole iterations after eager warm-up steps: our layers run the
    capture's settings from the first step (``graphed.run_as_captured``), so the warm-up builds
    what the capture launches. Per-linear graphs would be captures inside its capture: refused. So
    is dropless MoE, which no layer can make capturable: megatron-core's token dispatchers and its
    grouped-experts container copy each step's token counts to the host (an event sync or
    ``tolist()`` inside the capture); with ``moe_pad_expert_input_to_capacity`` every expert gets
    ``capacity`` tokens, counts the host knows, as megatron-core's MoE guide says for CUDA graphs."""
    if getattr(config, "num_moe_experts", None) and not getattr(config, "moe_pad_expert_input_to_capacity", False):
        raise ValueError(f"megatron_fp8: Megatron-LM's whole-iteration CUDA graph (cuda_graph_impl="
                         f"{config.cuda_graph_impl!r}) with dropless MoE ({config.num_moe_experts} experts): "
                         "megatron-core copies each step's tokens per expert to the host, which a capture cannot "
                         "do. Add --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity (every expert "
                         "then gets a fixed number of tokens; tokens over it are dropped, which changes the model), "
                         "or train without the whole-iteration graph")
    if graphs_on():
        raise ValueError(f"megatron_fp8: {GRAPHS_ENV}=1 (per-linear CUDA graphs) with Megatron-LM's whole-iteration "
                         f"CUDA graph (cuda_graph_impl={config.cuda_graph_impl!r}) would capture inside its capture; "
                         f"unset {GRAPHS_ENV}: the whole-iteration graph captures our layers as they run")
    settings = run_as_captured()
    return [f"megatron_fp8: Megatron-LM's whole-iteration CUDA graph: our layers run the capture's routes from the "
            f"first step ({', '.join(f'{k}={v}' for k, v in settings.items())}), so its warm-up builds what it "
            f"captures"]


def high_precision_linears(root: nn.Module) -> list[str]:
    """Names of megatron-core's own tensor-parallel linears in ``root``, other than the output
    layer (high precision with Transformer Engine too): under ``--fp8-format`` they would train in
    high precision, e.g. multi-token-prediction layers, which Megatron-LM's builder builds from its
    own spec whatever ``--spec`` says."""
    tp = import_megatron("megatron.core.tensor_parallel", "megatron_fp8.megatron.plugin")
    theirs = (tp.ColumnParallelLinear, tp.RowParallelLinear)
    return [n for n, m in root.named_modules()
            if isinstance(m, theirs) and not isinstance(m, FP8Module) and not n.endswith("output_layer")]


def _warn_high_precision_linears(root: nn.Module, config: Any) -> None:
    """Never silent: with FP8 on, name the linears of ``high_precision_linears`` (rank 0, once per
    model, with the summary)."""
    if not getattr(config, "fp8", None) or not stage_rank0():  # (MTP layers: on the last stage)
        return
    names = high_precision_linears(root)
    if names:
        warnings.warn(f"megatron_fp8: {len(names)} linears are megatron-core's own and run in high precision under "
                      f"--fp8-format: {', '.join(_compress(names))}. Multi-token-prediction layers are built by "
                      f"Megatron-LM from its own spec, not --spec; turn them off (--mtp-num-layers) or accept them "
                      f"in high precision", RuntimeWarning, stacklevel=2)


def _at_first_forward_end(module: nn.Module, root: nn.Module) -> None:
    """Watch this first forward (``audit.Recorder``) and, at its end, name every layer whose
    ``save_original_input`` is on although no other module saves its input (there the flag keeps
    the high-precision input alive by itself and costs memory), and say what the per-layer CUDA
    graphs captured in it hold (``MEGATRON_FP8_GRAPHS=1``)."""
    from ..audit import Recorder

    rec = Recorder(root)
    watching = contextlib.ExitStack()
    watching.enter_context(rec.recording())

    def done(mod: nn.Module, args: Any, out: Any) -> None:
        watching.close()
        handle.remove()
        for lin in rec.report().linears:
            if lin.flag and lin.group_saves < 0:
                _print0(f"megatron_fp8: {lin.name}: save_original_input is on, but no other module saves its input "
                        f"{lin.input_shape}: the flag costs {-lin.group_saves:,} bytes here (a copy an FP8 copy "
                        f"would not need); turn it off, or run python -m megatron_fp8.audit on the model")
        note = held_note() if graphs_on() else None
        if note:
            _print0(note)

    handle = module.register_forward_hook(done, always_call=True)


def _load_rules(path: str) -> FP8Config:
    cfg = load_config(path)
    if "fp8" in cfg.model_fields_set:
        raise ValueError(
            f"{ENV_CONFIG}={path}: under Megatron-LM the recipe comes from --fp8-format / --fp8-recipe "
            f"(and --fp8-margin, --fp8-amax-*); remove the file's fp8: section and keep its layers: rules")
    return cfg


def _unwrapped(module: nn.Module) -> nn.Module:
    """The model inside Megatron's wrappers (DDP, Float16Module: each keeps it as ``.module``),
    so module names read ``decoder.layers.0...`` as in a bare ``GPTModel``."""
    while isinstance(getattr(module, "module", None), nn.Module):
        module = module.module
    return module


def _pipeline_chunks() -> int:
    try:
        from megatron.core import parallel_state as ps

        vp = ps.get_virtual_pipeline_model_parallel_world_size()
    except (ImportError, AttributeError, AssertionError, RuntimeError):
        return 1
    return int(vp or 1)


def _compress(names: Iterable[str]) -> list[str]:
    """``decoder.layers.{0,1,2}.x`` for names that differ only in their layer number."""
    groups: dict[str, list[str]] = {}
    for n in names:
        m = re.match(r"^(.*?layers\.)(\d+)(\..*)$", n)
        key, num = (f"{m.group(1)}{{}}{m.group(3)}", m.group(2)) if m else (n, "")
        groups.setdefault(key, []).append(num)
    out = []
    for key, nums in groups.items():
        out.append(key.format("{" + ",".join(nums) + "}" if len(nums) > 1 else nums[0]) if "{}" in key else key)
    return out


_DECODER_LAYER = re.compile(r"^(.*\bdecoder\.layers\.)(\d+)(\..*)?$")


def global_names(root: nn.Module) -> dict[str, str]:
    """Each module's name in ``root`` as in the whole ``GPTModel`` (what ``MEGATRON_FP8_CONFIG``'s
    rules and ``megatron_fp8.audit`` name): a pipeline stage, or a virtual stage's model chunk,
    numbers its decoder layers from 0, and megatron-core's ``TransformerLayer.layer_number`` is
    the layer's place in the whole model (from 1)."""
    modules = dict(root.named_modules())
    out: dict[str, str] = {}
    for name in modules:
        m = _DECODER_LAYER.match(name)
        number = getattr(modules.get(m.group(1) + m.group(2)), "layer_number", None) if m else None
        out[name] = f"{m.group(1)}{number - 1}{m.group(3) or ''}" if m and isinstance(number, int) else name
    return out


def _summary(root: nn.Module, plan: dict[str, bool], config: Any, names: dict[str, str] | None = None,
             ruled: bool = False) -> str:
    recipe = recipe_from_megatron(config, per_layer=True) if config is not None else None
    flagged = [(names or {}).get(n, n) for n, m in root.named_modules()
               if isinstance(m, FP8Module) and getattr(m, "save_original_input", False)]
    recompute = []
    if config is not None and getattr(config, "recompute_granularity", None) == "selective":
        recompute = [m for m in getattr(config, "recompute_modules", None) or [] if m in ("layernorm", "moe_act")]
    lines = [
        f"megatron_fp8: FP8 {recipe.describe() if recipe is not None else 'off (config.fp8 unset)'}",
        f"megatron_fp8: {ENV_CONFIG} rules set {len(plan)} modules" if plan or ruled else
        f"megatron_fp8: no per-layer rules ({ENV_CONFIG} unset)",
        "megatron_fp8: save_original_input on: " + (", ".join(_compress(flagged)) or "none"),
        "megatron_fp8: output-discarding recompute: " + (", ".join(recompute) or "none"),
    ]
    if recipe is not None and graphs_on():
        lines.append(f"megatron_fp8: {GRAPHS_ENV}=1: FP8 linears replay per-layer CUDA graphs (captured at their "
                     "first call; a layer that cannot be graphed warns and runs eagerly)")
    return "\n".join(lines)


def install() -> None:
    """Install the plug-in (idempotent): megatron-core's FP8 region, recompute and TE checks
    (``compat.py``), the fused RoPE where Transformer Engine's is missing (``rope.py``), and the
    first-forward hook for the YAML flags (re-armed if a model configured earlier removed it)."""
    patch_megatron(layer_spec)
    rope.install()
    _hook.arm()


install()  # Megatron-LM's --spec only imports this module
