"""Which path served each FP8 layer call, counted while ``count_paths()`` is open: ``"lean"`` (a
plan of ``ops.lean`` / ``ops.lean_grouped``) or ``"general"`` (``ops.linear._Linear`` /
``ops.grouped_linear._GroupedLinear``), per kind of layer (``"linear"``, ``"grouped"``). Proof
that a training loop took the lean eager path (``megatron.launch --count-gemms`` prints it);
nothing is counted, and next to nothing paid, while no count is open."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

__all__ = ["count_paths", "note"]

_open: list[collections.Counter[str]] = []


def note(path: str) -> None:
    """One FP8 forward served by ``path`` (e.g. ``"lean linear"``)."""
    for counts in _open:
        counts[path] += 1


@contextlib.contextmanager
def count_paths() -> Iterator[collections.Counter[str]]:
    """A Counter of the FP8 forwards inside the block, by path (``note``'s names)."""
    counts: collections.Counter[str] = collections.Counter()
    _open.append(counts)
    try:
        yield counts
    finally:  # by identity: two open Counters may compare equal
        _open[:] = [c for c in _open if c is not counts]
