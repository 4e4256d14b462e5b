"""Per-tensor quantizers (one scale per tensor): current scaling and delayed scaling.

Both accept ``scale=`` to reuse a scale cast earlier (``save_original_input`` casts the
columnwise copy in backward with the forward's scale, recording no second amax). Delayed
scaling keeps its amax history and scale as state (``state_dict``), reduced over the amax
group where a tensor is sharded.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..autocast import fp8_step
from ..recipe import (
    DelayedScaling,
)
from . import kernels
from .formats import ScaleLayout
from .quantizer import Quantizer, Segments, _check_2d, _grouped, _reduce_amax
from .reference import amax_to_scale
from .tensor import Operand, QuantizedTensor


class _PerTensorQuantizer(Quantizer):
    """Shared cast for per-tensor recipes; subclasses decide the scale."""

    layout = ScaleLayout.TENSOR

    def __init__(self, fp8_dtype: torch.dtype, name: str, group: dist.ProcessGroup | None) -> None:
        super().__init__(fp8_dtype, name)
        self.group = group

    @abc.abstractmethod
    def _scale_for(self, x: torch.Tensor, record_amax: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, 1 / scale)`` for casting ``x`` now."""

    def _fused_cast(self, x: torch.Tensor, rowwise: bool, columnwise: bool) -> kernels.CurrentCast | None:
        """``(row, col, scale, 1/scale)`` when scale and cast run fused here, else None."""
        return None

    def casts_segments(self, x: torch.Tensor) -> bool:
        return kernels.segments_fused(x, columnwise=True)

    def _segments_apply(self, x: torch.Tensor, peers: Sequence[Quantizer], rowwise: bool, columnwise: bool) -> bool:
        """Whether ``quantize_segments`` casts ``x``'s segments in one launch here (else the
        caller casts them one by one)."""
        _check_2d(x, self.name)
        return kernels.segments_fused(x, columnwise) and self._peers_match(peers) and (rowwise or columnwise)

    def _segments_out(self, x: torch.Tensor, splits: Sequence[int], rows: torch.Tensor | None,
                      cols: torch.Tensor | None, inv: torch.Tensor,
                      kept: Sequence[torch.Tensor]) -> Segments:
        """The packs of a one-launch cast's raw buffers with their inverse scales (``inv [E]``,
        16 bytes apart), and the scales each segment keeps (``kept``)."""
        return Segments(*self._packs(x, splits, rows, inv, cols, inv), kept)

    def _cast_segments_scaled(self, x: torch.Tensor | kernels.PaddedRows, splits: Sequence[int],
                              scales: Sequence[torch.Tensor],
                              rowwise: bool, columnwise: bool, offsets: torch.Tensor | None = None,
                              kept: Sequence[torch.Tensor] | None = None) -> Segments:
        """Every segment cast in one launch with its given scale; each QuantizedTensor keeps
        ``kept[i]`` (default: its scale as the cast read it). Scales already laid out 16 bytes
        apart in one buffer (a one-launch cast's, reused by the flagged backward) are read where
        they are; others are copied so first."""
        scale = kernels.laid_out_run(scales)
        if scale is None:
            scale = kernels.aligned_copy(torch.stack([s.view(()) for s in scales]))
        elif kept is None:
            kept = scales
        inv = kernels.aligned_reciprocal(scale)
        return self._cast_laid_out(x, splits, scale, inv, rowwise, columnwise, offsets,
                                   list(kept) if kept is not None else scale.unbind(0))

    def _cast_laid_out(self, x: torch.Tensor | kernels.PaddedRows, splits: Sequence[int], scale: torch.Tensor,
                       inv: torch.Tensor, rowwise: bool, columnwise: bool, offsets: torch.Tensor | None,
                       kept: Sequence[torch.Tensor]) -> Segments:
        """Every segment cast in one launch with ``scale [E]`` / ``inv [E]`` (16 bytes apart); ``x``
        a ``PaddedRows``: its experts as padded to ``splits``, read unpadded where the cast can."""
        if isinstance(x, kernels.PaddedRows):
            raw = kernels.cast_gathered(x, splits, self.fp8_dtype, "tensor", scale, rowwise, columnwise)
            if raw is not None:
                return self._segments_out(x.x, splits, raw[0], raw[2], inv, kept)
            x = x.padded()
        rows, cols = kernels.cast_tensorwise_segments(x, splits, scale, self.fp8_dtype, rowwise, columnwise, offsets)
        return self._segments_out(x, splits, rows, cols, inv, kept)

    def quantize(
        self,
        x: torch.Tensor,
        *,
        rowwise: bool = True,
        columnwise: bool = False,
        scale: torch.Tensor | None = None,
        record_amax: bool = True,
    ) -> QuantizedTensor:
        _check_2d(x, self.name)
        fused = self._fused_cast(x, rowwise, columnwise) if scale is None else None
        if fused is not None:
            row, col, scale, scale_inv = fused
        else:
            if scale is None:
                scale, scale_inv = self._scale_for(x, record_amax)
            else:
                scale_inv = torch.reciprocal(scale)
            row, col = kernels.cast_tensorwise(x, scale, self.fp8_dtype, rowwise, columnwise)
        qt = self._new(x, scale)
        if row is not None:
            qt.rowwise = Operand(row, scale_inv, self.layout)
        if col is not None:
            qt.columnwise = Operand(col, scale_inv, self.layout)
        return qt


class CurrentScalingQuantizer(_PerTensorQuantizer):
    """Scale from this tensor's amax (reduced over ``group``), now."""

    def __init__(
        self,
        fp8_dtype: torch.dtype,
        *,
        power_2_scale: bool = False,
        amax_epsilon: float = 0.0,
        group: dist.ProcessGroup | None = None,
        name: str = "tensor",
    ) -> None:
        super().__init__(fp8_dtype, name, group)
        self.power_2_scale = power_2_scale
        self.amax_epsilon = amax_epsilon

    def _scale_for(self, x: torch.Tensor, record_amax: bool) -> tuple[torch.Tensor, torch.Tensor]:
        kw: dict[str, Any] = dict(power_2_scale=self.power_2_scale, amax_epsilon=self.amax_epsilon)
        if not _grouped(self.group):
            return kernels.tensor_scale(x, self.fp8_dtype, **kw)
        amax = _reduce_amax(kernels.tensor_amax(x), self.group)
        return kernels.scale_from_amax(amax, self.fp8_dtype, **kw)

    def _fused_cast(self, x: torch.Tensor, rowwise: bool, columnwise: bool) -> kernels.CurrentCast | None:
        if _grouped(self.group):  # the amax is reduced over the group before the scale
            return None
        return kernels.cast_current(x, self.fp8_dtype, rowwise, columnwise, power_2_scale=self.power_2_scale,
                                    amax_epsilon=self.amax_epsilon)

    def _config(self) -> tuple[Any, ...]:
        return (*super()._config(), self.power_2_scale, self.amax_epsilon, self.group)

    def quantize_segments_packed(
        self,
        x: torch.Tensor,
        splits: Sequence[int],
        *,
        peers: Sequence[Quantizer],
        rowwise: bool,
        columnwise: bool,
        scales: Sequence[torch.Tensor | None] | None = None,
    ) -> Segments | None:
        if not self._segments_apply(x, peers, rowwise, columnwise):
            return None
        kw: dict[str, Any] = dict(power_2_scale=self.power_2_scale, amax_epsilon=self.amax_epsilon)
        reduce = _grouped(self.group)
        if scales is not None:  # the forward's scales, reused
            return self._cast_segments_scaled(x, splits, scales, rowwise, columnwise)  # type: ignore[arg-type]
        fused = None if reduce else \
            kernels.cast_current_segments(x, splits, self.fp8_dtype, rowwise, columnwise, **kw)
        if fused is not None:  # amax, scale and cast of every segment in one launch
            rows, cols, scale, inv = fused
        else:
            amax, scale, inv, offsets = kernels.segment_amax_scale(x, splits, self.fp8_dtype, scale=not reduce, **kw)
            if reduce:  # one all-reduce for every expert's amax
                scale, inv = kernels.scale_from_amax(_reduce_amax(amax, self.group), self.fp8_dtype, **kw)
            assert scale is not None and inv is not None
            rows, cols = kernels.cast_tensorwise_segments(x, splits, scale, self.fp8_dtype, rowwise, columnwise,
                                                          offsets)
        return self._segments_out(x, splits, rows, cols, inv, scale.unbind(0))

    def quantize_segments_gathered(self, src: kernels.PaddedRows, splits: Sequence[int], *,
                                   peers: Sequence[Quantizer], rowwise: bool, columnwise: bool,
                                   scales: Sequence[torch.Tensor | None] | None = None) -> Segments | None:
        if _grouped(self.group) or not self._segments_apply(src.x, peers, rowwise, columnwise):
            return None
        if scales is not None:  # the forward's scales, reused (the flag's backward)
            return self._cast_segments_scaled(src, splits, scales, rowwise, columnwise)  # type: ignore[arg-type]
        out = kernels.cast_current_gathered(src, splits, self.fp8_dtype, rowwise, columnwise,
                                            power_2_scale=self.power_2_scale, amax_epsilon=self.amax_epsilon)
        if out is None:
            return None
        rows, cols, scale, inv = out
        return self._segments_out(src.x, splits, rows, cols, inv, scale.unbind(0))  # type: ignore[union-attr]


def fold_amax(hist: torch.Tensor, amax: torch.Tensor) -> None:
    """Fold this cast's ``amax`` into the current step's history entry (slot 0 of ``hist [..., L]``,
    a max over the step's casts). A non-finite amax never enters a history (RECIPES.md): it
    records the previous step's amax (slot 1) instead, so one bad step cannot hold the scale for
    ``amax_history_len`` steps. With ``L == 1`` there is no slot 1 and it adds nothing (the next
    step then keeps its scale, as the previous amax would give)."""
    prev = hist[..., 1] if hist.shape[-1] > 1 else torch.zeros_like(hist[..., 0])
    amax = torch.where(torch.isfinite(amax), amax, prev)
    hist[..., 0] = torch.maximum(hist[..., 0], amax)


class Advanced(NamedTuple):
    """What ``DelayedScalingQuantizer._advance_peers`` left: the peers' stacked history (or
    None) and, where this call advanced them in one launch, ``(scales, inverses)``, each ``[E]``
    16 bytes apart (else None)."""

    hist: torch.Tensor | None
    laid_out: tuple[torch.Tensor, torch.Tensor] | None = None


class DelayedScalingQuantizer(_PerTensorQuantizer):
    """Scale from the amax history of past steps; this cast's amax joins the history.

    State: ``scale`` (in force for the current step), ``amax_history[L]`` (slot 0 = the current
    step, max over its casts) and ``step`` (the FP8 step the history was last rolled for). At the
    first cast of a new step the scale is recomputed from the history, then the history rolls.
    A non-finite amax never becomes a scale (the cast uses the scale in force) nor enters the
    history (``fold_amax``); a history whose amax is zero keeps the previous scale.
    """

    def __init__(
        self,
        fp8_dtype: torch.dtype,
        recipe: DelayedScaling,
        *,
        group: dist.ProcessGroup | None = None,
        name: str = "tensor",
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(fp8_dtype, name, group)
        self.recipe = recipe
        self.amax_history = torch.zeros(recipe.amax_history_len, dtype=torch.float32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        self.step = 0
        self._row: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (stack, i, view): see _advance_peers
        self._inverse: tuple[torch.Tensor, torch.Tensor] | None = None  # (scale, 1 / scale): see _scale_inv
        self._launch: Any = None  # the prepared launch of this quantizer's step: see _advance

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave out the prepared launch too (it holds compiled kernels): a copy
        prepares its own at its first step."""
        return {**super().__getstate__(), "_launch": None}

    def _to(self, device: torch.device) -> None:
        if self.amax_history.device != device:
            self.amax_history = self.amax_history.to(device)
            self.scale = self.scale.to(device)

    def _advance(self) -> None:
        """At the first cast of a new FP8 step: that step's scale and rolled history (``_advance_to``)."""
        now = fp8_step()
        if now != self.step:
            self._advance_to(now)

    def _advance_to(self, now: int) -> None:
        """Step ``now``'s scale and rolled history: on the kernels' device one launch, which also
        gives 1/scale, prepared at the first step (``kernels.delayed_state_alone``; the same
        kernel and bits as ``_advance_together`` of this one quantizer, which runs elsewhere)."""
        out = kernels.delayed_state_alone(self.amax_history, self.scale, self.fp8_dtype, margin=self.recipe.margin,
                                          algo_max=self.recipe.amax_compute_algo == "max",
                                          launch=self.__dict__.get("_launch"))
        if out is None:
            self._advance_together([self], now)
            return
        scale, inv, self.amax_history, self._launch = out
        self.scale, self.step, self._inverse, self._row = scale, now, (scale, inv), None

    def _scale_inv(self) -> torch.Tensor:
        """1 / scale: the one a fused step computed with this scale (the same bits as
        ``torch.reciprocal``), else computed now."""
        kept = self._inverse
        return kept[1] if kept is not None and kept[0] is self.scale else torch.reciprocal(self.scale)

    def _next_state(self, hist: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's new ``(scale, history)`` from the history (``[L]``, or ``[E, L]`` for
        experts advanced together) and the scale in force (``[]`` / ``[E]``): new tensors, so
        saved snapshots stay valid; a non-finite or zero amax keeps the old scale."""
        amax = hist.amax(dim=-1) if self.recipe.amax_compute_algo == "max" else hist[..., 0]
        new = amax_to_scale(amax, self.fp8_dtype, margin=self.recipe.margin)
        usable = torch.isfinite(amax) & (amax > 0)
        hist = torch.roll(hist, 1, dims=-1)
        hist[..., 0] = 0.0
        return torch.where(usable, new, scale), hist

    @staticmethod
    def _stack_of(peers: Sequence[DelayedScalingQuantizer]) -> torch.Tensor | None:
        """The ``[E, L]`` tensor whose row ``i`` is ``peers[i].amax_history``, where a stacked
        advance left them so (and nothing has replaced a history since), else None. One peer's
        is a view of its own history (a lone step, ``_advance_to``, keeps no stack)."""
        if len(peers) == 1:
            return peers[0].amax_history.unsqueeze(0)
        rows = [getattr(p, "_row", None) for p in peers]
        if rows[0] is None:
            return None
        stack = rows[0][0]
        ok = stack.shape[0] == len(peers) and all(
            r is not None and r[0] is stack and r[1] == i and r[2] is p.amax_history
            for i, (p, r) in enumerate(zip(peers, rows)))
        return stack if ok else None

    @staticmethod
    def _advance_peers(peers: Sequence[DelayedScalingQuantizer]) -> Advanced:
        """``_advance`` of every peer (same recipe and format) together: their histories
        stacked ``[E, L]``, each peer's history then a row of it, its scale an element of one new
        ``[E]`` tensor; on the kernels' device one launch (``kernels.delayed_state``), which also
        gives the scales 16 bytes apart and their inverses (``Advanced.laid_out``), else
        ~20 torch ops for all peers. Elementwise the same arithmetic, so the same bits as one by
        one. ``Advanced.hist``: the stack the peers' histories are rows of (also when a stacked
        advance earlier in the step left them so), or None: then the caller records one by one.
        Peers that are not all stale, or one quantizer listed twice, advance one by one."""
        now = fp8_step()
        stale = [p for p in peers if p.step != now]
        if len(peers) < 2 or len(stale) < len(peers) or len({id(p) for p in peers}) < len(peers):
            for p in stale:
                p._advance()
            return Advanced(DelayedScalingQuantizer._stack_of(peers))
        return DelayedScalingQuantizer._advance_together(peers, now)

    @staticmethod
    def _advance_together(peers: Sequence[DelayedScalingQuantizer], now: int) -> Advanced:
        """The stacked step of ``_advance_peers`` (every peer stale, none twice; one peer alone
        is ``_advance``): one ``delayed_state`` launch on the kernels' device, else the torch ops
        of ``_next_state`` on the stack."""
        p0 = peers[0]
        stack = DelayedScalingQuantizer._stack_of(peers)
        if stack is None:
            stack = torch.stack([p.amax_history for p in peers])  # (one peer: _stack_of's view of its history)
        scales = torch.stack([p.scale for p in peers]) if len(peers) > 1 else p0.scale.reshape(1)
        fused = kernels.delayed_state(stack, scales, p0.fp8_dtype, margin=p0.recipe.margin,
                                      algo_max=p0.recipe.amax_compute_algo == "max")
        if fused is not None:
            scale, inv, hist = fused
        else:
            scale, hist = p0._next_state(stack, scales)
        for p, s, h, i in zip(peers, scale.unbind(0), hist.unbind(0), range(len(peers))):
            p.scale, p.amax_history, p.step = s, h, now
            p._row = (hist, i, h)
            p._inverse = (s, inv[i]) if fused is not None else None
        return Advanced(hist, (scale, inv) if fused is not None else None)

    def _scale_for(self, x: torch.Tensor, record_amax: bool) -> tuple[torch.Tensor, torch.Tensor]:
        self._to(x.device)
        self._advance()
        if record_amax:
            if not _grouped(self.group) and kernels.amax_folds(x, self.amax_history):
                kernels.tensor_amax(x, history=self.amax_history.unsqueeze(0))  # amax and fold_amax in the kernel
            else:
                fold_amax(self.amax_history, _reduce_amax(kernels.tensor_amax(x), self.group))
        return self.scale, self._scale_inv()

    def _config(self) -> tuple[Any, ...]:
        return (*super()._config(), self.recipe, self.group)

    def quantize_segments_packed(
        self,
        x: torch.Tensor,
        splits: Sequence[int],
        *,
        peers: Sequence[Quantizer],
        rowwise: bool,
        columnwise: bool,
        scales: Sequence[torch.Tensor | None] | None = None,
    ) -> Segments | None:
        """Every expert in one amax launch and one cast, each with its own state: the same scales
        in force, the same amaxes joining the same histories as ``peers[i].quantize(segment_i)``
        (``scales`` given: the forward's, reused, no amax recorded)."""
        if not self._segments_apply(x, peers, rowwise, columnwise):
            return None
        if scales is not None:  # the forward's scales, reused, no amax recorded
            return self._cast_segments_scaled(x, splits, scales, rowwise, columnwise)  # type: ignore[arg-type]
        delayed = [p for p in peers if isinstance(p, DelayedScalingQuantizer)]
        for p in delayed:
            p._to(x.device)
        adv = self._advance_peers(delayed)  # one launch (or ~20 small ones) for all experts, not per expert
        hist = adv.hist
        record_here = hist is not None and hist.is_contiguous() and not _grouped(self.group)
        amax, _, _, offsets = kernels.segment_amax_scale(x, splits, self.fp8_dtype, scale=False,
                                                         history=hist if record_here else None)
        if not record_here:
            amax = _reduce_amax(amax, self.group)  # elementwise: each expert's amax reduced, as one by one
            if hist is not None:
                fold_amax(hist, amax)
            else:
                for i, p in enumerate(delayed):
                    fold_amax(p.amax_history, amax[i])
        in_force = [p.scale for p in delayed]  # kept as the per-expert casts keep them: the state's own
        if adv.laid_out is not None:  # this step's scales and inverses, already laid out for the cast
            return self._cast_laid_out(x, splits, *adv.laid_out, rowwise, columnwise, offsets, in_force)
        return self._cast_segments_scaled(x, splits, in_force, rowwise, columnwise, offsets, kept=in_force)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale.clone(), "amax_history": self.amax_history.clone(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_delayed_state(state, f"delayed-scaling state for {self.name}")
        hist = state["amax_history"]
        if hist.shape != self.amax_history.shape:
            raise ValueError(
                f"delayed-scaling state for {self.name}: amax_history has length {hist.shape[0]}, "
                f"the recipe says amax_history_len={self.amax_history.shape[0]}"
            )
        self.amax_history = hist.to(self.amax_history.device, torch.float32).clone()
        self.scale = state["scale"].to(self.scale.device, torch.float32).reshape(()).clone()
        # The saved step counted another process's FP8 steps: the state is that of a finished
        # step, so the next cast starts a new one (rolls the history, takes the new scale), as
        # in the run that saved it; a fresh process's counter could otherwise equal it.
        self.step = -1
        self._row = None


def check_delayed_state(state: Any, where: str) -> None:
    """A delayed-scaling quantizer's saved state (``state_dict``) is whole and usable: an FP32-able
    1-D history of finite, non-negative amaxes and one finite, positive scale; else a ValueError
    naming ``where`` (the layer, the state_dict key and the quantizer)."""
    if not isinstance(state, dict):
        raise ValueError(f"{where}: expected a dict with scale, amax_history and step, got {type(state).__name__}")
    missing = {"scale", "amax_history", "step"} - set(state)
    if missing:
        raise ValueError(f"{where}: the saved delayed-scaling state lacks {sorted(missing)}")
    hist, scale = state["amax_history"], state["scale"]
    if not isinstance(hist, torch.Tensor) or hist.dim() != 1 or hist.numel() == 0:
        raise ValueError(f"{where}: amax_history must be a non-empty 1-D tensor, got "
                         f"{tuple(hist.shape) if isinstance(hist, torch.Tensor) else type(hist).__name__}")
    if not bool(torch.isfinite(hist).all()) or bool((hist < 0).any()):
        raise ValueError(f"{where}: amax_history holds non-finite or negative amaxes; the checkpoint is corrupt "
                         f"(an amax is a finite max |x|)")
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        raise ValueError(f"{where}: scale must be a one-element tensor, got "
                         f"{tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__}")
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise ValueError(f"{where}: scale={scale.item()!r} is not finite and positive; the checkpoint is corrupt")
