"""``ParallelLinearBase``: what column- and row-parallel linears share.

Config reading, group resolution, weight allocation/initialisation of the local shard,
Megatron's parameter attributes, FP8 operands with TP-wide amax groups, and checkpointing
(``state_dict`` with FP8 extra state; ``sharded_state_dict`` for megatron-core).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..autocast import current_fp8_state
from ..modules.base import FP8Module, default_init
from ..ops.linear import LinearQuantizers, cast_weight
from ..quant.tensor import QuantizedTensor
from ..recipe import Recipe
from ..settings import env_choice
from . import _mcore
from .checks import config_value, same_on_all_ranks, warn_if_emulated
from .groups import group_rank, group_size, resolve_tp_group
from .init import init_shard_directly, init_shard_from_master, set_tp_attributes

__all__ = ["ParallelLinearBase"]


def wgrad_fusion(config: Any, owner: str) -> bool:
    """Whether the layer adds its wgrad into ``weight.main_grad`` itself (Megatron's
    gradient-accumulation fusion; under per-tensor FP8 scaling on CUDA the wgrad GEMM's epilogue
    adds it, ``gemm.accumulate``). ``MEGATRON_FP8_WGRAD_FUSION``: ``config`` (the default: the
    config's ``gradient_accumulation_fusion``, Megatron-LM's default: without apex the plug-in
    builds megatron-core's own linears with it off, ``megatron/compat.py``), ``on`` (whatever the
    config says; ours need nothing but the ``main_grad`` Megatron's DDP gives every parameter) or
    ``off``."""
    v = env_choice("MEGATRON_FP8_WGRAD_FUSION", "config",
                   {"config": "the config's gradient_accumulation_fusion", "on": "", "off": ""})
    if v == "config":
        return bool(config_value(config, "gradient_accumulation_fusion", owner))
    return v == "on"


def init_device(config: Any) -> torch.device:
    """Where parameters are allocated: CPU with ``use_cpu_initialization`` or without CUDA."""
    if getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())



class ParallelLinearBase(FP8Module):
    """Shared machinery; subclasses set ``partition_dim`` (0: column, 1: row) and ``forward``."""

    partition_dim: int

    def _setup(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        is_expert: bool,
        tp_group: dist.ProcessGroup | None,
        pg_collection: Any | None,
        name: str | None,
    ) -> None:
        """Read the config and resolve the TP group (before any size is divided)."""
        self.name = name
        self._owner = self._fp8_owner()
        self.input_size, self.output_size = input_size, output_size
        self.config, self.is_expert = config, is_expert
        self.tp_group = resolve_tp_group(tp_group, is_expert=is_expert, pg_collection=pg_collection)
        self.tp_size, self.tp_rank = group_size(self.tp_group), group_rank(self.tp_group)
        cfg_tp = config_value(config, "tensor_model_parallel_size", self._owner)
        fell_back_to_world = (tp_group is None and pg_collection is None and self.tp_group is not None
                              and _mcore.parallel_state() is None)
        if fell_back_to_world and not is_expert and cfg_tp != self.tp_size:
            raise ValueError(
                f"{self._owner}: config.tensor_model_parallel_size={cfg_tp}, but without tp_group and "
                f"without megatron-core's parallel_state the layer uses the default torch.distributed "
                f"group, which has {self.tp_size} ranks; pass tp_group= (a group of {cfg_tp} ranks), "
                f"initialise megatron-core's parallel_state, or set the config to {self.tp_size}"
            )
        self.expert_parallel = config_value(config, "expert_model_parallel_size", self._owner) > 1
        # Megatron's allreduce=False: gradients reduced over the expert groups (the rule follows
        # the installed megatron-core's, which changed in 0.19)
        self.expert_groups = _mcore.uses_expert_groups(config, is_expert)
        self.explicit_expert_comm = is_expert and (self.tp_size > 1 or self.expert_parallel)
        self.gradient_accumulation_fusion = wgrad_fusion(config, self._owner)
        if config_value(config, "defer_embedding_wgrad_compute", self._owner):
            raise ValueError(
                f"{self._owner}: config.defer_embedding_wgrad_compute is not supported by the FP8 "
                f"parallel linears; turn it off (or keep Megatron's layer for the output layer)")
        self.sequence_parallel = bool(config_value(config, "sequence_parallel", self._owner))
        # megatron-core marks a row-parallel bias with the config's flag (its finalize step
        # all-reduces such grads over TP), whatever this layer's own group size makes of it
        self.config_sequence_parallel = self.sequence_parallel
        if self.sequence_parallel and self.tp_size == 1:
            warnings.warn(f"{self._owner}: sequence_parallel=True with tensor-parallel size 1; "
                          f"disabling sequence parallelism for this layer", stacklevel=3)
            self.sequence_parallel = False

    def adopt_name(self, name: str) -> None:
        """``FP8Module.adopt_name``; its communication's labels follow."""
        super().adopt_name(name)
        comm = getattr(self, "_comm", None)
        if comm is not None and getattr(comm, "name", self._owner) != self._owner:
            self._comm = dataclasses.replace(comm, name=self._owner)

    def _new_weight(
        self,
        local_shape: tuple[int, int],
        init_method: Callable[[torch.Tensor], object] | None,
        stride: int,
        keep_master_weight_for_test: bool,
    ) -> nn.Parameter:
        """Allocate the local shard and initialise it as Megatron does (CPU: the full weight on
        every rank, then this rank's slice; device: the shard directly)."""
        cfg, owner = self.config, self._owner
        dtype = config_value(cfg, "params_dtype", owner)
        device = init_device(cfg)
        on_cpu = device.type == "cpu"
        weight = nn.Parameter(torch.empty(local_shape, dtype=dtype, device=device))
        init = init_method or getattr(cfg, "init_method", None) or default_init
        if config_value(cfg, "perform_initialization", owner):
            if on_cpu:
                master = init_shard_from_master(weight.data, (self.output_size, self.input_size),
                                                self.partition_dim, init, stride, self.tp_rank, self.tp_size)
                if keep_master_weight_for_test:
                    self.master_weight = master
            else:
                init_shard_directly(weight.data, init)
        set_tp_attributes(weight, True, self.partition_dim, stride)
        weight.allreduce = not self.expert_groups  # type: ignore[attr-defined]
        return weight

    def _new_bias(self, size: int, device: torch.device) -> nn.Parameter:
        dtype = config_value(self.config, "params_dtype", self._owner)
        bias = nn.Parameter(torch.empty(size, dtype=dtype, device=device))
        if config_value(self.config, "perform_initialization", self._owner):
            with torch.no_grad():
                bias.zero_()
        bias.allreduce = not self.expert_groups  # type: ignore[attr-defined]
        return bias

    # ---- FP8 ----
    def _fp8_operands(
        self, weight: torch.Tensor, is_first_microbatch: bool | None
    ) -> tuple[LinearQuantizers | None, QuantizedTensor | None]:
        """Quantizers (amax groups set to the TP group) and the FP8 weight, or (None, None)."""
        key = "weight"
        if weight is not self.weight:  # a weight passed to forward (skip_weight_param_allocation)
            # not an attribute: nn.Module would register the caller's tensor as our parameter
            self.__dict__["_external_weight"], key = weight, "_external_weight"
        q = self.fp8_quantizers(key)
        if q is None:  # (Megatron's flag stays for the first forward that casts the weight)
            return None, None
        is_first_microbatch = self.microbatch_flag(is_first_microbatch)
        self._set_amax_groups(q)
        assert self._fp8_recipe is not None
        warn_if_emulated(q, self._fp8_recipe, weight.device, self._owner)
        if key == "weight":
            return q, self.fp8_weight(key, q, is_first_microbatch)
        return q, cast_weight(q.weight, weight)

    def fp8_mode_changed(self, recipe: Recipe | None, group: Any) -> None:
        """Every rank of the TP group (and of the amax-reduction group) must run the same recipe
        (or all run FP8 off): one small all-gather per change, an error on every rank naming
        each rank's recipe if they differ (they would otherwise all-gather FP8 data cast with
        different scales, or wait on collectives of different sizes)."""
        if self.tp_size == 1 and group is None:
            return
        mode = "FP8 off" if recipe is None else recipe.describe()
        param = next(self.parameters(), None)  # none with skip_weight_param_allocation and no bias
        device = param.device if param is not None else init_device(self.config)
        same_on_all_ranks(mode, self.tp_group, device, self._owner, "tensor-parallel")
        if group is not None and group is not self.tp_group:
            same_on_all_ranks(mode, group, device, self._owner, "amax-reduction (fp8_group)")

    def no_fp8_region(self) -> None:
        """``config.fp8`` set and no FP8 region open: Megatron asked for FP8 and would get BF16
        GEMMs without a word, so refuse (a disabled region, ``fp8_autocast(enabled=False)``, is
        an explicit choice and passes)."""
        fp8 = getattr(self.config, "fp8", None)
        if fp8:
            raise RuntimeError(
                f"{self._owner}: config.fp8={fp8!r}, but no megatron_fp8 FP8 region is open, so this "
                f"layer would run in high precision. Megatron's get_fp8_context opens Transformer "
                f"Engine's region (or none without TE), not ours: launch Megatron-LM with `--spec "
                f"megatron_fp8.megatron.plugin layer_spec` (or call megatron_fp8.megatron.plugin.install()"
                f" before building the model), or wrap the forward in megatron_fp8.megatron.fp8_context"
                f"(config); to run in BF16 on purpose, unset config.fp8")

    def _set_amax_groups(self, q: LinearQuantizers) -> None:
        """Per-tensor recipes reduce amaxes over the TP group, so every rank casts its shard with
        the scale of the whole tensor: the TP layer's FP8 bits equal those of the TP=1 layer.
        Activations and gradients use the autocast's ``fp8_group`` when one is given (it must
        contain the TP group), the weight always the TP group."""
        state = current_fp8_state()
        act_group = state.group if state is not None and state.group is not None else self.tp_group
        if act_group is not self.tp_group:
            self._check_contains_tp(act_group)
        for quantizer, group in ((q.input, act_group), (q.grad_output, act_group), (q.weight, self.tp_group)):
            if hasattr(quantizer, "group"):
                quantizer.group = group  # type: ignore[attr-defined]

    def _check_contains_tp(self, group: dist.ProcessGroup) -> None:
        """An ``fp8_group`` that misses a TP peer would give the ranks different per-tensor
        scales, and FP8 gathers assume one scale: refuse it (checked once per group)."""
        checked = self.__dict__.setdefault("_fp8_groups_checked", set())
        if self.tp_group is None or id(group) in checked:
            return
        tp_ranks = set(dist.get_process_group_ranks(self.tp_group))
        if not tp_ranks <= set(dist.get_process_group_ranks(group)):
            raise ValueError(
                f"{self._owner}: fp8_autocast(fp8_group=...) lacks tensor-parallel ranks "
                f"{sorted(tp_ranks - set(dist.get_process_group_ranks(group)))}; per-tensor scales "
                f"must agree across the TP group: pass a group containing it (e.g. the TP or the "
                f"data+TP group), or fp8_group=None to use the TP group")
        checked.add(id(group))

    # ---- Megatron API ----
    def backward_dw(self) -> None:
        """Delayed wgrad (Megatron ``delay_wgrad_compute``) is not used: wgrad runs in backward."""

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[tuple[int, int, int], ...] = (),
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Megatron distributed-checkpoint view: weight (and column bias) sharded along
        ``partition_dim`` over TP, FP8 extra state as a ShardedObject (equal on TP ranks)."""
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return _mcore.make_sharded_tensors(state_dict, prefix, self._tp_axis_map(), tuple(sharded_offsets),
                                           self.tp_group, metadata, self._owner)

    def _tp_axis_map(self) -> dict[str, int]:
        """Which dim of each parameter is split over TP (the bias only when the output is)."""
        return {"weight": 0, "bias": 0} if self.partition_dim == 0 else {"weight": 1}

    def _check_features(self, x: torch.Tensor, expected: int, hint: str) -> None:
        if x.shape[-1] != expected:
            raise ValueError(f"{self._owner}: input has {x.shape[-1]} features (shape {tuple(x.shape)}), "
                             f"expected {expected}; {hint}")

    def __repr__(self) -> str:
        bias = self.bias is not None
        return (f"{type(self).__name__}(in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={bias}, TP={self.tp_size}, sequence_parallel={self.sequence_parallel}, "
                f"save_original_input={self.save_original_input})")
