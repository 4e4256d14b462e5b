"""What a per-layer graph's replays may overwrite (ops/graphed.py), on the CPU: a stand-in graph
whose replays compute the layer in FP32 into its static buffers, as a captured graph's replays
write them, drives the real ``graph_for`` / ``GraphedLinear`` code. Kept outputs and a leaf's
``.grad`` keep their values, a forward whose backward never comes frees its graph, a backward
after another forward's replay raises, and saved-tensor hooks at a replay run the call eagerly."""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any

import pytest
import torch

import megatron_fp8 as mf
from megatron_fp8.ops import graphed, paths
from megatron_fp8.ops.linear import linear
from megatron_fp8.recipe import PRESETS

CURRENT = PRESETS["current"]


class _Replay:
    def __init__(self, fn: Any) -> None:
        self.replay = fn


class StandIn(graphed.LinearGraph):
    """A graph of ``y = x @ w.T`` (no bias) whose replays write its static buffers."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor) -> None:  # (no CUDA graph objects)
        self.owner, self.wants, self.fused = "Linear(standin)", (True, True, False), False
        self.fwd_gemms, self.bwd_gemms, self.lease, self.epoch, self.out = [], [], None, 0, None
        self.x_shared = self.dy_shared = None
        self.x_s = torch.empty_like(x)
        self.y_s = torch.empty(*x.shape[:-1], weight.shape[0])
        self.dy_s = torch.empty_like(self.y_s)
        saved = torch.empty_like(x)  # what the backward reads, in the pool
        dx, dw = torch.empty_like(x), torch.empty_like(weight)
        self.grad_out = (dx, dw, None)

        def fwd() -> None:
            saved.copy_(self.x_s)
            self.y_s.copy_(self.x_s @ weight.detach().t())

        def bwd() -> None:
            dx.copy_(self.dy_s @ weight.detach())
            dw.copy_(self.dy_s.reshape(-1, dw.shape[0]).t() @ saved.reshape(-1, dw.shape[1]))
        self.fwd, self.bwd = _Replay(fwd), _Replay(bwd)
        self.y_uses = graphed._uses(self.y_s)

    def load_weight(self, w_fp8: Any) -> None:
        pass


@pytest.fixture
def layer(monkeypatch: pytest.MonkeyPatch) -> mf.Linear:
    monkeypatch.setenv("MEGATRON_FP8_GRAPHS", "1")
    monkeypatch.setattr(graphed, "_new_graph", lambda run, x, weight, *a: StandIn(x, weight))
    graphed._warned.clear()
    torch.manual_seed(0)
    return mf.Linear(64, 32, bias=False, params_dtype=torch.float32, name="standin")


def _call(layer: mf.Linear, x: torch.Tensor) -> torch.Tensor:
    with mf.fp8_autocast(fp8_recipe=CURRENT):
        return layer(x)


def test_the_stand_in_replays_match_the_layer(layer: mf.Linear) -> None:
    x = torch.randn(16, 64, requires_grad=True)
    with paths.count_paths() as counts:
        y = _call(layer, x * 1.0)
    torch.testing.assert_close(y, x.detach() @ layer.weight.detach().t())
    assert counts == {"graphed linear": 1}


def test_a_forward_without_backward_frees_its_graph(layer: mf.Linear) -> None:
    with paths.count_paths() as counts, warnings.catch_warnings():
        warnings.simplefilter("error")  # no "second micro-batch" warning
        y = _call(layer, torch.randn(16, 64, requires_grad=True) * 1.0)
        del y  # never backpropagated (an evaluation with gradients on)
        for _ in range(2):
            y = _call(layer, torch.randn(16, 64, requires_grad=True) * 1.0)
            y.sum().backward()
            del y
    assert counts == {"graphed linear": 3}


def test_a_loops_last_output_keeps_its_values(layer: mf.Linear) -> None:
    """``y = layer(x)`` in a loop: the previous y is alive at the next call; it keeps its values
    (a copy of its own) and the call replays."""
    kept = []
    with paths.count_paths() as counts:
        for _ in range(3):
            x = torch.randn(16, 64, requires_grad=True)
            y = _call(layer, x * 1.0)
            y.sum().backward()
            kept.append((y, x.detach() @ layer.weight.detach().t()))
    assert counts == {"graphed linear": 3}
    for y, ref in kept:
        torch.testing.assert_close(y, ref)


def test_views_kept_past_backward_keep_their_values_and_the_call_runs_eagerly(layer: mf.Linear) -> None:
    preds, refs = [], []
    with paths.count_paths() as counts, pytest.warns(RuntimeWarning, match=r"Linear\(standin\).*clone what you keep"):
        for _ in range(3):
            x = torch.randn(16, 64, requires_grad=True)
            y = _call(layer, x * 1.0)
            y.sum().backward()
            preds.append(y.detach())  # a view of the static output
            refs.append(x.detach() @ layer.weight.detach().t())
            del y
    assert counts.get("graphed linear") == 1
    for p, ref in zip(preds, refs, strict=True):
        torch.testing.assert_close(p, ref, rtol=0.2, atol=0.5)  # (the eager calls are FP8)
    assert torch.equal(preds[0], refs[0])  # the replay's own output, untouched since


def test_a_leaf_reached_through_a_view_gets_a_grad_of_its_own(layer: mf.Linear) -> None:
    leaf = torch.randn(2, 8, 64, requires_grad=True)
    y = _call(layer, leaf.view(16, 64))
    y.backward(torch.ones(16, 32))
    del y
    grad = leaf.grad.clone()
    g = next(v for v in layer._quantizers["weight"].__dict__["_graphs"].values() if v is not None)
    assert leaf.grad.untyped_storage().data_ptr() != g.grad_out[0].untyped_storage().data_ptr()
    y = _call(layer, torch.randn(16, 64, requires_grad=True) * 1.0)
    y.backward(torch.randn(16, 32) * 5)
    assert torch.equal(leaf.grad, grad)


def test_a_backward_after_another_forwards_replay_raises(layer: mf.Linear) -> None:
    y1 = _call(layer, torch.randn(16, 64, requires_grad=True) * 1.0)
    y1.sum().backward(retain_graph=True)
    y2 = _call(layer, torch.randn(16, 64, requires_grad=True) * 1.0)  # replays over y1's activations
    with pytest.raises(RuntimeError, match=r"Linear\(standin\): a backward through a CUDA-graphed forward after a"):
        y1.sum().backward()
    y2.sum().backward()


def test_saved_tensor_hooks_at_a_replay_run_the_call_eagerly(layer: mf.Linear) -> None:
    y = _call(layer, torch.randn(16, 64, requires_grad=True) * 1.0)  # captured outside the hooks
    y.sum().backward()
    del y
    with paths.count_paths() as counts, pytest.warns(RuntimeWarning, match=r"Linear\(standin\).*saved-tensor hook"):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            _call(layer, torch.randn(16, 64, requires_grad=True) * 1.0)
    assert "graphed linear" not in counts


def test_the_captured_calls_nodes_let_go_of_the_quantizers() -> None:
    """The capture's autograd graph (kept by the static output) would hold the quantizers, which
    hold the graph: a dropped layer's graphs would wait for Python's cyclic collector."""
    layer = mf.Linear(128, 64, params_dtype=torch.float32)
    with mf.fp8_autocast(fp8_recipe=CURRENT):
        q = layer.fp8_quantizers("weight")
        w_fp8 = layer.fp8_weight("weight", q, None)
    with graphed.as_captured():
        y = linear(torch.randn(32, 128, requires_grad=True), layer.weight * 1.0, None, w_fp8=w_fp8, quantizers=q)
    holder = type("Holder", (), {})()
    holder.y_s = y
    q.__dict__["_graphs"] = {"key": holder}
    graphed._drop_quantizers(y)
    ref = weakref.ref(holder)
    gc.disable()
    try:
        del holder, y, q, w_fp8
        layer._quantizers = {}
        assert ref() is None  # freed by reference counting alone
    finally:
        gc.enable()
