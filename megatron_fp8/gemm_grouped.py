"""Grouped (MoE expert) GEMMs on the core's ``gemm``: ``cat_i(a_i @ b_i.T)`` over the experts.

``grouped_gemm_cat`` (fprop, dgrad: outputs stacked along the tokens) and ``grouped_wgrad``
(contracted over each expert's tokens) take one launch where the operands allow it, else one
``gemm`` per expert (``MEGATRON_FP8_GROUPED_GEMM=auto|triton|torch|loop`` pins a path):

- Triton (``triton_grouped``): eager CUDA steps, each operand's experts in one buffer (as the
  one-launch casts leave them), every split a multiple of 128;
- ``torch._scaled_grouped_mm``: SM90, per-tensor E4M3 operands back to back, BF16 output
  (fprop and dgrad only);
- one ``gemm`` per expert: otherwise, and while a CUDA graph is captured (``auto``).

``back_to_back`` and the layout checks here decide whether the experts' operands lie where a
one-launch kernel reads them; ``split_rows`` cuts a rowwise operand into the experts' rows.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .gemm import Backend, forced_backend, gemm, record
from .quant.formats import ScaleLayout
from .quant.tensor import Operand, Operands, Pack

__all__ = ["grouped_gemm", "grouped_gemm_cat", "grouped_wgrad", "back_to_back", "split_rows"]

L = ScaleLayout


def grouped_gemm(
    a: Sequence[Operand],
    b: Sequence[Operand],
    out_dtype: torch.dtype,
    *,
    name: str = "grouped_gemm",
    fast_accum: bool = False,
) -> list[torch.Tensor]:
    """One ``gemm`` per expert: ``[a_i @ b_i.T]``. Problems of size zero give empty (or zero)
    outputs: an expert with no tokens has an empty fprop output and an all-zero wgrad."""
    if len(a) != len(b):
        raise ValueError(f"{name}: {len(a)} a-operands but {len(b)} b-operands")
    return [gemm(ai, bi, out_dtype, name=f"{name}[{i}]", fast_accum=fast_accum)
            for i, (ai, bi) in enumerate(zip(a, b))]


def _address(t: torch.Tensor) -> int:
    """Where ``t`` starts in memory, also for an empty view (whose ``data_ptr()`` is 0)."""
    return t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()


def _inside_first(t0: torch.Tensor, end: int) -> bool:
    """Whether memory up to address ``end`` lies in ``t0``'s storage: adjacent tensors of two
    allocations (the CUDA caching allocator places same-size blocks side by side) must not pass
    for one buffer, since callers view them all through ``t0``'s storage."""
    store = t0.untyped_storage()
    return end <= store.data_ptr() + store.nbytes()


def back_to_back(datas: Sequence[torch.Tensor]) -> bool:
    """Whether contiguous tensors lie one after another in the first one's storage (no gaps, in
    order). An empty tensor after the first is never read: only its dtype counts. (The walk of
    ``_strided_from`` with contiguity and dtype checks, in one loop: it runs several times per
    grouped step, per expert, and calling through ``_strided_from`` cost ~350 more Python calls
    per step.)"""
    d0 = datas[0]
    size = d0.element_size()
    ptr = _address(d0)
    for d in datas:
        n = d.numel()
        if d.dtype != d0.dtype or (n and (d.data_ptr() != ptr or not d.is_contiguous())):
            return False
        ptr += n * size
    return _inside_first(d0, ptr)


def packed(ws: Sequence[torch.Tensor]) -> bool:
    """Whether equally shaped 2-D tensors (the experts' weights) lie back to back in one buffer
    (``GroupedLinear.pack_weights``), so ``stacked(ws[0], len(ws))`` views them all."""
    w0 = ws[0]
    return all(w.shape == w0.shape for w in ws) and back_to_back(ws)


def stacked(w0: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` tensors shaped as ``w0`` that lie back to back from it (``packed``), as one
    detached ``[count, *w0.shape]`` view."""
    n, k = w0.shape
    return w0.detach().as_strided((count, n, k), (n * k, k, 1))


def _ones(g: int, n: int, device: torch.device) -> torch.Tensor:
    """``[g, n]`` FP32 ones, kept per shape; made fresh while a CUDA graph is captured (a tensor
    made there is only written when the graph replays, so it must not be handed to others)."""
    from .quant.kernels import capturing

    if capturing(device):
        return torch.ones((g, n), dtype=torch.float32, device=device)
    return _kept_ones(g, n, device)


@functools.cache
def _kept_ones(g: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.ones((g, n), dtype=torch.float32, device=device)


def _grouped_native(a: Sequence[Operand], b: Sequence[Operand], out_dtype: torch.dtype, fast_accum: bool,
                    name: str) -> torch.Tensor | None:
    """``cat_i(a_i @ b_i.T)`` as one ``torch._scaled_grouped_mm`` (SM90, rowwise scaling), or
    None where it does not apply: per-tensor E4M3 operands of every expert back to back in one
    buffer each (the one-launch expert casts), dims multiples of 16, BF16 output. Each expert's
    per-tensor scales become one row scale ``1/s_a * 1/s_b`` for its rows (and ones for the
    columns). A different kernel from the per-expert cuBLAS GEMMs: on the H200 (torch 2.11) its
    outputs matched theirs bit for bit (tests/test_grouped_gpu.py, scripts/probe_grouped_mm.py),
    which the two libraries do not promise; the CPU path is per expert and bitwise by design."""
    a0, b0 = a[0], b[0]
    dev = a0.data.device
    if not (len(a) > 1 and dev.type == "cuda" and out_dtype == torch.bfloat16 and _grouped_ok(dev)
            and a0.layout is L.TENSOR and b0.layout is L.TENSOR
            and a0.data.dtype == b0.data.dtype == torch.float8_e4m3fn):
        return None
    (_, k), (n, _) = a0.shape, b0.shape
    splits = _sizes(a, 0)
    if any(s % 16 for s in splits) or n % 16 or k % 16 or not _same_shapes(b):
        return None
    if forced_backend() is Backend.EMULATE:
        return None
    packs = [Pack.of(ops) for ops in (a, b)]
    if not all(p is not None or back_to_back([o.data for o in ops]) for p, ops in zip(packs, (a, b))):
        return None
    from .quant.kernels import segment_offsets

    m, g = sum(splits), len(a)
    a_all = a0.data.as_strided((m, k), (k, 1))
    b_all = b0.data.as_strided((g, n, k), (n * k, k, 1))
    scale = _scales_of(a, packs[0]) * _scales_of(b, packs[1])
    off = segment_offsets(splits, dev)
    row_scale = torch.repeat_interleave(scale, off.diff(), output_size=m)
    record(f"{name}[grouped]", Backend.NATIVE, (a0.layout, b0.layout), (m, n, k))
    return torch._scaled_grouped_mm(a_all, b_all.transpose(-2, -1), row_scale, _ones(g, n, dev),
                                    offs=off[1:].to(torch.int32), out_dtype=torch.bfloat16,
                                    use_fast_accum=fast_accum)


def _scales_of(ops: Sequence[Operand], pack: Pack | None) -> torch.Tensor:
    """The experts' per-tensor scales as one ``[E]`` tensor (a pack's own buffer, else stacked)."""
    return pack.scale_inv if pack is not None else torch.stack([o.scale_inv.reshape(()) for o in ops])


@functools.cache
def _grouped_ok(device: torch.device) -> bool:
    """torch has a rowwise FP8 grouped GEMM for this device (SM90)."""
    return hasattr(torch, "_scaled_grouped_mm") and torch.cuda.get_device_capability(device)[0] == 9


def _grouped_backend(device: torch.device) -> str:
    """The grouped-GEMM path ``MEGATRON_FP8_GROUPED_GEMM`` asks for, with ``auto`` resolved to
    ``loop`` while a CUDA graph is being captured on the current stream (of the current device,
    where a step that captures ``device``'s layers runs).

    Why: the one-launch kernels exist for the host (eager MoE steps are launch-bound), and a
    graph replays without the host, so there the GPU's rate decides, and cuBLAS per expert is
    faster than our Triton grouped kernels (H200, 2026-12-02, 8 x 2048 tokens, whole graphed
    fwd+bwd step: current scaling 1.13 vs 1.26 ms at K=4096/N=2048 and 1.79 vs 2.20 ms at
    K=2048/N=7168; blocks 1.24 vs 1.49 and 2.03 vs 2.62 ms). Per-expert cuBLAS is also bitwise a
    list of separate ``Linear``s; a graphed step's numbers therefore equal an eager step's under
    ``loop``, not under ``auto`` (set ``triton`` or ``loop`` to pin one path in both; the experts'
    padding is 128 rows on CUDA either way, ``ops.grouped_linear.layout_rows``)."""
    v = os.environ.get("MEGATRON_FP8_GROUPED_GEMM", "auto").lower()
    if v not in ("auto", "torch", "triton", "loop"):
        raise ValueError(f"MEGATRON_FP8_GROUPED_GEMM={v!r}; allowed: 'auto', 'torch', 'triton', 'loop'")
    if v == "auto" and device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return "loop"
        _cublas_ready(device)
    return v


_cublas_threads: set[tuple[int, torch.device]] = set()


def _cublas_ready(device: torch.device) -> None:
    """Create this thread's cuBLAS handle for ``device`` now, in an eager step: ``auto`` runs
    no cuBLAS GEMM in eager grouped steps, and a graph captured later does (per expert), where
    cuBLAS cannot create its handle (``cublasCreate`` fails inside a capture). Handles are per
    thread: the forward's and the autograd engine's backward thread each get theirs here, in the
    warm-up steps a capture needs anyway."""
    key = (threading.get_ident(), device)
    if key not in _cublas_threads:
        with torch.cuda.device(device):
            torch.cuda.current_blas_handle()
        _cublas_threads.add(key)


def _triton_grouped_here(dev: torch.device) -> bool:
    if forced_backend() is Backend.EMULATE:
        return False
    if not (dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    try:
        from .kernels import triton_grouped  # noqa: F401
    except ImportError:
        return False
    return True


def _strided_from(ts: Sequence[torch.Tensor], steps: Sequence[int]) -> bool:
    """Whether ``ts[i]`` starts ``steps[i]`` elements after ``ts[0]`` in memory (an empty
    expert's scales are never read: not checked)."""
    t0 = ts[0]
    ptr, size = _address(t0), t0.element_size()
    end = ptr
    for t, st in zip(ts, steps):
        n = t.numel()
        if n:
            if t.data_ptr() != ptr + st * size:
                return False
            end = max(end, t.data_ptr() + n * size)
    return _inside_first(t0, end)


def _base(t: torch.Tensor) -> torch.Tensor:
    """A 1-element view where ``t`` starts in its storage (an empty view's ``data_ptr`` is not its
    place in the buffer): the pointer a grouped kernel indexes every expert from."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), (1,))


def _scales_laid_out(ops: Sequence[Operand], starts: Sequence[int], kind: str, width: int) -> bool:
    """Per-expert scales where the Triton grouped kernels look for them (``triton_grouped``):
    tensor: 16 bytes apart; ``rows`` 1x128: ``[K/128, m_e]`` per segment at ``start * K/128``;
    ``weights`` 128x128: ``[N/128, K/128]`` per expert back to back; ``tokens`` 1x128 along
    tokens: ``[m_e/128, width]`` at ``start / 128 * width``."""
    scales = [o.scale_inv for o in ops]
    if ops[0].layout is L.TENSOR:
        return _strided_from(scales, [4 * i for i in range(len(ops))])
    if kind == "rows":
        return _strided_from(scales, [st * width for st in starts])
    if kind == "weights":
        return _strided_from(scales, [i * scales[0].numel() for i in range(len(ops))]) and all(
            s.is_contiguous() for s in scales)
    return _strided_from(scales, [st // 128 * width for st in starts])


def _pack_serves(p: Pack, kind: str) -> bool:
    """Whether a segmented cast's buffers are laid out as ``_scales_laid_out`` wants for
    ``kind`` (the data of a pack always lies back to back)."""
    if p.layout is L.TENSOR:
        return True
    if p.layout is L.BLOCK_1x128:
        return p.columnwise == (kind == "tokens") and kind != "weights"
    return kind == "weights" and p.layout is L.BLOCK_128x128 and len(set(p.splits)) == 1


def _one_buffer(ops: Sequence[Operand], splits: Sequence[int], starts: Sequence[int], kind: str,
                width: int) -> tuple[bool, Pack | None]:
    """Whether the experts' data lie back to back in one buffer and their scales where the
    Triton grouped kernels look (``_scales_laid_out``, experts of ``splits`` tokens from
    ``starts``), and the ``Pack`` they are where they are the Operands of one segmented cast
    (answered at once; else checked expert by expert)."""
    p = Pack.of(ops)
    if p is not None and _pack_serves(p, kind) and (kind == "weights" or p.splits == tuple(splits)):
        return True, p
    return back_to_back([o.data for o in ops]) and _scales_laid_out(ops, starts, kind, width), None


def _buffers(ops: Sequence[Operand], pack: Pack | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The data and scale buffers a grouped kernel indexes every expert from: a pack's own, else
    views from where the first expert's lie (``_base``)."""
    if pack is not None:
        return pack.data, pack.scale_inv
    op0 = ops[0]
    return _base(op0.data), _base(op0.scale_inv)


def _sizes(ops: Sequence[Operand], dim: int) -> list[int]:
    """Each expert's size along ``dim`` (tokens: dim 0 of rowwise copies, dim 1 of columnwise
    ones), from the pack where ``ops`` are its lazy ``Operands`` (no per-expert views made)."""
    if isinstance(ops, Operands) and ops.pack.columnwise == (dim == 1):
        return list(ops.pack.splits)
    return [o.shape[dim] for o in ops]


def _same_shapes(ops: Sequence[Operand]) -> bool:
    if isinstance(ops, Operands):
        return len(set(ops.pack.splits)) == 1
    s0 = ops[0].shape
    return all(o.shape == s0 for o in ops)


class _First(NamedTuple):
    """What a grouped GEMM reads of its operands' first expert: shape, layout and device."""

    shape: tuple[int, int]
    layout: ScaleLayout
    device: torch.device


def _first(ops: Sequence[Operand]) -> _First:
    """``_First`` of ``ops[0]``; from the pack where ``ops`` are its lazy ``Operands`` (indexing
    them would make the expert's views: ~10 us of host time per operand in a grouped step)."""
    if isinstance(ops, Operands):
        p = ops.pack
        m = p.splits[0]
        return _First((p.width, m) if p.columnwise else (m, p.width), p.layout, p.data.device)
    op = ops[0]
    return _First((op.shape[0], op.shape[1]), op.layout, op.data.device)


def _triton_grouped_starts(a: Sequence[Operand], b: Sequence[Operand], a0: _First, b0: _First,
                           out_dtype: torch.dtype, splits: Sequence[int], blocked: bool, kinds: tuple[str, str],
                           widths: tuple[int, int]) -> tuple[list[int], Pack | None, Pack | None] | None:
    """The experts' first rows (tokens) where a one-launch Triton grouped GEMM may take the
    operands (``a0``, ``b0``: their first experts): more than one expert, the path allowed and
    Triton here, an output dtype it writes, tensorwise operands or the block pair the caller
    checked, every split a multiple of 128 and each operand's experts in one buffer, laid out as
    ``kinds`` (``_one_buffer``), with their packs (None: not one). None otherwise."""
    dev = a0.device
    if not (len(a) > 1 and _grouped_backend(dev) in ("auto", "triton") and _triton_grouped_here(dev)
            and out_dtype in (torch.bfloat16, torch.float16, torch.float32)
            and (blocked or a0.layout is b0.layout is L.TENSOR) and not any(s % 128 for s in splits)):
        return None
    starts = list(itertools.accumulate(splits[:-1], initial=0))
    ok_a, pa = _one_buffer(a, splits, starts, kinds[0], widths[0])
    ok_b, pb = _one_buffer(b, splits, starts, kinds[1], widths[1]) if ok_a else (False, None)
    return (starts, pa, pb) if ok_b else None


def _grouped_triton_rows(a: Sequence[Operand], b: Sequence[Operand], out_dtype: torch.dtype, fast_accum: bool,
                         name: str, keep: Sequence[int] | None = None) -> torch.Tensor | None:
    """``cat_i(a_i @ b_i.T)`` in one Triton launch (``triton_grouped.grouped_rows``) where the
    operands are laid out for it (``_triton_grouped_starts``; every expert's weight the same shape;
    tensorwise, any FP8 pair, or 1x128 x 128x128 scales). None otherwise."""
    a0, b0 = _first(a), _first(b)
    (_, k), (n, _) = a0.shape, b0.shape
    splits = _sizes(a, 0)
    blocked = a0.layout is L.BLOCK_1x128 and b0.layout is L.BLOCK_128x128
    if not _same_shapes(b) or (blocked and (n % 128 or k % 128)):
        return None
    got = _triton_grouped_starts(a, b, a0, b0, out_dtype, splits, blocked, ("rows", "weights"), (k // 128, 0))
    if got is None:
        return None
    from .kernels import triton_grouped
    from .quant.kernels import segment_offsets

    m, g = sum(splits), len(a)
    record(f"{name}[triton]", Backend.NATIVE, (a0.layout, b0.layout), (m, n, k))
    (a_buf, sa), (b_buf, sb) = _buffers(a, got[1]), _buffers(b, got[2])
    a_all = a_buf if a_buf.shape == (m, k) else a_buf.as_strided((m, k), (k, 1))
    b_all = b_buf.as_strided((g, n, k), (n * k, k, 1))
    kept = (segment_offsets(keep, a0.device), sum(keep)) if keep is not None else None
    return triton_grouped.grouped_rows(a_all, b_all, sa, sb, segment_offsets(splits, a0.device), out_dtype,
                                       blocked=blocked, fast_accum=fast_accum, keep=kept)


def grouped_wgrad(
    a: Sequence[Operand],
    b: Sequence[Operand],
    out_dtype: torch.dtype,
    *,
    name: str = "wgrad",
) -> list[torch.Tensor]:
    """``[a_i @ b_i.T]`` for wgrad operands (``a_i [N, m_i]``, ``b_i [K, m_i]``, contracted over
    each expert's tokens): one Triton launch (``triton_grouped.grouped_kgroup``) where they are
    laid out for it, else ``grouped_gemm``."""
    a0, b0 = _first(a), _first(b)
    (n, _), (k, _) = a0.shape, b0.shape
    splits = _sizes(a, 1)
    blocked = a0.layout is b0.layout is L.BLOCK_1x128
    got = _triton_grouped_starts(a, b, a0, b0, out_dtype, splits, blocked, ("tokens", "tokens"), (n, k))
    if got is None:
        return grouped_gemm(a, b, out_dtype, name=name)
    from .kernels import triton_grouped
    from .quant.kernels import segment_offsets

    record(f"{name}[triton]", Backend.NATIVE, (a0.layout, b0.layout), (n, k, sum(splits)))
    (a_buf, sa), (b_buf, sb) = _buffers(a, got[1]), _buffers(b, got[2])
    out = triton_grouped.grouped_kgroup(a_buf, b_buf, sa, sb, segment_offsets(splits, a0.device), n, k,
                                        out_dtype, blocked=blocked)
    return list(out.unbind(0))


def grouped_gemm_cat(
    a: Sequence[Operand],
    b: Sequence[Operand],
    out_dtype: torch.dtype,
    *,
    name: str = "grouped_gemm",
    fast_accum: bool = False,
    keep: Sequence[int] | None = None,
) -> torch.Tensor:
    """``cat_i(a_i @ b_i.T)``, ``[sum m_i, n]``: one launch where the operands allow it, else one
    ``gemm`` per expert into its rows of the output. ``MEGATRON_FP8_GROUPED_GEMM`` picks the one-launch
    kernel: ``auto``/``triton`` try ours first (``triton_grouped``: one launch, no set-up
    kernels; measured 2026-12-02 on an H200, a current-scaling grouped step took 2.99 ms with it
    and 3.63 ms with ``torch._scaled_grouped_mm`` first, whose scale set-up costs ~10 small
    launches), then torch's; ``torch`` uses torch's only (bitwise equal to the per-expert cuBLAS
    GEMMs); ``loop`` one ``scaled_mm`` per expert, each writing its rows of the output (no
    concatenation: measured 2026-12-02 on an H200, the ``torch.cat`` it replaced took 31-112 us of
    a ~1.1-1.9 ms graphed step), which is also what ``auto`` does while a CUDA graph is captured
    (``_grouped_backend``).

    ``keep``: the experts' real row counts where their rows were zero-padded for the GEMMs
    (``keep[i] <= m_i``): the output is ``[sum keep, n]``, each expert's first ``keep[i]`` rows
    (the padding dropped by the GEMMs themselves, ``_cat_kept``)."""
    if keep is not None and list(keep) == _sizes(a, 0):
        keep = None
    out = _grouped_triton_rows(a, b, out_dtype, fast_accum, name, keep)
    if out is not None:
        return out
    if _grouped_backend(a[0].data.device) in ("auto", "torch"):
        out = _grouped_native(a, b, out_dtype, fast_accum, name)
        if out is not None:
            return out if keep is None else _drop_padding(out, _sizes(a, 0), keep)
    if len(a) != len(b):
        raise ValueError(f"{name}: {len(a)} a-operands but {len(b)} b-operands")
    return _cat_kept(a, b, out_dtype, fast_accum, name, keep)


def _drop_padding(y: torch.Tensor, splits: Sequence[int], keep: Sequence[int]) -> torch.Tensor:
    """Each expert's first ``keep[i]`` rows of ``y`` (its rows ``splits[i]``), in one copy."""
    starts = itertools.accumulate(splits, initial=0)
    return torch.cat([y[s:s + k] for s, k in zip(starts, keep)])


def _cat_kept(a: Sequence[Operand], b: Sequence[Operand], out_dtype: torch.dtype, fast_accum: bool, name: str,
              keep: Sequence[int] | None) -> torch.Tensor:
    """One ``gemm`` per expert, each writing its rows of the output in place. With ``keep`` an
    expert's GEMM still computes its padded rows, but writes them at its real rows' start: its
    padding overwrites the first rows of the experts after it, which their own GEMMs, later on the
    same stream, then write. An expert whose padded rows would run past the output's end writes
    into a buffer of its own and copies its real rows over (at most the last few experts; no
    gather of the whole output, as dropping the padding afterwards costs: 46 us for y and 96 us for
    dx of a graphed router step, H100, docs/benchmarks.md run AI)."""
    sizes = _sizes(a, 0)
    kept = sizes if keep is None else list(keep)
    total = sum(kept)
    y = torch.empty(total, b[0].shape[0], dtype=out_dtype, device=a[0].data.device)
    row = 0
    for i, (ai, bi, m, k) in enumerate(zip(a, b, sizes, kept)):
        if row + m <= total:
            gemm(ai, bi, out_dtype, name=f"{name}[{i}]", fast_accum=fast_accum, out=y[row:row + m])
        elif k:
            y[row:row + k] = gemm(ai, bi, out_dtype, name=f"{name}[{i}]", fast_accum=fast_accum)[:k]
        row += k
    return y


def split_rows(op: Operand, splits: Sequence[int]) -> list[Operand]:
    """Split a rowwise operand ``[m, k]`` into row groups (per-expert tokens).

    Valid for layouts whose scales do not span rows: TENSOR, ROW, BLOCK_1x128, MX_1x32.
    """
    if op.layout is L.BLOCK_128x128:
        raise ValueError("split_rows: 128x128-block operands cannot be split by rows")
    if sum(splits) != op.shape[0]:
        raise ValueError(f"split_rows: splits {list(splits)} sum to {sum(splits)}, not {op.shape[0]} rows")
    datas = op.data.split(list(splits))
    if op.layout is L.TENSOR:
        return [Operand(d, op.scale_inv, op.layout) for d in datas]
    scales = op.scale_inv.split(list(splits))
    return [Operand(d, s, op.layout) for d, s in zip(datas, scales)]
