"""megatron-core ``ModuleSpec`` objects for a GPT transformer layer whose linears are megatron_fp8's.

The spec is megatron-core's own *local* spec (``get_gpt_layer_local_spec``: separate
``input_layernorm`` / ``pre_mlp_layernorm`` modules, ``DotProductAttention``, no Transformer
Engine) with every megatron-core ``tensor_parallel.ColumnParallelLinear`` /
``RowParallelLinear`` in it replaced by ``megatron_fp8.parallel``'s (same constructor and
``forward`` contract), so the layer's structure, parameter names and checkpoint keys are
Megatron's. What is replaced:

* ``ColumnParallelLinear``: ``self_attention.linear_qkv``, ``mlp.linear_fc1``,
  ``mlp.shared_experts.linear_fc1``, ``mlp.experts.local_experts.{i}.linear_fc1``;
* ``RowParallelLinear``: ``self_attention.linear_proj``, ``mlp.linear_fc2`` and the shared /
  sequential experts' fc2;
* ``mlp.experts`` with ``moe_grouped_gemm=True``: ``experts.GroupedMLP`` (megatron-core's
  ``TEGroupedMLP`` container, made to run with ``config.fp8`` and no TE) holding our ``ColumnParallelGroupedLinear``
  (fc1) / ``RowParallelGroupedLinear`` (fc2), in place of the legacy ``GroupedMLP``
  (megatron-core 0.16) or of the ``SequentialMLP`` that 0.17+'s local spec builds whatever
  ``moe_grouped_gemm`` says. Its checkpoint keys are ``TEGroupedMLP``'s (``linear_fc1.weight{i}``
  per expert, as with Transformer Engine's grouped experts).

* megatron-core's torch norm (``WrappedTorchNorm``: ``input_layernorm``, ``pre_mlp_layernorm``,
  q/k layernorms, a block spec's final norm) by ``norm.Norm``: the same module, with
  ``sequence_parallel`` allowed (its parameters marked for Megatron's gradient all-reduce).

Apex's and TE's norms, core attention (unless ``core_attention="sdpa"``), the router and the
token dispatchers stay Megatron's.

Multi-latent attention (``multi_latent_attention=True``) uses ``mla.MLASelfAttention``:
megatron-core's class made to accept our down-projections (its constructor checks the classes of
``linear_q_down_proj`` / ``linear_kv_down_proj`` against its own), with all five projections
ours and the SDPA core attention (megatron-core's local MLA spec does not build without TE:
0.16.1's ``DotProductAttention`` takes no ``k_channels``, 0.19's local backend has no
``linear()``).

Usage::

    from megatron.core.models.gpt import GPTModel
    from megatron_fp8.config import load_config, apply_layer_flags
    from megatron_fp8.megatron import fp8_context, get_gpt_layer_spec

    model = GPTModel(config, transformer_layer_spec=get_gpt_layer_spec(), vocab_size=..., ...)
    apply_layer_flags(model, load_config("fp8.yaml"))   # per-layer save_original_input
    with fp8_context(fp8_settings):                       # or FP8Config.autocast()
        loss = model(tokens, position_ids, attention_mask, labels=labels).mean()
    loss.backward()

A whole block spec converts the same way:
``to_fp8_spec(get_gpt_decoder_block_spec(config, use_transformer_engine=False))``.

Module names (for ``apply_layer_flags`` globs) are Megatron's: in a ``GPTModel``
``decoder.layers.0.self_attention.linear_qkv``, ``decoder.layers.0.self_attention.linear_proj``,
``decoder.layers.0.mlp.linear_fc1``, ``decoder.layers.0.mlp.linear_fc2``; MoE:
``decoder.layers.0.mlp.experts.linear_fc1`` (grouped) or
``decoder.layers.0.mlp.experts.local_experts.3.linear_fc2`` (sequential), and
``decoder.layers.0.mlp.shared_experts.linear_fc1``. A bare ``TransformerLayer`` drops the
``decoder.layers.0.`` prefix. E.g. ``match: "*.self_attention.linear_proj"``. The embedding
and the output layer (``output_layer``) stay Megatron's and are not FP8.

Do not set ``TransformerConfig.fp8`` on the config that builds the model: Megatron would then
open Transformer Engine's autocast (or require TE); open ``fp8_context`` / ``fp8_autocast``
around the forward instead (``megatron_fp8.megatron.fp8``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["get_gpt_layer_spec", "to_fp8_spec", "with_core_attention", "import_megatron"]


def lazy_class(module: str, name: str, build: Callable[[], type]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that builds class ``name`` on first use (``build()``) and keeps
    it: for our subclasses of megatron-core classes, so that importing the module does not import
    megatron-core (PEP 562)."""
    built: list[type] = []

    def __getattr__(attr: str) -> Any:
        if attr != name:
            raise AttributeError(f"module {module!r} has no attribute {attr!r}")
        if not built:
            built.append(build())
        return built[0]

    return __getattr__


def import_megatron(module: str, what: str) -> ModuleType:
    """``importlib.import_module(module)``, or an ImportError telling how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{what} needs megatron-core ({module} failed to import: {e}); "
            f"install it with `pip install megatron-core`"
        ) from e


CORE_ATTENTION = ("sdpa", "local")


def default_core_attention() -> str:
    """``"sdpa"`` (``attention.SDPAttention``) on CUDA, megatron-core's ``"local"``
    ``DotProductAttention`` elsewhere (the CPU tests compare against Megatron's spec bitwise)."""
    import torch

    return "sdpa" if torch.cuda.is_available() else "local"


def _replacements(core_attention: str = "local") -> dict[type, type]:
    """megatron-core class -> our class, for the classes that appear in local specs."""
    from ..parallel import ColumnParallelLinear, RowParallelLinear

    if core_attention not in CORE_ATTENTION:
        raise ValueError(f"core_attention={core_attention!r}; choose 'sdpa' (PyTorch's scaled_dot_product_attention, "
                         f"whose output linear_proj can save without a copy) or 'local' (megatron-core's "
                         f"DotProductAttention)")
    tp = import_megatron("megatron.core.tensor_parallel", "megatron_fp8.megatron.to_fp8_spec")
    out: dict[type, type] = {tp.ColumnParallelLinear: ColumnParallelLinear, tp.RowParallelLinear: RowParallelLinear}
    if core_attention == "sdpa":
        from .attention import SDPAttention

        dpa = import_megatron("megatron.core.transformer.dot_product_attention", "megatron_fp8 core attention")
        out[dpa.DotProductAttention] = SDPAttention
    return out


def _norm_replacements() -> dict[type, type]:
    """megatron-core's torch norm -> ours (``norm.Norm``: the same module, with sequence
    parallelism allowed); apex's and TE's norms, which take it already, stay."""
    from .norm import Norm

    torch_norm = import_megatron("megatron.core.transformer.torch_norm", "megatron_fp8.megatron.to_fp8_spec")
    return {torch_norm.WrappedTorchNorm: Norm}


def _grouped_experts() -> tuple[type, Any]:
    """Our ``GroupedMLP`` container (megatron-core's ``TEGroupedMLP``, working with
    ``config.fp8`` and no TE: ``experts.py``) and its submodules holding our grouped linears, in
    the class this megatron-core's ``TEGroupedMLP`` takes (0.17+: ``GroupedMLPSubmodules``; 0.16:
    ``MLPSubmodules``)."""
    from ..parallel.grouped import ColumnParallelGroupedLinear, RowParallelGroupedLinear
    from .experts import GroupedMLP

    container = GroupedMLP
    experts = import_megatron("megatron.core.transformer.moe.experts", "megatron_fp8 grouped experts")
    submodules = getattr(experts, "GroupedMLPSubmodules", None)
    if submodules is None:
        submodules = import_megatron("megatron.core.transformer.mlp", "megatron_fp8 grouped experts").MLPSubmodules
    return container, submodules(linear_fc1=ColumnParallelGroupedLinear, linear_fc2=RowParallelGroupedLinear)


class _Converter:
    """Walks a spec tree (ModuleSpec, submodule dataclasses, partials, lists) and rebuilds it
    with megatron-core's local linears replaced; the input spec is not modified."""

    def __init__(self, grouped_experts: bool = False, core_attention: str = "local") -> None:
        spec_utils = import_megatron("megatron.core.transformer.spec_utils", "megatron_fp8.megatron.to_fp8_spec")
        experts = import_megatron("megatron.core.transformer.moe.experts", "megatron_fp8.megatron.to_fp8_spec")
        self.module_spec = spec_utils.ModuleSpec
        # experts containers to swap for TEGroupedMLP holding our grouped linears
        self.to_group = {getattr(experts, "GroupedMLP", None)}
        if grouped_experts:
            self.to_group.add(experts.SequentialMLP)
        self.to_group.discard(None)
        self.grouped = 0
        self.classes = _replacements(core_attention)
        self.norms = _norm_replacements()  # not counted in ``replaced`` (the count of linears and cores)
        self.replaced = 0
        self.te_classes: list[str] = []
        self.mla: list[str] = []  # multi-latent attention classes met (mla.py)
        with contextlib.suppress(ImportError):
            mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
            if hasattr(mla, "MLASelfAttention"):
                from .mla import __getattr__ as _mla_class

                self.classes[mla.MLASelfAttention] = _mla_class("MLASelfAttention")

    def __call__(self, obj: Any) -> Any:
        if isinstance(obj, type):
            return self._class(obj)
        module = self._builds(obj)
        if module is not None and "MultiLatentAttention" in {c.__name__ for c in module.__mro__}:
            self.mla.append(module.__name__)
        if module is not None and module in self.to_group:
            return self._grouped(obj)
        if isinstance(obj, self.module_spec):
            new = copy.copy(obj)
            new.module = self(obj.module)
            new.submodules = self(obj.submodules)
            new.params = dict(obj.params)
            return new
        if isinstance(obj, functools.partial):
            return functools.partial(self(obj.func), *map(self, obj.args),
                                     **{k: self(v) for k, v in obj.keywords.items()})
        if isinstance(obj, (list, tuple)):
            return type(obj)(self(v) for v in obj)
        if dataclasses.is_dataclass(obj):
            new = copy.copy(obj)
            for f in dataclasses.fields(obj):
                setattr(new, f.name, self(getattr(obj, f.name)))
            return new
        return obj

    def _builds(self, obj: Any) -> type | None:
        """The class a ModuleSpec or (megatron-core 0.17+) a partial builds, if it is a class."""
        if isinstance(obj, self.module_spec):
            obj = obj.module
        elif isinstance(obj, functools.partial):
            obj = obj.func
        else:
            return None
        return obj if isinstance(obj, type) else None

    def _grouped(self, obj: Any) -> Any:
        """``obj`` (experts) rebuilt as TEGroupedMLP with our grouped linears, in the same form."""
        self.replaced += 1
        self.grouped += 1
        container, submodules = _grouped_experts()
        if isinstance(obj, functools.partial):
            rest = {k: v for k, v in obj.keywords.items() if k != "submodules"}
            return functools.partial(container, *obj.args, **rest, submodules=submodules)
        new = copy.copy(obj)
        new.module, new.submodules, new.params = container, submodules, dict(obj.params)
        return new

    def _class(self, cls: type) -> type:
        if cls in self.norms:
            return self.norms[cls]
        if cls in self.classes:
            self.replaced += 1
            return self.classes[cls]
        if cls.__module__.startswith("megatron.core.extensions") and "Linear" in cls.__name__:
            self.te_classes.append(cls.__name__)
        return cls


_MLA_LOCAL = (
    "{where}: multi-latent attention needs core_attention='sdpa' (megatron-core's local DotProductAttention "
    "cannot take MLA's query/key head size, which differs from the value's)"
)


def to_fp8_spec(spec: Any, *, grouped_experts: bool = False, core_attention: str = "local",
                _stage: bool = False) -> Any:
    """A copy of a megatron-core *local* spec (layer, block or MoE spec) with its
    Column/RowParallelLinears replaced by megatron_fp8's and a legacy ``GroupedMLP`` by
    ``TEGroupedMLP`` holding our grouped linears. ``grouped_experts=True`` swaps
    ``SequentialMLP`` experts for that ``TEGroupedMLP`` too: megatron-core 0.17+'s local specs
    build ``SequentialMLP`` experts whatever ``moe_grouped_gemm`` says. ``core_attention="sdpa"``
    swaps megatron-core's ``DotProductAttention`` for ``attention.SDPAttention``. Raises if the spec holds
    Transformer Engine linears (build it from the local spec), no linear to replace, or, with
    ``grouped_experts``, no experts to group. (``_stage``: ``spec`` is one pipeline stage's block,
    which may hold no layer, or no MoE layer where the model has some.)"""
    conv = _Converter(grouped_experts, core_attention)
    out = conv(spec)
    if conv.mla and core_attention != "sdpa":
        raise ValueError(_MLA_LOCAL.format(where=f"to_fp8_spec: the spec holds {sorted(set(conv.mla))}"))
    if conv.te_classes:
        raise ValueError(
            f"to_fp8_spec: the spec holds Transformer Engine linears {sorted(set(conv.te_classes))}, which "
            f"megatron_fp8 does not replace (TE fuses the layernorm into linear_qkv / linear_fc1); build it "
            f"from megatron-core's local spec (get_gpt_layer_local_spec, or use_transformer_engine=False)"
        )
    if conv.replaced == 0 and not (_stage and not getattr(spec, "layer_specs", None)):
        raise ValueError(
            "to_fp8_spec: the spec holds no megatron-core ColumnParallelLinear / RowParallelLinear to replace; "
            "pass a spec built by megatron-core's local spec functions"
        )
    if grouped_experts and conv.grouped == 0 and not _stage:
        raise ValueError(
            "to_fp8_spec(grouped_experts=True): the spec holds no MoE experts (SequentialMLP / GroupedMLP) to "
            "group; build it with num_experts set, or leave grouped_experts off"
        )
    return out


def with_core_attention(spec: Any, core_attention: str) -> Any:
    """A copy of a megatron-core *local* spec with only its core attention swapped (``"sdpa"``:
    ``attention.SDPAttention``; ``"local"``: unchanged) and Megatron's own linears kept: the
    baseline that compares Megatron's layers with ours under the same attention."""
    if core_attention not in CORE_ATTENTION:
        _replacements(core_attention)  # raises, naming the choices
    if core_attention == "local":
        return spec
    conv = _Converter()
    dpa = import_megatron("megatron.core.transformer.dot_product_attention", "megatron_fp8 core attention")
    conv.classes = {dpa.DotProductAttention: _replacements("sdpa")[dpa.DotProductAttention]}
    out = conv(spec)
    if conv.replaced == 0:
        raise ValueError("with_core_attention: the spec holds no megatron-core DotProductAttention to replace")
    return out


def get_gpt_layer_spec(
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    multi_latent_attention: bool = False,
    normalization: str | None = None,
    qk_l2_norm: bool = False,
    core_attention: str | None = None,
) -> Any:
    """megatron-core's ``get_gpt_layer_local_spec(...)`` with megatron_fp8's linears (see the
    module docstring for what is replaced). Arguments as megatron-core's; ``normalization``
    ``"RMSNorm"`` or None (LayerNorm); ``core_attention``: ``"sdpa"`` (``attention.SDPAttention``,
    the default on CUDA) or ``"local"`` (megatron-core's ``DotProductAttention``, the default
    elsewhere)."""
    if multi_latent_attention:  # our MLA attention (mla.py) in the local layer: its MLA spec needs TE in 0.19+
        if core_attention == "local":
            raise ValueError(_MLA_LOCAL.format(where="get_gpt_layer_spec(multi_latent_attention=True)"))
        from .attention import SDPAttention
        from .mla import with_mla

        base = get_gpt_layer_spec(num_experts, moe_grouped_gemm, False, False, normalization, False, "local")
        return with_mla(base, qk_layernorm, SDPAttention)
    specs = import_megatron("megatron.core.models.gpt.gpt_layer_specs", "megatron_fp8.megatron.get_gpt_layer_spec")
    local = getattr(specs, "get_gpt_layer_local_spec", None)
    if local is None:
        raise ImportError("megatron_fp8.megatron.get_gpt_layer_spec: this megatron-core has no "
                          "get_gpt_layer_local_spec; install a supported one (`pip install megatron-core`, 0.16+)")
    kwargs: dict[str, Any] = dict(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                  qk_layernorm=qk_layernorm, multi_latent_attention=multi_latent_attention,
                                  normalization=normalization, qk_l2_norm=qk_l2_norm)
    accepted = inspect.signature(local).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        unknown = [k for k, v in kwargs.items() if k not in accepted and v not in (None, False)]
        if unknown:
            raise ValueError(f"get_gpt_layer_spec: this megatron-core's get_gpt_layer_local_spec does not take "
                             f"{unknown}; leave them at their defaults")
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    return to_fp8_spec(local(**kwargs), grouped_experts=bool(moe_grouped_gemm) and num_experts is not None,
                       core_attention=core_attention or default_core_attention())


class Overlay:
    """A megatron-core config with some attributes read as other values (for megatron-core
    builders that read only attributes: a spec function, a norm)."""

    def __init__(self, config: Any, **values: Any) -> None:
        self._config, self._values = config, values

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__["_values"]
        return values[name] if name in values else getattr(self.__dict__["_config"], name)


def get_gpt_block_spec(config: Any, vp_stage: int | None = None, *, core_attention: str | None = None) -> Any:
    """megatron-core's local *decoder block* spec for ``config`` (its dense/MoE layer pattern,
    ``moe_layer_freq``, and this pipeline stage's layers) with megatron_fp8's linears, grouped
    experts (``moe_grouped_gemm``) and norms, the block's final norm included: what a
    ``GPTModel`` needs for sequence parallelism without Transformer Engine or apex
    (``norm.Norm``; a layer spec leaves the final norm to megatron-core's torch norm, which
    refuses it). Multi-latent attention (``config.multi_latent_attention``; megatron-core's local
    MLA spec needs TE): the same block, each layer's self-attention our MLA (``mla.with_mla``)
    with the SDPA core, so DeepSeek's first dense layers (``moe_layer_freq`` a list) work too.
    What the Megatron-LM plug-in's ``layer_spec`` returns."""
    mla = bool(getattr(config, "multi_latent_attention", False))
    specs = import_megatron("megatron.core.models.gpt.gpt_layer_specs", "megatron_fp8.get_gpt_block_spec")
    block = specs.get_gpt_decoder_block_spec(Overlay(config, multi_latent_attention=False) if mla else config,
                                             use_transformer_engine=False,
                                             normalization=getattr(config, "normalization", None),
                                             qk_l2_norm=getattr(config, "qk_l2_norm", False), vp_stage=vp_stage)
    grouped = bool(getattr(config, "num_moe_experts", None)) and bool(getattr(config, "moe_grouped_gemm", False))
    attention = "sdpa" if mla else core_attention or default_core_attention()
    block = to_fp8_spec(block, grouped_experts=grouped, core_attention=attention, _stage=True)
    if mla:
        from .attention import SDPAttention
        from .mla import with_mla

        qk_layernorm = bool(getattr(config, "qk_layernorm", False))
        block.layer_specs = [with_mla(layer, qk_layernorm, SDPAttention) for layer in block.layer_specs]
    return block
