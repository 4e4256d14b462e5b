"""``scripts/profile_grouped_host.py``'s host-time tools on CPU: ``--breakdown``'s timers count each
wrapped part's calls and put every function back (also after an error), and ``--alternate``
rotates the settings' order each round, restores the environment and takes the per-round ratio
to the first value. The breakdown of a whole grouped step needs Triton (it wraps the Triton
launcher): CI runs it under Triton's interpreter."""

from __future__ import annotations

import os
import sys
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import profile_grouped_host as host  # noqa: E402 - a script, found through the path set above


class _Owner:
    def method(self, v: int) -> int:
        return v + 1


def test_timers_count_and_restore() -> None:
    mod = types.SimpleNamespace(fn=lambda v: 2 * v)
    fn, method = mod.fn, _Owner.__dict__["method"]
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    with host._timed([(mod, "fn", "f"), (_Owner, "method", "m")], acc):
        assert mod.fn(3) == 6 and mod.fn(4) == 8
        assert _Owner().method(1) == 2
    assert acc["f"][1] == 2 and acc["m"][1] == 1 and acc["f"][0] >= 0.0
    assert mod.fn is fn and _Owner.__dict__["method"] is method
    with pytest.raises(RuntimeError), host._timed([(mod, "fn", "f")], acc):
        raise RuntimeError("inside")
    assert mod.fn is fn


def test_alternate_rotates_restores_and_compares(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def fake(step, n):  # host ms 1.0 under "a", 0.8 under "b"; device 2.0
        seen.append(os.environ["MF8_TEST_SETTING"])
        return (1.0 if seen[-1] == "a" else 0.8), 2.0

    monkeypatch.setattr(host, "host_and_device_ms", fake)
    monkeypatch.setenv("MF8_TEST_SETTING", "before")
    rows = host.alternate(lambda: None, "MF8_TEST_SETTING", ["a", "b"], rounds=4)
    assert seen == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert rows == [["MF8_TEST_SETTING=a", 1.0, 2.0, 1.0], ["MF8_TEST_SETTING=b", 0.8, 2.0, 0.8]]
    assert os.environ["MF8_TEST_SETTING"] == "before"


def test_breakdown_of_a_grouped_step(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from megatron_fp8.modules.grouped import GroupedLinear
    from megatron_fp8.recipe import PRESETS

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    layer = GroupedLinear(4, 256, 128, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(512, 256, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(512, 128, dtype=torch.bfloat16)
    empty = torch.empty
    rows = {r[0]: r for r in host.breakdown(layer, x, dy, PRESETS["blockwise"], [128] * 4, steps=2)}
    assert torch.empty is empty
    for part in ("step", "forward (module call)", "backward (y.backward)", "x / dy casts (_cast_split)",
                 "fprop + dgrad GEMMs", "wgrad GEMMs"):
        assert part in rows, part
    assert rows["step"][2] == 1 and rows["fprop + dgrad GEMMs"][2] == 2 and rows["x / dy casts (_cast_split)"][2] == 2
    assert rows["forward (module call)"][1] + rows["backward (y.backward)"][1] <= rows["step"][1] * 1.0001
    assert x.grad is not None and all(w.grad is not None for w in layer.weights)
