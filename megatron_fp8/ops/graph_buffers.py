"""The per-layer CUDA graphs' buffers (``ops.graphed``, ``MEGATRON_FP8_GRAPHS=1``): the static
inputs that graphs of one signature share, and what the live graphs keep allocated between
steps, counted from the allocator and said (once per process, and by the Megatron plug-in's
line, ``held_note``).

A graph here is an ``ops.graphed.LinearGraph``; this module reads its buffers (``x_s``,
``dy_s``, ``y_s``, ``w_s``, ``x_shared``, ``dy_shared``) and its ``owner``, ``held``,
``reserved``."""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from typing import Any

import torch

ENV = "MEGATRON_FP8_GRAPHS"


class SharedInput:
    """A static input buffer (x's or dy's) that every graph of one signature on a device replays
    from: a graph reads its static x only in its forward's replay (where nothing saves x for
    backward) and its static dy only in its backward's, so one buffer serves them all, replayed
    one after another (16 dense-1b linears held 448 MiB of static x and 768 MiB of static dy, a
    buffer each, run AW). The stream that last wrote it: a replay on another stream first waits
    for that one's work (two streams in turn, e.g. an overlapped shared expert, never overlap
    on the buffer)."""

    __slots__ = ("buffer", "stream", "writer", "__weakref__")

    def __init__(self, like: torch.Tensor) -> None:
        self.buffer = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)
        self.stream: int | None = None  # the raw CUDA stream of the last copy in (compared per replay)
        self.writer: torch.cuda.Stream | None = None  # that stream (waited for on a change)

    def view(self, like: torch.Tensor) -> torch.Tensor:
        """A leaf of the graph's own on the buffer, needing a gradient where ``like`` does (a
        static x, whose gradient the capture takes)."""
        return self.buffer.detach().requires_grad_(like.requires_grad)


_shared: weakref.WeakValueDictionary[tuple[Any, ...], SharedInput] = weakref.WeakValueDictionary()


def shared_input(role: str, like: torch.Tensor) -> SharedInput:
    """The live graphs' shared buffer for ``role`` ("x", "dy") and ``like``'s signature, made at
    its first use (freed with the last graph that holds it)."""
    key = (role, like.shape, like.stride(), like.dtype, like.device)
    got = _shared.get(key)
    if got is None:
        got = _shared[key] = SharedInput(like)
    return got


def take(sh: SharedInput, device: torch.device) -> None:
    """Before a replay's copy into ``sh``: where another stream wrote it last, the current stream
    waits for the work queued there (one check of the raw stream a replay)."""
    raw = torch._C._cuda_getCurrentRawStream(device.index)
    if sh.stream != raw:
        current = torch.cuda.current_stream(device)
        if sh.writer is not None:
            current.wait_stream(sh.writer)
        sh.stream, sh.writer = raw, current


def held_bytes(g: Any, pool: Any, device: torch.device) -> int | None:
    """What ``g`` keeps allocated between calls: the live blocks of its private pool (its static
    output and gradients, what its backward reads) and, made outside the pool, its FP8 weight copy
    and its static input and output gradient where it does not share them (``SharedInput``:
    counted once, by ``shared_by_graphs``). (Not ``memory_allocated`` before and after the capture:
    blocks freed across streams stay counted until the allocator next looks at their events, so
    that difference moved by up to 1.2 GB between processes of one probe, run AW.) None where
    the snapshot shows no segment of ``pool`` holding the static output."""
    segments = [seg for seg in _pool_snapshot(pool)
                if seg.get("device") == device.index and tuple(seg.get("segment_pool_id", ())) == tuple(pool)]
    assert g.y_s is not None
    y = g.y_s.untyped_storage().data_ptr()
    if not any(seg["address"] <= y < seg["address"] + seg["total_size"] for seg in segments):
        return None  # the pool not found as expected: the caller falls back to its own count
    in_pool = sum(b["size"] for seg in segments for b in seg["blocks"] if b["state"] == "active_allocated")
    own = (g.x_s if g.x_shared is None else None, g.dy_s if g.dy_shared is None else None,
           *(g.w_s.tensors() if g.w_s is not None else ()))
    outside = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in own if t is not None}
    return in_pool + sum(outside.values())


def _pool_snapshot(pool: Any) -> list[dict[str, Any]]:
    """The allocator's segments, as lean as this torch reads them: only ``pool``'s where
    ``memory_snapshot`` takes ``mempool_id`` (torch >= 2.6), without the allocation history's
    trace entries where it takes ``include_traces`` (newer); every segment otherwise. A capture
    takes one, so a model's start-up does not pay a whole-allocator snapshot per linear."""
    takes = _snapshot_takes()
    kwargs: dict[str, Any] = {}
    if "mempool_id" in takes:
        kwargs["mempool_id"] = tuple(pool)
    if "include_traces" in takes:
        kwargs["include_traces"] = False
    return torch.cuda.memory_snapshot(**kwargs)


@functools.cache
def _snapshot_takes() -> frozenset[str]:
    """The arguments this torch's ``memory_snapshot`` takes (read once)."""
    return frozenset(inspect.signature(torch.cuda.memory_snapshot).parameters)


_said_approximate: list[bool] = []  # the fallback count was said (once per process)


def count_held(g: Any, pool: Any, device: torch.device, allocated_before: int) -> int:
    """``held_bytes``, or where the snapshot does not show the pool as expected, the rise of
    ``memory_allocated`` over the capture (approximate, warned once per process)."""
    held = held_bytes(g, pool, device)
    if held is not None:
        return held
    if not _said_approximate:
        _said_approximate.append(True)
        warnings.warn(f"megatron_fp8: {g.owner}: the allocator's snapshot showed no segment of its graph's memory "
                      "pool holding the graph's output, so what graphs hold is counted as memory_allocated's rise "
                      "over each capture (approximate; said once per process)", RuntimeWarning, stacklevel=8)
    return torch.cuda.memory_allocated(device) - allocated_before


_live: weakref.WeakSet[Any] = weakref.WeakSet()  # every captured graph still alive


def note_held(g: Any) -> None:
    """Keep ``g`` for ``held_by_graphs``; say once per process that graphs hold memory."""
    first = not _live
    _live.add(g)
    if first:
        warnings.warn(f"megatron_fp8: {g.owner}: {ENV}=1: each FP8 linear's CUDA graphs keep their buffers "
                      f"allocated between steps (this one {g.held / 2**20:,.1f} MiB: static output and gradients, "
                      "saved tensors, a copy of its FP8 weight, besides static inputs graphs share), where the "
                      "eager path frees them after backward; megatron_fp8.ops.graph_buffers.held_by_graphs() "
                      "lists them (said once per process)",
                      RuntimeWarning, stacklevel=8)


def held_by_graphs() -> list[tuple[str, int]]:
    """``(layer, bytes)`` for every live per-layer graph, most first: what each keeps allocated
    (``LinearGraph.held``: its pool's live blocks and its own static buffers), until the layer is
    freed. The static inputs the graphs share are ``shared_by_graphs()``."""
    return sorted(((g.owner, g.held) for g in list(_live)), key=lambda t: -t[1])


def shared_by_graphs() -> int:
    """Bytes of the static input buffers the live graphs share (``SharedInput``), each once."""
    return sum(sh.buffer.untyped_storage().nbytes() for sh in list(_shared.values()))


def held_note(most: int = 3) -> str | None:
    """One line on what the live graphs hold (the Megatron plug-in prints it after the first
    forward), or None where there are none."""
    held = held_by_graphs()
    if not held:
        return None
    shared = shared_by_graphs()
    total = sum(b for _, b in held) + shared
    layers = len({owner for owner, _ in held})
    pairs = f" ({len(held)} graph pairs: one per input signature)" if len(held) != layers else ""
    top = ", ".join(f"{owner} {b / 2**20:,.0f}" for owner, b in held[:most])
    reserved = sum(g.reserved for g in list(_live))
    return (f"megatron_fp8: {ENV}=1: the CUDA graphs of {layers} FP8 linears{pairs} hold {total / 2**20:,.0f} MiB "
            f"between steps (the most, MiB: {top}; their shared static inputs {shared / 2**20:,.0f}; the allocator "
            f"reserved {reserved / 2**20:,.0f} MiB more over their captures); {ENV}=0 runs them eagerly without it")
