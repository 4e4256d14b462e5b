"""Device dispatch for the casts: the torch reference on CPU; fused kernels on CUDA.

Backends on CUDA, in order of preference (``MEGATRON_FP8_CAST_BACKEND`` = ``auto`` |
``triton`` | ``compile`` | ``eager`` pins one):

* ``triton``: ``triton_cast.py``, one pass over the input writes both copies and their scales.
  Used for tensorwise casts (current scaling: one launch of the persistent cast of
  ``triton_persistent.py``, else amax partials, then a cast that computes the scale; with a
  given scale, one launch), for power-of-two 1x128 / 128x128 block casts without an amax epsilon
  (the defaults), and for the one-launch casts of all experts of a grouped layer
  (``*_segments``).
* ``compile``: ``torch.compile`` of the reference functions below (block options the kernels
  do not cover; MXFP8 only when forced, since SM90 emulates its GEMMs anyway).
* ``eager``: the reference itself.

Every backend computes the reference's arithmetic; the GPU tests compare them bitwise.
"""

from __future__ import annotations

import functools
import itertools
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from . import reference as ref
from .tensor import SCALE_STRIDE, aligned_scalars

Pair = tuple[torch.Tensor, torch.Tensor]
Copies = tuple[Pair | None, Pair | None]
_BACKENDS = ("auto", "triton", "compile", "eager")


def cast_backend() -> str:
    v = os.environ.get("MEGATRON_FP8_CAST_BACKEND", "auto").lower()
    if v not in _BACKENDS:
        raise ValueError(f"MEGATRON_FP8_CAST_BACKEND={v!r}; allowed: {', '.join(_BACKENDS)}")
    return v


@functools.cache
def _triton() -> Any | None:
    try:
        from ..kernels import triton_cast
    except ImportError:
        return None
    return triton_cast


@functools.cache
def _scales() -> Any | None:
    """``triton_scale`` (amaxes and scales), importable wherever ``_triton()`` is."""
    if _triton() is None:
        return None
    from ..kernels import triton_scale

    return triton_scale


@functools.cache
def _pad() -> Any | None:
    """``triton_pad`` (expert padding in one pass), importable wherever ``_triton()`` is."""
    if _triton() is None:
        return None
    from ..kernels import triton_pad

    return triton_pad


def pad_expert_rows(x: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:
    """``x``'s row ``i`` at row ``rows[i]`` of ``total`` rows, zeros between (``ops.padding``):
    one Triton pass where the kernels serve ``x`` (``triton_pad``), else torch's zeros and
    ``index_copy_``; the same bits either way."""
    if _triton_here(x) and _pad().serves(x, rows):
        return _pad().pad_rows(x, rows, total)
    return x.new_zeros((total, *x.shape[1:])).index_copy_(0, rows, x)


def expert_index(real: Sequence[int], padded: Sequence[int], device: torch.device) -> torch.Tensor | None:
    """The padded row of each real row (``ops.padding.expert_rows``) in one Triton launch from the
    experts' prefix sums (``segment_offsets``, which the casts and GEMMs of the same splits then
    find on the device), where the kernels run on ``device`` (on CUDA, the current device: the
    launch goes to its stream); else None (the caller builds it with torch)."""
    if device.type == "cuda":
        if device.index is not None and device.index != torch.cuda.current_device():
            return None
    elif os.environ.get("TRITON_INTERPRET") != "1":
        return None
    if cast_backend() not in ("auto", "triton") or _pad() is None:
        return None
    return _pad().expert_index(*segment_offsets_pair(real, padded, device), sum(real))


class PaddedRows(NamedTuple):
    """Experts' rows that a cast is to see zero-padded (``ops.padding``), held unpadded: ``x`` the
    real rows back to back, ``real`` their counts, ``rows`` the padded row of each real row and
    ``total`` the padded count. ``cast_gathered`` casts them without the padded tensor; ``padded``
    writes it (for every other cast)."""

    x: torch.Tensor
    real: tuple[int, ...]
    rows: torch.Tensor
    total: int

    def padded(self) -> torch.Tensor:
        return pad_expert_rows(self.x, self.rows, self.total)


def cast_gathered(src: PaddedRows, splits: Sequence[int], dtype: torch.dtype, mode: str,
                  tensor_scale: torch.Tensor | None = None, rowwise: bool = True, columnwise: bool = True
                  ) -> tuple[torch.Tensor | None, ...] | None:
    """The copies of ``src``'s experts padded to ``splits`` (multiples of 128), as
    ``triton_cast.cast_segments`` casts the padded tensor, read from the unpadded rows
    (``triton_cast.cast_segments_gathered``: ``1x128``, or ``tensor`` with the scales given): the
    raw ``(row, row_s, col, col_s)``, or None where that does not serve (the caller pads,
    ``src.padded()``, and casts that). Measured on an H100 (run AI): padding x before its cast took
    99 us of a ~1.4 ms graphed router step, dy's 49."""
    x = src.x
    if not (x.numel() and segments_fused(x, columnwise)) or len(splits) != len(src.real):
        return None
    return _gathered_guard(lambda: _triton().cast_segments_gathered(
        x, segment_offsets(src.real, x.device), segment_offsets(splits, x.device), list(splits), dtype, mode,
        tensor_scale, rowwise, columnwise))


def cast_current_gathered(src: PaddedRows, splits: Sequence[int], dtype: torch.dtype, rowwise: bool,
                          columnwise: bool, *, power_2_scale: bool, amax_epsilon: float
                          ) -> tuple[torch.Tensor | None, ...] | None:
    """Current scaling's ``cast_current_segments`` of ``src``'s experts padded to ``splits``,
    without the padded tensor, where its casts run as amax and scale launches, then the cast with
    the scales given (``cuda_cast.current_enabled``: by default while a CUDA graph is captured;
    eagerly the one-launch cast of the padded tensor costs the host less): each expert's amax over
    its real rows (the padding's zeros change no amax), then ``cast_gathered`` with those scales.
    ``(row, col, scale [E], 1/scale [E])``, or None (the caller pads and casts)."""
    x = src.x
    if not (_triton_here(x) and x.numel() and len(splits) == len(src.real)) or any(m % 128 for m in splits):
        return None
    from ..kernels import cuda_cast

    if not cuda_cast.current_enabled():
        if cuda_cast.current_setting() == "capture" and cuda_cast.serves(x, dtype, "tensor", True, True, True,
                                                                          gathered=True):
            cuda_cast.prebuild("tensor", dtype, x.device, True)  # built now, for the captures to come
        return None
    _, scale, inv = _scales().amax_and_scale(x.contiguous(), dtype, offsets=segment_offsets(src.real, x.device),
                                             n_seg=len(splits), power_2_scale=power_2_scale,
                                             amax_epsilon=amax_epsilon)
    raw = cast_gathered(src, splits, dtype, "tensor", scale, rowwise, columnwise)
    if raw is None:
        return None
    return raw[0], raw[2], scale, inv


# ---- reference compositions (the CPU path and what `compile` compiles) ----------------------
def _tensorwise_ref(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rowwise: bool,
                    columnwise: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    row = ref.cast_to_fp8(x, scale, dtype) if rowwise else None
    if not columnwise:
        return row, None
    col = row if row is not None else ref.cast_to_fp8(x, scale, dtype)  # elementwise: transpose is exact
    return row, col.t().contiguous()


def check_1d(shape: tuple[int, ...], rowwise: bool, columnwise: bool, block: int, name: str) -> None:
    """Shape checks of 1 x ``block`` casts, without touching data (cheap: no kernel, no trace)."""
    if rowwise:
        ref.check_block_shape(tuple(shape), block, name, "its features (the last dim)")
    if columnwise:  # the copy the weight gradient reads: blocks along the tokens
        ref.check_block_shape(tuple(shape), block, name, "its tokens (rows, for the weight gradient)", dim=0)


def _columns_1d(x: torch.Tensor, cast: Callable[..., Pair], block: int, what: str, **kw: Any) -> Pair:
    """Columnwise copy ``[K, M]`` of ``x [M, K]``: blocks of ``block`` rows within each column."""
    data, s = cast(x.t(), block=block, what=what, **kw)
    return data.contiguous(), s.contiguous()


def _blocks_1d_ref(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool, block: int,
                   pow2: bool, eps: float, name: str) -> Copies:
    kw: dict[str, Any] = dict(power_2_scale=pow2, amax_epsilon=eps)
    cast = functools.partial(ref.cast_blocks_1d, fp8_dtype=dtype)
    row = cast(x, block=block, what=f"{name} (rowwise 1x{block})", **kw) if rowwise else None
    col = _columns_1d(x, cast, block, f"{name} (columnwise 1x{block} along dim 0)", **kw) if columnwise else None
    return row, col


def _blocks_2d_ref(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool, block: int,
                   pow2: bool, eps: float, name: str) -> Copies:
    data, s = ref.cast_blocks_2d(x, dtype, block=block, power_2_scale=pow2, amax_epsilon=eps, what=name)
    col = (data.t().contiguous(), s.t().contiguous()) if columnwise else None  # same blocks, transposed
    return ((data, s) if rowwise else None), col


def _mx_ref(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool, block: int,
            name: str) -> Copies:
    cast = functools.partial(ref.cast_mx, fp8_dtype=dtype)
    row = cast(x, block=block, what=f"{name} (rowwise 1x{block})") if rowwise else None
    col = _columns_1d(x, cast, block, f"{name} (columnwise 1x{block} along dim 0)") if columnwise else None
    return row, col


# ---- dispatch --------------------------------------------------------------------------------
@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    return torch.compile(fn)


def _contiguous(out: Any) -> Any:
    """Compiled graphs may return outputs in another stride order; GEMMs need row-major data."""
    if isinstance(out, torch.Tensor):
        return out.contiguous()
    if isinstance(out, tuple):
        return tuple(_contiguous(o) for o in out)
    return out


def _run(fn: Callable[..., Any], x: torch.Tensor, *args: Any, triton_ok: bool,
         triton_call: Callable[[], Any] | None = None, check: Callable[[], None] | None = None,
         compile_ok: bool = True) -> Any:
    """Run a cast on the chosen backend; ``check`` raises the reference's clear shape errors
    before any kernel or compiler sees a bad shape."""
    backend = cast_backend()
    if not _kernel_device(x) and backend in ("auto", "triton"):
        backend = "eager"  # `compile` may be forced on CPU (for testing the compiled path)
    if check is not None:
        check()
    if backend in ("auto", "triton") and triton_ok and _triton() is not None and triton_call is not None:
        return triton_call()
    if backend == "triton":
        raise RuntimeError(f"MEGATRON_FP8_CAST_BACKEND=triton, but {fn.__name__} has no Triton kernel "
                           "for these options (or Triton is missing); use 'auto'")
    if backend in ("auto", "compile") and compile_ok:
        return _contiguous(_compiled(fn)(x, *args))
    return fn(x, *args)


def cast_tensorwise(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rowwise: bool,
                    columnwise: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-tensor cast: ``(row [M, K] | None, col [K, M] | None)``."""
    def tri() -> tuple[torch.Tensor | None, torch.Tensor | None]:
        row, col = _triton().cast_tiles(x, dtype, "tensor", rowwise, columnwise, scale.float())
        return (row[0] if row else None), (col[0] if col else None)

    return _run(_tensorwise_ref, x, scale, dtype, rowwise, columnwise,
                triton_ok=x.dim() == 2 and _transpose_ok(x, columnwise), triton_call=tri)


# ---- per-tensor amax and scale ----------------------------------------------------------------
def _kernel_device(x: torch.Tensor) -> bool:
    """CUDA tensors; CPU ones too under ``TRITON_INTERPRET=1`` (Triton's interpreter, for
    debugging the kernels on a machine without a GPU; its FP8 rounding is not the hardware's)."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _triton_here(t: torch.Tensor) -> bool:
    """Whether the Triton kernels serve ``t``: on their device, allowed by the backend, importable."""
    return _kernel_device(t) and cast_backend() in ("auto", "triton") and _triton() is not None


def _fused(x: torch.Tensor) -> bool:
    return x.dim() == 2 and _triton_here(x)


def _transpose_ok(x: torch.Tensor, columnwise: bool) -> bool:
    """The Triton kernels' columnwise (transposed) FP8 copy came out wrong for FP32 inputs on
    the H200 (torch 2.11's Triton; tests/test_kernels_gpu.py caught it, BF16/FP16 are bitwise):
    FP32 inputs needing a columnwise copy take the compiled reference instead."""
    return not (columnwise and x.dtype == torch.float32)


def _block_kernel_ok(x: torch.Tensor, columnwise: bool, block: int, pow2: bool, eps: float) -> bool:
    """Options the Triton block kernels compute: 128-blocks, power-of-two scales, no epsilon."""
    return block == 128 and pow2 and eps == 0.0 and _transpose_ok(x, columnwise)


def tensor_amax(x: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
    """``max |x|`` as an FP32 scalar (NaN propagates), ``reference.tensor_amax``'s value;
    ``history`` (``[1, L]``, where ``amax_folds``): the amax also joins ``history[0, 0]`` as
    ``tensor_scaling.fold_amax`` does, in the same launch."""
    if _fused(x):
        return _scales().amax_and_scale(x, torch.float8_e4m3fn, scale=False, history=history)[0].view(())
    if history is not None:
        raise ValueError("tensor_amax: history= needs the kernels (see amax_folds)")
    return ref.tensor_amax(x)


def amax_folds(x: torch.Tensor, history: torch.Tensor) -> bool:
    """Whether ``tensor_amax(x, history=...)`` folds the amax into ``history`` (1-D, contiguous,
    on ``x``'s device) in its launch: where the kernels serve ``x``."""
    return _fused(x) and history.is_contiguous() and history.device == x.device


def tensor_scale(x: torch.Tensor, dtype: torch.dtype, *, power_2_scale: bool = False,
                 amax_epsilon: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, 1/scale)`` from this tensor's amax (current scaling, no group reduction)."""
    if _fused(x):
        _, s, inv = _scales().amax_and_scale(x, dtype, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon)
        return s.view(()), inv.view(())
    return scale_from_amax(ref.tensor_amax(x), dtype, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, *, margin: int = 0, power_2_scale: bool = False,
                    amax_epsilon: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(reference.amax_to_scale(amax), its reciprocal)``; one launch on CUDA."""
    kw: dict[str, Any] = dict(margin=margin, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon)
    if _triton_here(amax):
        s, inv = _scales().scale_from_amax(amax, dtype, **kw)
        return s.view(amax.shape), inv.view(amax.shape)
    s = ref.amax_to_scale(amax, dtype, **kw)
    return s, torch.reciprocal(s)


# ---- segments (the experts of a grouped layer, rows back to back) ---------------------------
def segments_fused(x: torch.Tensor, columnwise: bool) -> bool:
    """Whether the fused Triton casts serve ``x`` here with these copies (CUDA with Triton;
    FP32 with a columnwise copy excepted): one tensor, or all its segments in one launch."""
    return _fused(x) and _transpose_ok(x, columnwise)


def block_segments_fused(x: torch.Tensor, block: int, pow2: bool, eps: float) -> bool:
    """``segments_fused`` (with a columnwise copy) for block casts with these options."""
    return segments_fused(x, True) and _block_kernel_ok(x, True, block, pow2, eps)


_INTS_KEPT = 16  # distinct int lists whose device copies are kept (a step's layers share them)
_Ints = tuple[torch.Tensor, torch.Tensor]  # (the pinned host copy, the device tensor)
_IntsKey = tuple[tuple[int, ...], torch.device, torch.dtype]
_ints_cache: dict[_IntsKey, _Ints] = {}
# Copies a CUDA graph captured: kept for the life of the process, since a graph may be replayed
# at any time (an evicted tensor would be freed under it). Those a capture created itself are
# only written when the graph replays, so no one else is handed them.
_ints_held: dict[_IntsKey, _Ints] = {}
_ints_captured: list[_Ints] = []


def capturing(device: torch.device) -> bool:
    """Whether work for ``device`` is being captured into a CUDA graph now (a tensor made now is
    written only when the graph replays; one a graph captured must outlive it)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def device_ints(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` as a ``dtype`` (int64) tensor on ``device``; read-only, shared.

    Copied from pinned memory without a sync and kept for the last few lists: the experts'
    token counts of one step are used several times (x in forward, dy in backward, fc1 and fc2),
    and the weights' splits never change. A fresh pinned buffer per call would cost a host
    allocation each time (the GPU still holds the previous ones). Copies used while a CUDA graph
    is captured are kept for good, with their pinned source (``_ints_held``); one made during a
    capture is a node of the graph."""
    key = (tuple(values), torch.device(device), dtype)
    held = _ints_held.get(key)
    if held is not None:
        return held[1]
    entry = _ints_cache.pop(key, None)
    in_capture = capturing(key[1])
    if entry is None:
        host = torch.tensor(key[0], dtype=dtype, pin_memory=key[1].type == "cuda")
        entry = (host, host.to(key[1], non_blocking=True))
        if in_capture:  # its copy is a node of the graph: valid only once the graph has replayed
            _ints_captured.append(entry)
            return entry[1]
        _make_room(1)
    if in_capture:
        _ints_held[key] = entry
    else:
        _ints_cache[key] = entry  # most recent last
    return entry[1]


def _make_room(entries: int) -> None:
    """Evict the oldest eager ``device_ints`` entries until ``entries`` new ones fit."""
    while _ints_cache and len(_ints_cache) > _INTS_KEPT - entries:
        _ints_cache.pop(next(iter(_ints_cache)))


def segment_offsets(splits: Sequence[int], device: torch.device) -> torch.Tensor:
    """Prefix sums ``[0, s0, s0+s1, ...]`` (int64) of ``splits`` on ``device`` (``device_ints``)."""
    return device_ints((0, *itertools.accumulate(splits)), device)


def segment_offsets_pair(real: Sequence[int], padded: Sequence[int], device: torch.device
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``segment_offsets`` of both ``real`` and ``padded`` (a router step's new splits): where
    neither is kept yet and no graph is being captured, both reach the device in one pinned copy
    (two views of it, kept as ``device_ints`` keeps each), else one by one."""
    dev = torch.device(device)
    a = (0, *itertools.accumulate(real))
    b = (0, *itertools.accumulate(padded))
    ka, kb = (a, dev, torch.int64), (b, dev, torch.int64)
    if a == b or any(k in _ints_held or k in _ints_cache for k in (ka, kb)) or capturing(dev):
        return device_ints(a, dev), device_ints(b, dev)
    n = len(a) + len(a) % 2  # the second view 16 bytes aligned too, as a tensor of its own would be
    host = torch.tensor(a + (0,) * (n - len(a)) + b, dtype=torch.int64, pin_memory=dev.type == "cuda")
    both = host.to(dev, non_blocking=True)
    _make_room(2)
    _ints_cache[ka] = first = (host[:len(a)], both[:len(a)])
    _ints_cache[kb] = second = (host[n:], both[n:])
    return first[1], second[1]


def segment_amax_scale(x: torch.Tensor, splits: Sequence[int], dtype: torch.dtype, *, scale: bool,
                       power_2_scale: bool = False, amax_epsilon: float = 0.0, history: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Per segment ``(amax [E], scale [E], 1/scale [E], offsets)`` in two launches (CUDA);
    ``history [E, L]``: each amax also joins ``history[:, 0]`` (``tensor_scaling.fold_amax``)."""
    off = segment_offsets(splits, x.device)
    amax, s, inv = _scales().amax_and_scale(x, dtype, offsets=off, n_seg=len(splits), scale=scale,
                                           power_2_scale=power_2_scale, amax_epsilon=amax_epsilon, history=history)
    return amax, s, inv, off


def delayed_state(history: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, margin: int, algo_max: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Every expert's delayed-scaling step in one launch (``triton_scale.delayed_state``), or None
    off the kernels' device (the caller then runs the same arithmetic in torch)."""
    if not _fused(history) or not history.is_contiguous():
        return None
    return _scales().delayed_state(history, scale, dtype, margin=margin, algo_max=algo_max)


def delayed_state_alone(history: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, margin: int,
                        algo_max: bool, launch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any] | None:
    """One quantizer's delayed-scaling step (``triton_scale.delayed_state_alone``): ``(scale,
    1/scale, history, launch)``, ``launch`` to pass back next step; None off the kernels'
    device, or for state it does not take (not a contiguous FP32 ``[L]`` history and ``[]``
    scale, 16-byte aligned): the caller then runs ``delayed_state`` on the ``[1, L]`` stack."""
    if not (history.dim() == 1 and scale.dim() == 0 and history.dtype == scale.dtype == torch.float32
            and history.is_contiguous() and not history.data_ptr() % 16 and not scale.data_ptr() % 16
            and _triton_here(history)):
        return None
    if launch is not None and launch.device != history.device.index:
        launch = None  # prepared on another device: the state moved
    return _scales().delayed_state_alone(history, scale, dtype, margin=margin, algo_max=algo_max, launch=launch)


CurrentCast = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]


def cast_current(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool, *, power_2_scale: bool,
                 amax_epsilon: float) -> CurrentCast | None:
    """Current scaling (amax, scale, cast; ``_current_launches``): ``(row, col, scale, 1/scale)``,
    or None where that does not apply (off the kernels' device, FP32 with a columnwise copy,
    empty)."""
    if not segments_fused(x, columnwise) or x.numel() == 0:
        return None
    out = _current_launches(x, dtype, rowwise, columnwise, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon)
    if out is None:
        return None
    row, col, s, inv = out
    return row, col, s.view(()), inv.view(())


class _KernelGuard:
    """A newer kernel path over an older one: if this Triton fails to build or launch it, warn
    once and let the caller take the older path from then on (the GPU tests call each path
    directly and fail loudly). An out-of-memory error (transient: the older path needs the memory
    too) or a ``ValueError`` (the caller's inputs) reaches the caller and leaves the path on."""

    def __init__(self, what: str, fallback: str) -> None:
        self.what, self.fallback, self.ok = what, fallback, True

    def __call__(self, run: Callable[[], Any]) -> Any:
        if not self.ok:
            return None
        try:
            return run()
        except (torch.OutOfMemoryError, ValueError):
            raise
        except Exception as e:  # noqa: BLE001 - a build or launch failure of any kind
            self.ok = False
            warnings.warn(f"megatron_fp8: {self.what} unavailable ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); using {self.fallback}",
                          RuntimeWarning, stacklevel=4)
            return None


# the experts' casts that read the padding as zeros (cast_gathered) over padding first
_gathered_guard = _KernelGuard("gathered expert cast", "padding the experts' rows first")
# the fused current-scaling cast (scale computed in the cast) over amax, scale and cast launches;
# the one-launch (persistent) cast over the fused one
_fused_current = _KernelGuard("fused current-scaling cast", "amax, scale and cast launches")
_one_launch = _KernelGuard("one-launch current-scaling cast", "two launches")


def _current_launches(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool,
                      **kw: Any) -> tuple[Any, Any, torch.Tensor, torch.Tensor] | None:
    """``triton_cast.cast_current``: amax, scale and the CUDA tile cast where that serves
    (``cuda_current_ok``: by default BF16 tensors aligned to 128 while a CUDA graph is captured;
    the Triton tile cast if the CUDA one cannot be built), else in one launch where
    ``triton_persistent`` runs and builds here, else in two; None where neither builds."""
    t = _triton()
    if t.cuda_current_ok(x, dtype, rowwise, columnwise):
        return t.cast_current(x, dtype, rowwise, columnwise, scales_first=True, **kw)
    if t.one_launch_ok(x):
        out = _one_launch(lambda: t.cast_current(x, dtype, rowwise, columnwise, one_launch=True, **kw))
        if out is not None:
            return out
    return _fused_current(lambda: t.cast_current(x, dtype, rowwise, columnwise, one_launch=False, **kw))


def cast_current_segments(x: torch.Tensor, splits: Sequence[int], dtype: torch.dtype, rowwise: bool,
                          columnwise: bool, *, power_2_scale: bool, amax_epsilon: float
                          ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
    """``cast_current`` of every segment: the raw ``row [M, K]`` / flat ``col [K * M]`` buffers
    (``quant.tensor.Pack`` views them per segment) and per-segment scales ``[E]``, 16 bytes apart;
    or None where that does not apply (also: a split zero or not a multiple of 128)."""
    if not segments_fused(x, columnwise) or any(m <= 0 or m % 128 for m in splits):
        return None
    return _current_launches(x, dtype, rowwise, columnwise, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon,
                             splits=list(splits), offsets=segment_offsets(splits, x.device))


def aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """``t [E]`` copied so that each ``t[i]`` is 16-byte aligned (a per-expert GEMM scale)."""
    out = aligned_scalars(t.numel(), t.device)
    out.copy_(t)
    return out


def aligned_reciprocal(t: torch.Tensor) -> torch.Tensor:
    """``1 / t`` for ``t [E]``, each element 16-byte aligned (``torch.reciprocal``'s bits)."""
    return torch.reciprocal(t, out=aligned_scalars(t.numel(), t.device))


def laid_out_run(scalars: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``[E]`` view of FP32 scalars that already lie 16 bytes apart, in order, in one buffer (the
    per-expert scales of a one-launch cast), else None (also for a single scalar)."""
    s0 = scalars[0]
    stride = SCALE_STRIDE
    if len(scalars) < 2 or s0.dtype != torch.float32 or s0.numel() != 1:
        return None
    base, size = s0.data_ptr(), s0.element_size()
    for i, s in enumerate(scalars):
        if s.data_ptr() != base + i * stride * size or s.dtype != torch.float32 or s.numel() != 1:
            return None
    store = s0.untyped_storage()
    if base + ((len(scalars) - 1) * stride + 1) * size > store.data_ptr() + store.nbytes():
        return None
    return s0.as_strided((len(scalars),), (stride,))


def cast_tensorwise_segments(x: torch.Tensor, splits: Sequence[int], scales: torch.Tensor, dtype: torch.dtype,
                             rowwise: bool, columnwise: bool, offsets: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Each segment cast with its scale (``scales [E]``), one launch: the raw rowwise
    ``[M, K]`` and flat columnwise ``[K * M]`` buffers (``quant.tensor.Pack`` views them)."""
    off = offsets if offsets is not None else segment_offsets(splits, x.device)
    if len(splits) > 1 and scales.stride(0) != SCALE_STRIDE:  # the kernel reads scales 16 bytes apart
        scales = aligned_copy(scales)
    row, _, col, _ = _triton().cast_segments(x, off, list(splits), dtype, "tensor", rowwise, columnwise, scales)
    return row, col


def cast_blocks_segments(x: torch.Tensor, splits: Sequence[int], dtype: torch.dtype, rowwise: bool,
                         columnwise: bool, block: int, pow2: bool, eps: float, mode: str
                         ) -> tuple[torch.Tensor | None, ...] | None:
    """Block casts (``mode`` ``"1x128"``: experts' tokens; ``"128x128"``: experts' weights
    stacked) of every segment in one launch: the raw ``(row, row_s, col, col_s)`` buffers
    (``triton_cast.cast_segments``), or None where that launch does not apply (not on the
    kernels' device, options they lack, a split or K not a multiple of 128: a block would span
    two experts)."""
    if not (segments_fused(x, columnwise) and _block_kernel_ok(x, columnwise, block, pow2, eps)):
        return None
    if x.shape[1] % 128 or any(m % 128 for m in splits):
        return None
    return _triton().cast_segments(x, segment_offsets(splits, x.device), list(splits), dtype, mode, rowwise, columnwise)


def cast_blocks_1d(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool, block: int,
                   pow2: bool, eps: float, name: str) -> Copies:
    """1x``block`` tiles: rowwise ``([M, K], [M, K/b])``, columnwise ``([K, M], [K, M/b])``."""
    ok = _block_kernel_ok(x, columnwise, block, pow2, eps)
    return _run(_blocks_1d_ref, x, dtype, rowwise, columnwise, block, pow2, eps, name, triton_ok=ok,
                triton_call=lambda: _triton().cast_tiles(x, dtype, "1x128", rowwise, columnwise),
                check=lambda: check_1d(tuple(x.shape), rowwise, columnwise, block, name))


def cast_blocks_2d(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool, block: int,
                   pow2: bool, eps: float, name: str) -> Copies:
    """``block``x``block`` tiles; the columnwise copy is the rowwise one transposed."""
    ok = _block_kernel_ok(x, columnwise, block, pow2, eps)

    def tri() -> Copies:
        row, col = _triton().cast_tiles(x, dtype, "128x128", True, columnwise)
        return (row if rowwise else None), col

    return _run(_blocks_2d_ref, x, dtype, rowwise, columnwise, block, pow2, eps, name, triton_ok=ok,
                triton_call=tri, check=lambda: ref.check_block_shape_2d(tuple(x.shape), block, name))


def cast_mx(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool, block: int,
            name: str) -> Copies:
    """MXFP8 1x``block`` tiles with E8M0 exponents. No fused kernel: SM90 emulates MXFP8 GEMMs
    (an FP32 matmul dwarfs the cast), so ``auto`` runs the eager reference here."""
    compile_forced = cast_backend() == "compile"
    return _run(_mx_ref, x, dtype, rowwise, columnwise, block, name, triton_ok=False,
                check=lambda: check_1d(tuple(x.shape), rowwise, columnwise, block, name), compile_ok=compile_forced)
