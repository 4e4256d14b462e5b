"""Reading a ``MEGATRON_FP8_*`` choice from the environment: the value, stripped and lower-cased,
or its default; anything else raises, naming every allowed value and what it does."""

from __future__ import annotations

import os
from collections.abc import Mapping


def env_choice(name: str, default: str, allowed: Mapping[str, str]) -> str:
    """``name``'s value (``default`` when unset), one of ``allowed`` (value -> what it does, shown
    in the error; empty: nothing shown)."""
    v = os.environ.get(name, default).strip().lower()
    if v not in allowed:
        said = ", ".join(f"'{k}' ({what})" if what else f"'{k}'" for k, what in allowed.items())
        raise ValueError(f"{name}={v!r}; allowed: {said}")
    return v
