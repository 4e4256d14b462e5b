"""Expert tensor parallelism: column- and row-parallel grouped (MoE expert) linears with
megatron-core's ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` signature.

=====================  ======================================  ==================================
tensor (per rank)      ``ColumnParallelGroupedLinear``          ``RowParallelGroupedLinear``
=====================  ======================================  ==================================
input x                ``[T, K]`` (tokens of every local        ``[T, K/tp]``
                       expert, gathered by the dispatcher)
weight{i}              ``[N/tp, K]``                            ``[N, K/tp]``
output y               ``[T, N/tp]``                            ``[T, N]`` partial sums
communication          none                                     none
=====================  ======================================  ==================================

As in megatron-core (``explicit_expert_comm``), the layers never communicate: the MoE token
dispatcher all-gathers the tokens over the expert-TP group before fc1 and reduce-scatters the
fc2 partial sums after it. Per-tensor recipes reduce amaxes over the expert-TP group
(``ParallelLinearBase._set_amax_groups``), so each rank's FP8 bits are the TP=1 layer's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..modules.base import decode_state, encode_state
from ..modules.grouped import ExpertParams
from ..ops.grouped_linear import grouped_linear
from ..ops.linear import LinearQuantizers
from . import _mcore
from .base import ParallelLinearBase
from .checks import divide, warn_if_emulated
from .groups import group_rank, group_size
from .init import set_tp_attributes

__all__ = ["ColumnParallelGroupedLinear", "RowParallelGroupedLinear"]


class _ParallelGroupedLinear(ExpertParams, ParallelLinearBase):
    """Shared: ``num_gemms`` local shards ``weight{i}`` / ``bias{i}``, the grouped FP8 call, and
    per-expert checkpoint keys. Subclasses set ``partition_dim``."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Callable[[torch.Tensor], object] | None = None,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        pg_collection: Any | None = None,
        tp_group: dist.ProcessGroup | None = None,
        name: str | None = None,
        save_original_input: bool = False,
    ) -> None:
        super().__init__()
        self._setup(input_size, output_size, config=config, is_expert=is_expert, tp_group=tp_group,
                    pg_collection=pg_collection, name=name)
        if num_gemms < 1:
            raise ValueError(f"{self._owner}: num_gemms={num_gemms}; pass the number of local experts (>= 1)")
        if not is_expert and self.tp_size > 1:
            raise ValueError(f"{self._owner}: grouped linears are expert layers whose tokens the MoE dispatcher "
                             f"moves between ranks; build them with is_expert=True")
        self.num_gemms, self.use_bias, self.skip_bias_add = num_gemms, bias, skip_bias_add
        self.save_original_input, self.tp_comm_buffer_name = save_original_input, tp_comm_buffer_name
        self.ep_group = getattr(pg_collection, "ep", None) if pg_collection is not None else None
        self._pg_collection = pg_collection  # (its expert-data-parallel groups: sharded_state_dict)
        shape = self._local_shape()
        for i in range(num_gemms):
            w = self._new_weight(shape, init_method, 1, False)
            self.register_parameter(f"weight{i}", w)
            b = self._new_bias(shape[0], w.device) if bias else None
            if b is not None and self.partition_dim == 0:
                set_tp_attributes(b, True, 0, 1)
            elif b is not None:  # as megatron-core's RowParallelLinear marks its (replicated) bias
                b.sequence_parallel = self.config_sequence_parallel  # type: ignore[attr-defined]
            self.register_parameter(f"bias{i}", b)
        self.pack_weights()
        self.register_load_state_dict_pre_hook(_merge_expert_extra_states)

    def _local_shape(self) -> tuple[int, int]:
        """``weight{i}``'s local shard: ``[N/tp, K]`` (column) or ``[N, K/tp]`` (row)."""
        if self.partition_dim == 0:
            return divide(self.output_size, self.tp_size, self._owner, "output_size"), self.input_size
        return self.output_size, divide(self.input_size, self.tp_size, self._owner, "input_size")

    def _prepare_quantizers(self, q: LinearQuantizers) -> None:
        self._set_amax_groups(q)
        assert self._fp8_recipe is not None
        warn_if_emulated(q, self._fp8_recipe, self.weight0.device, self._owner)

    def forward(
        self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor, is_first_microbatch: bool | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """``x`` (this rank's features, tokens of expert 0, 1, ... back to back), ``m_splits`` ->
        ``(y, [bias0, ...] with skip_bias_add else None)``."""
        qs, w_fp8 = self.fp8_operands(is_first_microbatch)
        add_bias = self.use_bias and not self.skip_bias_add
        y = grouped_linear(
            x, self.weights, self.biases if add_bias else None, m_splits, w_fp8=w_fp8, quantizers=qs,
            save_original_input=self.save_original_input,
            fuse_wgrad_accumulation=self.gradient_accumulation_fusion, name=self._owner,
        )
        return y, (self.biases if self.skip_bias_add else None)

    # ---- checkpointing: one key set per expert, as megatron-core's TEGroupedLinear ----
    def expert_extra_state(self, i: int) -> torch.Tensor:
        """The FP8 state of expert ``i`` alone (same format as ``get_extra_state``)."""
        state = decode_state(self.get_extra_state(), f"{self._owner}: its own extra state")
        state["quantizers"] = {k: v for k, v in state["quantizers"].items() if k == f"weight{i}"}
        return encode_state(state)

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[tuple[int, int, int], ...] = (),
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Keys ``{prefix}weight{i}``, ``{prefix}bias{i}``, ``{prefix}_extra_state{i or ''}``,
        each sharded over TP along ``partition_dim`` and placed at its *global* expert index on
        a new expert axis (``ep_rank * num_gemms + i`` of ``ep_size * num_gemms``)."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

        ep_size, ep_rank = group_size(self.ep_group), group_rank(self.ep_group)
        full = self.state_dict(prefix="", keep_vars=True)
        out: dict[str, Any] = {}
        axis = len(sharded_offsets)
        for i in range(self.num_gemms):
            sd = {f"{i}.weight": full[f"weight{i}"], f"{i}._extra_state": self.expert_extra_state(i)}
            if self.use_bias:
                sd[f"{i}.bias"] = full[f"bias{i}"]
            offsets = (*sharded_offsets, (axis, ep_rank * self.num_gemms + i, ep_size * self.num_gemms))
            axis_map = {f"{i}.{k}": v for k, v in self._tp_axis_map().items()}
            sub = _mcore.make_sharded_tensors(sd, "", axis_map, offsets, self.tp_group, metadata, self._owner)
            replace_prefix_for_sharding(sub, f"{i}.", prefix)
            out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
            out[f"{prefix}_extra_state{'' if i == 0 else i}"] = sub[f"{i}._extra_state"]
            if self.use_bias:
                out[f"{prefix}bias{i}"] = sub[f"{i}.bias"]
        for key, entry in out.items():  # copies of an expert shard: the expert-data-parallel ranks
            rank = _mcore.expert_dp_rank(self._pg_collection, replicated="_extra_state" in key)
            if rank is not None and len(entry.replica_id) == 3:
                entry.replica_id = (*entry.replica_id[:2], rank)
        return out

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_gemms={self.num_gemms}, in_features={self.input_size}, "
                f"out_features={self.output_size}, bias={self.use_bias}, TP={self.tp_size}, "
                f"save_original_input={self.save_original_input})")


def _merge_expert_extra_states(module: _ParallelGroupedLinear, state_dict: dict[str, Any], prefix: str,
                               *args: Any) -> None:
    """Fold per-expert ``_extra_state{i}`` entries (from ``sharded_state_dict``) into the single
    ``_extra_state`` blob that ``FP8Module.set_extra_state`` reads. The slot decides the local
    expert: a checkpoint saved with another expert-parallel layout carries, in slot i, the blob of
    another local index, so each is keyed anew by its slot (a one-expert layer's slot 0 too)."""
    base = f"{prefix}_extra_state"
    keys = [k for k in state_dict if k.startswith(base) and k != base]
    if not keys and module.num_gemms != 1:
        return  # the whole layer's own blob (state_dict), every expert under its own key
    merged: dict[str, Any] | None = None
    for k in [base, *keys]:
        blob = state_dict.pop(k, None)
        if not (isinstance(blob, torch.Tensor) and blob.numel()):
            continue  # no FP8 state (megatron-core's None, Transformer Engine's empty tensor without FP8)
        part = decode_state(blob, f"{module._owner}: state_dict key {k!r}")
        quantizers = part.get("quantizers") if isinstance(part, dict) else None
        if not isinstance(quantizers, dict) or len(quantizers) > 1:
            raise ValueError(f"{module._owner}: state_dict key {k!r} is not one expert's FP8 state (expected the "
                             f"dict that sharded_state_dict writes, with at most one expert)")
        slot = k[len(base):] or "0"
        part["quantizers"] = {f"weight{slot}": v for v in quantizers.values()}
        if merged is None:
            merged = part
        else:
            merged["quantizers"].update(part["quantizers"])
    if merged is None:
        state_dict[base] = None
        return
    state_dict[base] = encode_state(merged)


class ColumnParallelGroupedLinear(_ParallelGroupedLinear):
    """Expert fc1: each ``weight{i} [N, K]`` split along N over the expert-TP group."""

    partition_dim = 0



class RowParallelGroupedLinear(_ParallelGroupedLinear):
    """Expert fc2: each ``weight{i} [N, K]`` split along K; outputs are partial sums (the
    dispatcher reduces them), so a bias is only allowed with ``skip_bias_add`` when TP > 1."""

    partition_dim = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.use_bias and self.tp_size > 1 and not self.skip_bias_add:
            raise ValueError(f"{self._owner}: a row-parallel expert layer with a bias needs skip_bias_add=True "
                             f"(each rank holds partial sums; the dispatcher adds the bias after reducing)")

