"""Per-tensor amaxes and scales on the GPU (Triton, CUDA only), without a round trip through
small eager kernels: the amax partials the casts of ``triton_cast`` reduce, the per-segment
(expert) amax and scale, one delayed-scaling step for every expert, and scales from given
amaxes.

``_row_amax_kernel`` reduces ``|x|`` per row (and K slice) as integer bit patterns (for
non-negative floats the integer order is the float order, and a NaN sorts above inf, so a NaN
amax propagates as in ``torch.max``); ``_segment_scale_kernel`` reduces those per segment and
turns the amax into ``(scale, 1/scale)`` in FP64, exactly as ``reference.amax_to_scale`` and
``torch.reciprocal`` do (a correctly rounded FP64 result rounded to FP32 is the correctly
rounded FP32 result for a division). Scales of several segments lie 16 bytes apart
(``SCALE_STRIDE``: cuBLAS rejects unaligned scale pointers). ``_amax_fold_kernel`` is delayed
scaling's amax and history fold in one launch: its programs meet in two atomic words, and the
last one folds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.formats import fp8_max
from ..quant.tensor import SCALE_STRIDE as STRIDE
from ..quant.tensor import aligned_scalars
from .triton_launch import Launcher, Prepared, cdiv

SCALE_STRIDE = tl.constexpr(STRIDE)  # per-segment scales 16 bytes apart: cuBLAS rejects unaligned scale pointers


@triton.jit
def _tensor_scale(amax, FMAX: tl.constexpr, EPS: tl.constexpr, MARGIN_DIV: tl.constexpr,
                  POW2: tl.constexpr):
    """``reference.amax_to_scale`` and ``torch.reciprocal`` of its result: FP64 division,
    rounded once to FP32."""
    a = amax.to(tl.float64)
    if EPS > 0:
        a = tl.where(a < EPS, EPS, a)  # a NaN stays NaN (and then gives scale 1)
    good = (a > 0) & (a < float("inf"))
    safe = tl.where(good, a, 1.0)
    s = (tl.zeros_like(safe) + FMAX) / safe  # FP64 division: IEEE round-to-nearest (div.rn.f64)
    if MARGIN_DIV != 1.0:
        s = s / MARGIN_DIV
    s = tl.minimum(s, tl.zeros_like(s) + 3.4028234663852886e38)
    s32 = tl.where(good, s, 1.0).to(tl.float32)
    if POW2:
        s32 = (s32.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    s64 = s32.to(tl.float64)
    inv = ((tl.zeros_like(s64) + 1.0) / s64).to(tl.float32)
    return s32, inv


@triton.jit
def _slice_amax_bits(x_ptr, offs_m, M, K, k0, k_per, R: tl.constexpr, BK: tl.constexpr):
    """``|x|`` of rows ``offs_m`` over columns ``k0 : k0 + k_per`` (a multiple of BK, so slices
    never overlap) as FP32 bit patterns, maxima per ``[R, BK]`` position."""
    acc = tl.zeros([R, BK], dtype=tl.int32)
    for kk in range(0, k_per, BK):
        offs_k = k0 + kk + tl.arange(0, BK)
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        v = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], mask=mask, other=0.0)
        acc = tl.maximum(acc, v.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    return acc


@triton.jit
def _row_amax_kernel(x_ptr, part_ptr, M, K, S, k_per, R: tl.constexpr, BK: tl.constexpr,
                     PER_PROGRAM: tl.constexpr):
    """``part[m, s]`` = max |x[m, k]| over K slice ``s``, as FP32 bit patterns; with
    ``PER_PROGRAM`` one value per program, ``part[m // R, s]`` (over its R rows)."""
    pid_r, pid_s = tl.program_id(0), tl.program_id(1)
    offs_m = pid_r * R + tl.arange(0, R)
    acc = _slice_amax_bits(x_ptr, offs_m, M, K, pid_s * k_per, k_per, R, BK)
    if PER_PROGRAM:
        tl.store(part_ptr + pid_r.to(tl.int64) * S + pid_s, tl.max(tl.max(acc, axis=1), axis=0))
    else:
        tl.store(part_ptr + offs_m.to(tl.int64) * S + pid_s, tl.max(acc, axis=1), mask=offs_m < M)


@triton.jit
def _amax_of_partials(part_ptr, lo, hi, B: tl.constexpr):
    """FP32 amax of the bit-pattern partials ``part[lo:hi]`` (0 for an empty range)."""
    acc = tl.zeros([B], dtype=tl.int32)
    for i in range(lo, hi, B):
        offs = i + tl.arange(0, B)
        acc = tl.maximum(acc, tl.load(part_ptr + offs, mask=offs < hi, other=0))
    return tl.max(acc, axis=0).to(tl.float32, bitcast=True)


@triton.jit
def _fold_into_history(amax, slot, L):
    """``tensor_scaling.fold_amax`` of one FP32 ``amax`` into ``slot[0]`` of an ``[L]`` history:
    the max with what the step's casts recorded; a non-finite amax records the previous step's
    (``slot[1]``), or nothing when ``L == 1``."""
    old = tl.load(slot)  # finite: a history holds finite amaxes only
    prev = tl.load(slot + 1, mask=L > 1, other=0.0)
    rec = tl.where(amax < float("inf"), amax, prev)  # an amax is >= 0 or NaN: NaN < inf is false
    tl.store(slot, tl.where(old > rec, old, rec))


@triton.jit
def _segment_scale_kernel(part_ptr, seg_ptr, M, S, amax_ptr, scale_ptr, inv_ptr, hist_ptr, L,
                          SEG: tl.constexpr, SCALE: tl.constexpr, FMAX: tl.constexpr, EPS: tl.constexpr,
                          MARGIN_DIV: tl.constexpr, POW2: tl.constexpr, HIST: tl.constexpr, B: tl.constexpr):
    """Per segment ``e``: amax over its rows' partials, then (if ``SCALE``) scale and 1/scale;
    with ``HIST`` the amax also joins ``hist[e, 0]`` (``tensor_scaling.fold_amax``: a non-finite
    amax records the previous step's, ``hist[e, 1]``, or nothing when ``L == 1``)."""
    e = tl.program_id(0)
    if SEG:
        lo = tl.load(seg_ptr + e) * S
        hi = tl.load(seg_ptr + e + 1) * S
    else:
        lo = 0
        hi = M * S
    amax = _amax_of_partials(part_ptr, lo, hi, B)
    tl.store(amax_ptr + e, amax)
    if HIST:
        _fold_into_history(amax, hist_ptr + e.to(tl.int64) * L, L)
    if SCALE:
        s, inv = _tensor_scale(amax, FMAX, EPS, MARGIN_DIV, POW2)
        tl.store(scale_ptr + e * SCALE_STRIDE, s)
        tl.store(inv_ptr + e * SCALE_STRIDE, inv)


@triton.jit
def _amax_fold_kernel(x_ptr, work_ptr, hist_ptr, M, K, k_per, L, R: tl.constexpr, BK: tl.constexpr):
    """``max |x|`` folded into ``hist[0]`` in one launch: every program's maximum (FP32 bits)
    joins ``work[0]`` atomically; the last program to finish (``work[1]`` counts them) folds it
    into the history and leaves ``work`` zeroed for the next launch."""
    pid_r, pid_s = tl.program_id(0), tl.program_id(1)
    offs_m = pid_r * R + tl.arange(0, R)
    acc = _slice_amax_bits(x_ptr, offs_m, M, K, pid_s * k_per, k_per, R, BK)
    tl.atomic_max(work_ptr, tl.max(tl.max(acc, axis=1), axis=0))
    done = tl.atomic_add(work_ptr + 1, 1)  # acquire-release: the last one sees every maximum
    if done == tl.num_programs(0) * tl.num_programs(1) - 1:
        bits = tl.atomic_xchg(work_ptr, 0)
        tl.atomic_xchg(work_ptr + 1, 0)
        _fold_into_history(bits.to(tl.float32, bitcast=True), hist_ptr, L)


@triton.jit
def _delayed_state_kernel(hist_ptr, scale_ptr, s_stride, new_hist_ptr, new_scale_ptr, new_inv_ptr, L,
                          FMAX: tl.constexpr, MARGIN_DIV: tl.constexpr, ALGO_MAX: tl.constexpr,
                          BL: tl.constexpr):
    """One delayed-scaling step of expert ``e``'s state (``DelayedScalingQuantizer._next_state``):
    the history's amax (its max, NaN if any is NaN; or its newest entry), the scale it gives
    where that amax is finite and positive (else the old scale), 1/scale, and the history rolled
    by one with a zero in front. Scales 16 bytes apart; histories ``[E, L]`` rows."""
    e = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BL)
    row = hist_ptr + e * L
    h = tl.load(row + offs, mask=offs < L, other=float("-inf"))
    if ALGO_MAX:
        amax = tl.max(h, axis=0)
        amax = tl.where(tl.sum((h != h).to(tl.int32), axis=0) > 0, float("nan"), amax)
    else:
        amax = tl.load(row)
    new_s, new_inv = _tensor_scale(amax, FMAX, 0.0, MARGIN_DIV, False)
    old = tl.load(scale_ptr + e * s_stride)
    old_inv = ((tl.zeros_like(old).to(tl.float64) + 1.0) / old.to(tl.float64)).to(tl.float32)
    usable = (amax > 0) & (amax < float("inf"))
    tl.store(new_scale_ptr + e * SCALE_STRIDE, tl.where(usable, new_s, old))
    tl.store(new_inv_ptr + e * SCALE_STRIDE, tl.where(usable, new_inv, old_inv))
    shifted = tl.load(row + offs - 1, mask=(offs >= 1) & (offs < L), other=0.0)
    tl.store(new_hist_ptr + e * L + offs, shifted, mask=offs < L)


@triton.jit
def _scale_from_amax_kernel(amax_ptr, scale_ptr, inv_ptr, n, FMAX: tl.constexpr, EPS: tl.constexpr,
                            MARGIN_DIV: tl.constexpr, POW2: tl.constexpr, B: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    amax = tl.load(amax_ptr + offs, mask=offs < n, other=0.0)
    s, inv = _tensor_scale(amax, FMAX, EPS, MARGIN_DIV, POW2)
    tl.store(scale_ptr + offs * SCALE_STRIDE, s, mask=offs < n)
    tl.store(inv_ptr + offs * SCALE_STRIDE, inv, mask=offs < n)


_ROW_AMAX, _SEGMENT_SCALE = Launcher(_row_amax_kernel), Launcher(_segment_scale_kernel)
_SCALE_FROM_AMAX, _DELAYED_STATE = Launcher(_scale_from_amax_kernel), Launcher(_delayed_state_kernel)
_AMAX_FOLD = Launcher(_amax_fold_kernel)
_R, _BK = 16, 256  # rows x columns per amax step
_MIN_PROGRAMS = 1024


def _amax_grid(m: int, k: int) -> tuple[int, int, int]:
    """``(row programs, K slices, columns per slice)`` of an amax pass over ``[m, k]``."""
    n_r = cdiv(m, _R)
    n_kc = cdiv(k, _BK)
    s = max(1, min(n_kc, _MIN_PROGRAMS // max(n_r, 1)))
    k_per = cdiv(n_kc, s) * _BK
    return n_r, (cdiv(k, k_per) if k else 1), k_per


def _amax_partials(x: torch.Tensor, per_program: bool) -> tuple[torch.Tensor, int]:
    """``(part, s)``: |x| maxima as FP32 bits per row (or per ``_R``-row program) and K slice."""
    m, k = x.shape
    n_r, s, k_per = _amax_grid(m, k)
    part = torch.empty(((n_r if per_program else m) * s,), dtype=torch.int32, device=x.device)
    if m and k:
        _ROW_AMAX((n_r, s), x, part, m, k, s, k_per, R=_R, BK=_BK, PER_PROGRAM=per_program, num_warps=4)
    elif m:
        part.zero_()
    return part, s


def amax_and_scale(
    x: torch.Tensor, fp8_dtype: torch.dtype, *, offsets: torch.Tensor | None = None, n_seg: int = 1,
    scale: bool = True, margin: int = 0, power_2_scale: bool = False, amax_epsilon: float = 0.0,
    history: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(amax [E], scale [E], 1/scale [E])`` of ``x [M, K]`` (or of each row segment): two
    launches. ``scale=False``: amax only (to be reduced over a group first). ``history``
    (``[E, L]``, contiguous): each amax also joins ``history[:, 0]`` as ``tensor_scaling.fold_amax`` does."""
    m, k = x.shape
    if history is not None and (history.dim() != 2 or history.shape[0] != n_seg or not history.is_contiguous()):
        raise ValueError(f"amax_and_scale: history {tuple(history.shape)} must be a contiguous [{n_seg}, L] stack")
    x = x.contiguous()
    part, s = _amax_partials(x, per_program=False)
    amax = torch.empty((n_seg,), dtype=torch.float32, device=x.device)
    sc = aligned_scalars(n_seg, x.device) if scale else None
    inv = aligned_scalars(n_seg, x.device) if scale else None
    _SEGMENT_SCALE((n_seg,),
        part, offsets if offsets is not None else part, m, s, amax, sc if sc is not None else amax,
        inv if inv is not None else amax, history if history is not None else amax,
        history.shape[-1] if history is not None else 1, SEG=offsets is not None, SCALE=scale,
        FMAX=fp8_max(fp8_dtype), EPS=float(amax_epsilon), MARGIN_DIV=float(2**margin), POW2=power_2_scale,
        HIST=history is not None, B=1024, num_warps=4,
    )
    return amax, sc, inv


def delayed_state_alone(history: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *, margin: int,
                        algo_max: bool, launch: Prepared | None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Prepared | None]:
    """One quantizer's ``delayed_state`` (``history [L]`` contiguous, ``scale []``, both 16-byte
    aligned) -> ``(scale [], 1/scale [], history [L], launch)``: new tensors, the same bits as the
    ``[1, L]`` call. ``launch``: the one an earlier call returned for this quantizer (its device,
    length and format), which takes the arguments without building a key; None: launched and
    prepared now (the result's ``launch``, None where launches are not the prepared kind)."""
    sc = torch.empty((), dtype=torch.float32, device=history.device)
    inv = torch.empty((), dtype=torch.float32, device=history.device)
    new_hist = torch.empty_like(history)
    if launch is not None:
        launch(history, scale, 1, new_hist, sc, inv)
        return sc, inv, new_hist, launch
    hist_len = history.shape[0]
    launch = _DELAYED_STATE.prepare((1,), 6, history, scale, 1, new_hist, sc, inv, hist_len,
                                    **_state_options(fp8_dtype, margin, algo_max, hist_len))
    return sc, inv, new_hist, launch


def prepared_fold(x: torch.Tensor, history: torch.Tensor, work: torch.Tensor) -> Prepared | None:
    """``fold_amax_into(x, history, work)`` now, and its launch for tensors like these (same
    shapes and dtypes, 16-byte aligned), called ``f(x, work, history)``; None where launches here
    are not the prepared kind (the caller then calls ``fold_amax_into``)."""
    grid, args = _fold_arguments(x, history, work)
    return _AMAX_FOLD.prepare(grid, 3, *args, R=_R, BK=_BK, num_warps=4)


def _fold_arguments(x: torch.Tensor, history: torch.Tensor, work: torch.Tensor
                    ) -> tuple[tuple[int, int], tuple[object, ...]]:
    """The grid and arguments of ``x``'s amax fold (``_amax_fold_kernel``), ``x``, ``work`` and
    ``history`` first (what a prepared launch takes anew)."""
    m, k = x.shape
    n_r, s, k_per = _amax_grid(m, k)
    return (n_r, s), (x, work, history, m, k, k_per, history.shape[0])


def fold_work(device: torch.device) -> torch.Tensor:
    """The two zeroed int32 words a ``fold_amax_into`` caller keeps for its launches."""
    return torch.zeros((2,), dtype=torch.int32, device=device)


def fold_amax_into(x: torch.Tensor, history: torch.Tensor, work: torch.Tensor) -> None:
    """``max |x|`` of ``x [M, K]`` (contiguous, not empty) folded into ``history[0]`` (a
    contiguous ``[L]`` FP32 history on ``x``'s device) as ``tensor_scaling.fold_amax`` folds it,
    in one launch that allocates nothing: the programs meet in ``work`` (``fold_work``), which
    each launch leaves zeroed. One ``work`` serves one caller's launches, one after another (a
    quantizer's casts, on one stream); never two launches at once."""
    grid, args = _fold_arguments(x, history, work)
    _AMAX_FOLD(grid, *args, R=_R, BK=_BK, num_warps=4)


def delayed_state(history: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *, margin: int,
                  algo_max: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every expert's delayed-scaling step in one launch: ``history [E, L]`` (contiguous) and
    the scales in force ``scale [E]`` (any stride) -> ``(scale [E], 1/scale [E], history [E, L])``,
    new tensors, scales 16 bytes apart."""
    e, hist_len = history.shape
    sc, inv = aligned_scalars(e, history.device), aligned_scalars(e, history.device)
    new_hist = torch.empty_like(history)
    _DELAYED_STATE((e,), history, scale, scale.stride(0), new_hist, sc, inv, hist_len,
                   **_state_options(fp8_dtype, margin, algo_max, hist_len))
    return sc, inv, new_hist


def _state_options(fp8_dtype: torch.dtype, margin: int, algo_max: bool, hist_len: int) -> dict[str, object]:
    """``_delayed_state_kernel``'s constexprs and warps, one set for the stacked and the lone step."""
    return dict(FMAX=fp8_max(fp8_dtype), MARGIN_DIV=float(2**margin), ALGO_MAX=algo_max,
                BL=triton.next_power_of_2(hist_len), num_warps=4)


def scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype, *, margin: int = 0, power_2_scale: bool = False,
                    amax_epsilon: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, 1/scale)`` of an FP32 amax tensor (any shape), one launch."""
    a = amax.contiguous().float()
    n = a.numel()
    sc, inv = aligned_scalars(n, a.device), aligned_scalars(n, a.device)
    _SCALE_FROM_AMAX((cdiv(max(n, 1), 256),),
        a, sc, inv, n, FMAX=fp8_max(fp8_dtype), EPS=float(amax_epsilon), MARGIN_DIV=float(2**margin),
        POW2=power_2_scale, B=256, num_warps=4,
    )
    return sc, inv
