"""What the Megatron-LM plug-in changes in megatron-core at run time, and why.

Megatron-LM opens its FP8 region, and its output-discarding recompute keeps FP8 state, through
Transformer Engine. With our layers (and TE absent, or present but not ours) that would train in
BF16 without a word, or fail. ``patch_megatron`` replaces, in megatron-core's modules already
imported and in the modules later imports read from:

================================  ==============================================================
megatron-core name                replaced by, and why
================================  ==============================================================
``get_fp8_context``               ``fp8.get_fp8_context``: our region from ``config.fp8*``
                                  (Megatron's returns TE's region, or ``nullcontext()`` w/o TE)
``tensor_parallel.``              ``MegatronCheckpointWithoutOutput``: our output-discarding
``CheckpointWithoutOutput``       recompute (resumes our FP8 region; Megatron's needs TE's
                                  ``FP8GlobalStateManager`` even with FP8 off)
``is_te_min_version``             False when TE is not installed (Megatron's compares ``None``
                                  with a version and raises ``TypeError``, e.g. building shared
                                  experts with ``config.fp8`` set)
``TransformerConfig.              with TE absent and ``config.fp8`` set: ``recipe_from_megatron``
__post_init__``                   checks the FP8 fields, then megatron-core's own checks run with
                                  ``fp8`` hidden: its FP8 checks are about TE (MoE FP8 needs TE
                                  >= 1.7, layernorm / moe_act recompute TE >= 2.6, delayed
                                  scaling refuses that recompute, which ours runs exactly);
                                  then per-layer CUDA graphs (``cuda_graph_impl='local'``) are
                                  refused: megatron-core keeps their FP8 state in TE.
                                  The router's padding for FP8 (``moe_router_padding_for_
                                  quantization``), which megatron-core refuses with ``fp8``
                                  unset, is hidden with it and checked by its own rules
``te_checkpoint``                 ``te_checkpoint``: ``recompute.checkpoint_layers``; megatron-core
                                  recomputes layer chunks (``recompute_granularity='full'``) and
                                  ``mlp`` / ``moe`` / ``shared_experts`` through TE's checkpoint
                                  whenever ``config.fp8`` is set (the recompute must run in the
                                  forward's FP8 state), which without TE is None or raises, and
                                  with TE replays TE's FP8 state, not our region
``transformer_block.              a spec that is the plug-in's ``layer_spec`` *function* is called
_get_block_submodules``           with the block's config (Megatron-LM's older builder path passes
                                  ``--spec`` objects through uncalled)
``tensor_parallel.Column/``       without apex's ``fused_weight_gradient_mlp_cuda``: megatron-core's
``RowParallelLinear.__init__``    own linears (the output layer, multi-token prediction) are built
                                  with ``gradient_accumulation_fusion`` off (a copy of the config),
                                  so Megatron-LM's default ``--gradient-accumulation-fusion`` trains:
                                  ours fuse without apex, theirs add their wgrad unfused (the column
                                  one raises at build, the row one would fail in backward). Rank 0
                                  says so once. Not with ``defer_embedding_wgrad_compute``, which
                                  needs apex whoever builds the output layer
================================  ==============================================================

Each replacement is idempotent and leaves every other input to Megatron's own code.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..autocast import is_fp8_enabled
from ..parallel.base import wgrad_fusion
from ..recompute import CheckpointWithoutOutput, checkpoint_layers
from .fp8 import get_fp8_context, recipe_from_megatron
from .specs import import_megatron

__all__ = ["patch_megatron", "MegatronCheckpointWithoutOutput", "have_te", "rank0", "print0", "pipeline_stage",
           "stage_rank0", "print_stage"]


def rank0() -> bool:
    """Whether this process prints the plug-in's notes (rank 0, or no process group)."""
    return not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0


def print0(text: str) -> None:
    """``print`` on rank 0 only, flushed (notes go to the training log, next to Megatron's)."""
    if rank0():
        print(text, flush=True)


def pipeline_stage() -> tuple[int, int]:
    """``(this rank's pipeline stage, the number of stages)``; ``(0, 1)`` without megatron-core's
    initialised parallel state."""
    from ..parallel._mcore import parallel_state

    ps = parallel_state()
    if ps is None:
        return 0, 1
    return ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()


def stage_rank0() -> bool:
    """Whether this process prints notes about its pipeline stage's layers: rank 0 without
    pipeline parallelism, else the stage's first tensor- and data-parallel rank (each stage holds
    other layers, so rank 0 alone would leave the later stages' unsaid)."""
    from ..parallel._mcore import parallel_state

    ps = parallel_state()
    if ps is None or ps.get_pipeline_model_parallel_world_size() == 1:
        return rank0()
    try:
        dp = ps.get_data_parallel_rank(with_context_parallel=True)
    except TypeError:  # a megatron-core without the keyword
        dp = ps.get_data_parallel_rank()
    return ps.get_tensor_model_parallel_rank() == 0 and dp == 0


def print_stage(text: str) -> None:
    """``print`` by ``stage_rank0`` ranks, the stage named where there are several, flushed."""
    if stage_rank0():
        stage, stages = pipeline_stage()
        print(f"megatron_fp8: pipeline stage {stage} of {stages}:\n{text}" if stages > 1 else text, flush=True)


@functools.cache
def have_te() -> bool:
    """Whether Transformer Engine is importable (looked up once, not imported)."""
    return importlib.util.find_spec("transformer_engine") is not None


class MegatronCheckpointWithoutOutput(CheckpointWithoutOutput):
    """megatron-core's ``CheckpointWithoutOutput(fp8=...)`` on megatron_fp8's recompute.

    Same calls (``checkpoint(fn, *args)``, ``discard_output_and_register_recompute(t)``). The
    consumers' ``save_original_input`` is checked only when FP8 is on: megatron-core sets it on
    the consumers itself whenever ``config.fp8`` is set (``set_save_original_input``), and with
    FP8 off a linear saves its high-precision input anyway."""

    def __init__(self, fp8: Any = None, ckpt_manager: Any = None, retain_input_tensors: bool = False,
                 name: str | None = None) -> None:
        # retain_input_tensors (megatron-core 0.20): ours never frees the inputs, only the outputs
        if ckpt_manager is not None:
            raise ValueError("megatron_fp8: megatron-core's CheckpointWithoutOutputManager (hyper-connection "
                             "recompute) is not supported with megatron_fp8's recompute; turn that recompute off")
        super().__init__(name)
        self._fp8_on = False

    def checkpoint(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._fp8_on = is_fp8_enabled()
        return super().checkpoint(fn, *args)

    def _check_consumers(self) -> None:
        if self._fp8_on:
            super()._check_consumers()


def _replace_everywhere(name: str, old: Any, new: Any) -> None:
    """``new`` for ``name`` in every loaded ``megatron`` module that holds it as ``old``."""
    for mod_name, mod in list(sys.modules.items()):
        if mod is not None and (mod_name == "megatron" or mod_name.startswith("megatron.")) \
                and name in vars(mod) and vars(mod)[name] is old:
            setattr(mod, name, new)


# megatron-core modules that take TE's checkpoint under config.fp8 (module level or at call time
# from the extension module); those present are imported at install so that all get ours
_TE_CHECKPOINT_USERS = ("megatron.core.extensions.transformer_engine", "megatron.core.transformer.transformer_block",
                        "megatron.core.recompute", "megatron.core.transformer.transformer_layer",
                        "megatron.core.transformer.moe.moe_layer", "megatron.core.transformer.multi_token_prediction",
                        "megatron.core.models.hybrid.hybrid_block")


def te_checkpoint(forward_func: Callable[..., Any], distribute_saved_activations: bool,
                  get_rng_state_tracker: Callable[[], Any] | None, tp_group: Any, *args: Any, **kwargs: Any) -> Any:
    """megatron-core's ``te_checkpoint`` signature on ``recompute.checkpoint_layers`` (our layers'
    FP8 state replayed; Megatron's CUDA RNG tracker is the one ``get_rng_state_tracker`` returns,
    replayed with the other RNG states)."""
    fn = functools.partial(forward_func, **kwargs) if kwargs else forward_func
    return checkpoint_layers(fn, *args, distribute_saved_activations=distribute_saved_activations,
                             tp_group=tp_group)


te_checkpoint._megatron_fp8 = True  # type: ignore[attr-defined]


def _patch_te_checkpoint() -> None:
    """Ours in the megatron-core modules that call ``te_checkpoint`` (without TE they hold None,
    nothing, or the extension module's function that raises for want of TE), and wherever
    another megatron module holds one of those. With TE installed too: the FP8 region is ours
    (``get_fp8_context`` is replaced either way), and TE's checkpoint replays only TE's FP8 state,
    so its recompute would run our layers outside their forward's region."""
    users = []
    for name in _TE_CHECKPOINT_USERS:
        try:
            users.append(importlib.import_module(name))
        except ImportError:
            continue
    ext = sys.modules.get("megatron.core.extensions.transformer_engine")
    raising = getattr(ext, "te_checkpoint", None) if ext is not None else None
    for mod in users:
        mod.te_checkpoint = te_checkpoint  # type: ignore[attr-defined]
    _replace_everywhere("te_checkpoint", None, te_checkpoint)
    if raising is not None:
        _replace_everywhere("te_checkpoint", raising, te_checkpoint)


def _te_safe(is_te_min_version: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(is_te_min_version)
    def checked(version: str, check_equality: bool = True) -> bool:
        return have_te() and is_te_min_version(version, check_equality)

    checked._megatron_fp8 = True  # type: ignore[attr-defined]
    return checked


def _post_init_without_te(post_init: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(post_init)
    def checked(self: Any) -> None:
        if not getattr(self, "fp8", None) or have_te():
            post_init(self)
            return
        recipe_from_megatron(self, per_layer=True)  # our checks of the FP8 fields, first
        fp8 = self.fp8
        # the router's padding for FP8 refuses a config without fp8: hidden with it, checked below
        padding = {k: getattr(self, k) for k in _ROUTER_PADDING if getattr(self, k, None)}
        self.fp8 = None  # megatron-core's FP8 checks are about TE's layers and versions
        for k in padding:
            setattr(self, k, False)
        try:
            post_init(self)
        finally:
            self.fp8 = fp8
            for k, v in padding.items():
                setattr(self, k, v)
        if padding:
            _router_padding(self)
        if per_layer_graphs(self):
            raise ValueError(
                "megatron_fp8: cuda_graph_impl='local' with per-layer scopes and config.fp8 set needs Transformer "
                "Engine (megatron-core's CudaGraphManager keeps FP8 state in TE's FP8GlobalStateManager). Capture "
                "the whole iteration instead (--cuda-graph-impl full_iteration; megatron-core <= 0.16: "
                "--cuda-graph-impl local --cuda-graph-scope full_iteration), where our layers are captured as they "
                "run; or use our per-linear graphs (MEGATRON_FP8_GRAPHS=1) with --cuda-graph-impl none")

    checked._megatron_fp8 = True  # type: ignore[attr-defined]
    return checked


_ROUTER_PADDING = ("moe_router_padding_for_quantization", "moe_router_padding_for_fp8")


def _router_padding(config: Any) -> None:
    """megatron-core's own rules for ``--moe-router-padding-for-quantization`` (and its older
    alias ``--moe-router-padding-for-fp8``), which its ``__post_init__`` applies only with
    ``fp8`` visible: the alias turns the flag on; the dispatchers that cannot pad, and (megatron-core
    main) the inference-optimized MoE layers, refuse it.
    The router then pads each expert's tokens to megatron-core's FP8 alignment (16; MXFP8 32);
    our grouped linears pad further where a recipe needs more (128 rows for 1x128 blocks)."""
    if getattr(config, "moe_router_padding_for_fp8", False) and hasattr(config, "moe_router_padding_for_quantization"):
        config.moe_router_padding_for_quantization = True
    if getattr(config, "transformer_impl", None) == "inference_optimized" \
            and getattr(config, "num_moe_experts", None) is not None:
        raise ValueError("megatron_fp8: moe_router_padding_for_quantization with transformer_impl="
                         "'inference_optimized': megatron-core's inference-optimized MoE layers take no padded routing "
                         "map; drop --moe-router-padding-for-quantization")
    dispatcher = getattr(config, "moe_token_dispatcher_type", None)
    if dispatcher in ("allgather", "alltoall_seq"):
        raise ValueError(f"megatron_fp8: moe_router_padding_for_quantization with moe_token_dispatcher_type="
                         f"{dispatcher!r}: megatron-core's {dispatcher} dispatcher does not pad the routing map; use "
                         f"'alltoall' (or 'flex'), or drop --moe-router-padding-for-quantization (our grouped linears "
                         f"pad each expert's rows themselves)")


def _whole_iteration_scope(config: Any) -> bool:
    scopes = getattr(config, "cuda_graph_scope", None) or []
    scopes = scopes if isinstance(scopes, (list, tuple)) else [scopes]
    return any(str(getattr(s, "name", s)) == "full_iteration" for s in scopes)


def per_layer_graphs(config: Any) -> bool:
    """Whether ``config`` asks for megatron-core's per-layer CUDA graphs (``CudaGraphManager``):
    ``cuda_graph_impl='local'`` without the whole-iteration scope (megatron-core <= 0.16 spells
    the whole iteration as that scope; later versions as ``cuda_graph_impl='full_iteration'``)."""
    return getattr(config, "cuda_graph_impl", "none") == "local" and not _whole_iteration_scope(config)


def whole_iteration_graph(config: Any) -> bool:
    """Whether ``config`` asks Megatron-LM to capture each training iteration's forward and
    backward in one CUDA graph (``cuda_graph_impl='full_iteration'``, or ``'local'`` with the
    ``full_iteration`` scope in megatron-core <= 0.16)."""
    impl = getattr(config, "cuda_graph_impl", "none")
    return impl == "full_iteration" or (impl == "local" and _whole_iteration_scope(config))


_UNFUSED_NOTED: set[str] = set()


def _unfused_without_apex(init: Callable[..., Any], layers: Any) -> Callable[..., Any]:
    """megatron-core's linear ``__init__`` building with ``gradient_accumulation_fusion`` off
    where apex's extension is missing (the module docstring's table says why)."""
    @functools.wraps(init)
    def built(self: Any, *args: Any, **kwargs: Any) -> None:
        config = kwargs.get("config")
        if getattr(config, "gradient_accumulation_fusion", False) \
                and not getattr(layers, "_grad_accum_fusion_available", True) \
                and not getattr(config, "defer_embedding_wgrad_compute", False):
            kwargs["config"] = copy.copy(config)  # the model's own config keeps the flag: our linears read it
            kwargs["config"].gradient_accumulation_fusion = False
            owner = type(self).__name__
            if owner not in _UNFUSED_NOTED:
                _UNFUSED_NOTED.add(owner)
                ours = "fuse it themselves (MEGATRON_FP8_WGRAD_FUSION=off turns theirs off)" \
                    if wgrad_fusion(config, owner) else "do not either (MEGATRON_FP8_WGRAD_FUSION=off)"
                print0(f"megatron_fp8: apex's fused_weight_gradient_mlp_cuda is not installed: megatron-core's own "
                       f"{owner} layers (with our spec: the output layer, multi-token prediction) are built with "
                       f"gradient_accumulation_fusion off and add their wgrad to main_grad unfused; megatron_fp8's "
                       f"linears, where the model has them, {ours}")
        init(self, *args, **kwargs)

    built._megatron_fp8 = True  # type: ignore[attr-defined]
    return built


def _block_submodules(original: Callable[..., Any], resolve: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def resolved(config: Any, spec: Any, *args: Any, **kwargs: Any) -> Any:
        if spec is resolve:
            vp_stage = kwargs.get("vp_stage", args[0] if args else None)
            spec = resolve(config, vp_stage=vp_stage)
        return original(config, spec, *args, **kwargs)

    resolved._megatron_fp8 = True  # type: ignore[attr-defined]
    return resolved


def patch_megatron(layer_spec: Callable[..., Any]) -> None:
    """Make the replacements of the module docstring (idempotent). ``layer_spec``: the plug-in's
    spec function, resolved by the transformer block when passed through uncalled."""
    fp8_utils = import_megatron("megatron.core.fp8_utils", "megatron_fp8.megatron.plugin")
    if fp8_utils.get_fp8_context is not get_fp8_context:
        _replace_everywhere("get_fp8_context", fp8_utils.get_fp8_context, get_fp8_context)

    tp = import_megatron("megatron.core.tensor_parallel", "megatron_fp8.megatron.plugin")
    if tp.CheckpointWithoutOutput is not MegatronCheckpointWithoutOutput:
        _replace_everywhere("CheckpointWithoutOutput", tp.CheckpointWithoutOutput, MegatronCheckpointWithoutOutput)

    utils = import_megatron("megatron.core.utils", "megatron_fp8.megatron.plugin")
    if not getattr(utils.is_te_min_version, "_megatron_fp8", False):
        _replace_everywhere("is_te_min_version", utils.is_te_min_version, _te_safe(utils.is_te_min_version))

    config_mod = import_megatron("megatron.core.transformer.transformer_config", "megatron_fp8.megatron.plugin")
    cls = config_mod.TransformerConfig
    if not getattr(cls.__post_init__, "_megatron_fp8", False):
        cls.__post_init__ = _post_init_without_te(cls.__post_init__)

    _patch_te_checkpoint()

    layers = import_megatron("megatron.core.tensor_parallel.layers", "megatron_fp8.megatron.plugin")
    for cls in (layers.ColumnParallelLinear, layers.RowParallelLinear):
        if not getattr(cls.__init__, "_megatron_fp8", False):
            cls.__init__ = _unfused_without_apex(cls.__init__, layers)

    block = import_megatron("megatron.core.transformer.transformer_block", "megatron_fp8.megatron.plugin")
    if not getattr(block._get_block_submodules, "_megatron_fp8", False):
        block._get_block_submodules = _block_submodules(block._get_block_submodules, layer_spec)
