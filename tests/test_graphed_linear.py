"""Per-layer CUDA graphs (``MEGATRON_FP8_GRAPHS``, ops/graphed.py) where they cannot run: a bad
setting is named, and a layer asked to replay graphs on the CPU warns once, naming itself and
why, and computes what the eager layer computes, bit for bit. (Graphed numbers against eager:
tests/test_graphed_linear_gpu.py.)"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import megatron_fp8 as mf
from megatron_fp8.ops import graph_buffers, graphed, paths
from megatron_fp8.recipe import PRESETS


def _step(graphs: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], list[str], dict[str, int]]:
    monkeypatch.setenv("MEGATRON_FP8_GRAPHS", graphs)
    torch.manual_seed(1)
    layer = mf.Linear(128, 64, params_dtype=torch.bfloat16, name="cpu_fc")
    x = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught, paths.count_paths() as counts:
        warnings.simplefilter("always")
        for _ in range(2):
            with mf.fp8_autocast(fp8_recipe=PRESETS["current"]):
                y = layer(x)
            y.float().square().sum().backward()
    return [y.detach(), x.grad, layer.weight.grad], [str(w.message) for w in caught], dict(counts)


def test_graphs_on_the_cpu_warn_once_and_run_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    graphed._warned.clear()
    eager, _, _ = _step("0", monkeypatch)
    asked, messages, counts = _step("1", monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(eager, asked, strict=True))
    ours = [m for m in messages if "MEGATRON_FP8_GRAPHS" in m]
    assert len(ours) == 1 and "Linear(cpu_fc)" in ours[0] and "CUDA" in ours[0], messages
    assert "graphed linear" not in counts


def test_bad_graphs_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_FP8_GRAPHS", "yes")
    layer = mf.Linear(128, 64, params_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="MEGATRON_FP8_GRAPHS='yes'"), mf.fp8_autocast(fp8_recipe=PRESETS["current"]):
        layer(torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True))


def test_graphs_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEGATRON_FP8_GRAPHS", raising=False)
    assert not graphed.graphs_on()


def test_megatron_plugin_says_graphs_are_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plug-in's start-up summary names the setting (never silent), and only with FP8 on."""
    from types import SimpleNamespace

    pytest.importorskip("megatron.core")
    from megatron_fp8.megatron import plugin

    cfg = SimpleNamespace(fp8="hybrid", fp8_recipe="tensorwise", fp8_margin=0, fp8_amax_history_len=1,
                          fp8_amax_compute_algo="max", fp8_wgrad=True, fp8_param=False)
    monkeypatch.setenv("MEGATRON_FP8_GRAPHS", "1")
    assert "MEGATRON_FP8_GRAPHS=1: FP8 linears replay per-layer CUDA graphs" in plugin._summary(
        torch.nn.Linear(2, 2), {}, cfg)
    monkeypatch.setenv("MEGATRON_FP8_GRAPHS", "0")
    assert "CUDA graphs" not in plugin._summary(torch.nn.Linear(2, 2), {}, cfg)


def test_warm_ups_run_under_the_capture_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """``as_captured``: the general path and current scaling's CUDA cast while it is open (what a
    capture launches), a user's ``MEGATRON_FP8_CUDA_CURRENT=0`` kept, everything restored after."""
    import os

    monkeypatch.delenv("MEGATRON_FP8_LEAN", raising=False)
    monkeypatch.delenv("MEGATRON_FP8_CUDA_CURRENT", raising=False)
    with graphed.as_captured():
        assert os.environ["MEGATRON_FP8_LEAN"] == "0" and os.environ["MEGATRON_FP8_CUDA_CURRENT"] == "1"
    assert "MEGATRON_FP8_LEAN" not in os.environ and "MEGATRON_FP8_CUDA_CURRENT" not in os.environ
    monkeypatch.setenv("MEGATRON_FP8_LEAN", "1")
    monkeypatch.setenv("MEGATRON_FP8_CUDA_CURRENT", "0")
    with graphed.as_captured():
        assert os.environ["MEGATRON_FP8_LEAN"] == "0" and os.environ["MEGATRON_FP8_CUDA_CURRENT"] == "0"
    assert os.environ["MEGATRON_FP8_LEAN"] == "1" and os.environ["MEGATRON_FP8_CUDA_CURRENT"] == "0"


def _failing_capture(fails: int, inner: type[BaseException] = RuntimeError) -> object:
    """A stand-in for ``graphed._capture`` whose first ``fails`` calls fail as a CUDA capture does
    (an error inside the capture, then capture_end's, with the first as its context)."""
    calls = []

    def capture(*_args: object) -> str:
        calls.append(1)
        if len(calls) <= fails:
            try:
                raise inner("operation would make the legacy stream depend on a capturing blocking stream")
            except inner:
                raise RuntimeError("operation failed due to a previous error during capture")  # noqa: B904
        return "graph"
    return capture


@pytest.mark.parametrize("fails", [1, 2])
def test_a_failed_capture_is_tried_once_more_and_named(monkeypatch: pytest.MonkeyPatch, fails: int) -> None:
    """A capture that fails is tried once more (a process's first capture failed once on the
    H100 while later ones held); the warning names the inner error and where it was raised, once
    a second attempt succeeds too."""
    graphed._warned.clear()
    graphed._retried.clear()
    monkeypatch.setattr(graphed, "_capture", _failing_capture(fails))
    monkeypatch.setattr(graphed, "_not_graphable", lambda *_a: None)
    monkeypatch.setattr(graphed, "_recover_rng", lambda: True)
    layer = mf.Linear(16, 16, name="cap")
    with mf.fp8_autocast(fp8_recipe=PRESETS["current"]):
        q = layer.fp8_quantizers()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = graphed._new_graph(None, torch.zeros(1), layer.weight, None, None, q, False, None, 0)  # type: ignore[arg-type]
    said = [str(w.message) for w in caught]
    assert got == ("graph" if fails == 1 else None)
    assert len(said) == 1 and "legacy stream" in said[0] and "test_graphed_linear.py:" in said[0], said
    assert ("a second succeeded" in said[0]) == (fails == 1) and ("failed twice" in said[0]) == (fails == 2)


def test_out_of_memory_inside_a_capture_is_raised_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """An allocation that fails inside the capture reaches the caller as the out-of-memory error it
    is (capture_end's error carries it as its context), with no retry and no eager fallback."""
    graphed._warned.clear()
    monkeypatch.setattr(graphed, "_capture", _failing_capture(2, torch.OutOfMemoryError))
    monkeypatch.setattr(graphed, "_not_graphable", lambda *_a: None)
    monkeypatch.setattr(graphed, "_recover_rng", lambda: True)
    layer = mf.Linear(16, 16, name="oom")
    with mf.fp8_autocast(fp8_recipe=PRESETS["current"]):
        q = layer.fp8_quantizers()
    with pytest.raises(torch.OutOfMemoryError):
        graphed._new_graph(None, torch.zeros(1), layer.weight, None, None, q, False, None, 0)  # type: ignore[arg-type]


def test_megatron_whole_iteration_graph_runs_the_capture_settings_from_the_first_step(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Under Megatron-LM's whole-iteration CUDA graph (both spellings), the plug-in's first-forward
    hook puts the capture's settings in force for the whole run (the eager warm-up then builds
    what the capture launches) and says so; per-linear graphs inside it are refused, and so is
    dropless MoE (megatron-core syncs its token counts to the host), naming drop-and-pad."""
    import os
    from types import SimpleNamespace

    pytest.importorskip("megatron.core")
    from megatron_fp8.megatron import plugin

    for key in ("MEGATRON_FP8_LEAN", "MEGATRON_FP8_CUDA_CURRENT", "MEGATRON_FP8_GRAPHS"):
        monkeypatch.delenv(key, raising=False)

    def model(**graph: object) -> torch.nn.Module:
        layer = mf.Linear(16, 16)
        layer.config = SimpleNamespace(fp8=None, **graph)  # what Megatron's layers carry
        return torch.nn.Sequential(layer)

    plugin._hook(model(cuda_graph_impl="none"), ())
    assert "whole-iteration" not in capsys.readouterr().out and "MEGATRON_FP8_LEAN" not in os.environ
    plugin._hook(model(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"]), ())  # megatron-core 0.16
    assert "whole-iteration CUDA graph: our layers run the capture's routes" in capsys.readouterr().out
    assert os.environ["MEGATRON_FP8_LEAN"] == "0" and os.environ["MEGATRON_FP8_CUDA_CURRENT"] == "1"
    with pytest.raises(ValueError, match="dropless MoE .16 experts.*--moe-pad-expert-input-to-capacity"):
        plugin._hook(model(cuda_graph_impl="full_iteration", num_moe_experts=16), ())
    plugin._hook(model(cuda_graph_impl="full_iteration", num_moe_experts=16, moe_pad_expert_input_to_capacity=True), ())
    assert "whole-iteration CUDA graph: our layers run the capture's routes" in capsys.readouterr().out
    monkeypatch.setenv("MEGATRON_FP8_GRAPHS", "1")
    with pytest.raises(ValueError, match="capture inside its capture; unset MEGATRON_FP8_GRAPHS"):
        plugin._hook(model(cuda_graph_impl="full_iteration"), ())


class _Held:
    """A stand-in for a captured ``LinearGraph``: what the memory report reads of one."""

    def __init__(self, owner: str, held: int) -> None:
        self.owner, self.held, self.reserved = owner, held, 2 * held


def test_graph_memory_is_listed_and_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """What each live graph holds is listed (most first), said once per process at the first
    capture, summed in the plug-in's line; a freed layer's graph leaves the list."""
    import weakref

    monkeypatch.setattr(graph_buffers, "_live", weakref.WeakSet())
    monkeypatch.setattr(graph_buffers, "_shared", weakref.WeakValueDictionary())
    assert graph_buffers.held_by_graphs() == [] and graph_buffers.held_note() is None
    a, b = _Held("Linear(a)", 3 * 2**20), _Held("Linear(b)", 5 * 2**20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph_buffers.note_held(a)  # type: ignore[arg-type]
        graph_buffers.note_held(b)  # type: ignore[arg-type]
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "Linear(a)" in said[0] and "3.0 MiB" in said[0] and "held_by_graphs()" in said[0], said
    assert graph_buffers.held_by_graphs() == [("Linear(b)", 5 * 2**20), ("Linear(a)", 3 * 2**20)]
    note = graph_buffers.held_note()
    assert note is not None and "the CUDA graphs of 2 FP8 linears hold 8 MiB" in note, note
    assert note.index("Linear(b) 5") < note.index("Linear(a) 3") and "MEGATRON_FP8_GRAPHS=0" in note
    assert "the allocator reserved 16 MiB more over their captures" in note
    again = _Held("Linear(b)", 2**20)  # a second input signature of the same layer
    graph_buffers.note_held(again)  # type: ignore[arg-type]
    assert "of 2 FP8 linears (3 graph pairs: one per input signature) hold 9 MiB" in (graph_buffers.held_note() or "")
    shared = graph_buffers.shared_input("dy", torch.empty(2**18))  # 1 MiB of static dy the graphs share
    assert "hold 10 MiB between steps" in (graph_buffers.held_note() or "")
    assert "their shared static inputs 1;" in (graph_buffers.held_note() or "")
    del shared
    del a, again
    assert graph_buffers.held_by_graphs() == [("Linear(b)", 5 * 2**20)]


def test_megatron_plugin_says_what_graphs_hold_after_the_first_forward(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """With graphs on, the plug-in prints the graphs' memory once the model's first forward ends
    (every layer captured by then); with graphs off, nothing."""
    import weakref

    pytest.importorskip("megatron.core")
    from megatron_fp8.megatron import plugin

    monkeypatch.setattr(graph_buffers, "_live", weakref.WeakSet())
    kept = _Held("ColumnParallelLinear(decoder.layers.0.mlp.linear_fc1)", 7 * 2**20)
    graph_buffers._live.add(kept)  # type: ignore[arg-type]
    for setting, said in (("1", True), ("0", False)):
        monkeypatch.setenv("MEGATRON_FP8_GRAPHS", setting)
        root = torch.nn.Sequential(torch.nn.Linear(4, 4))
        plugin._at_first_forward_end(root, root)
        root(torch.randn(2, 4))
        out = capsys.readouterr().out
        assert ("hold 7 MiB" in out and "decoder.layers.0.mlp.linear_fc1" in out) == said, out


class _ReplayNothing:
    """What ``GraphedLinear`` reads of a ``LinearGraph``, with replays that do nothing (the CPU
    has no graphs): the autograd side of a graphed call, apart."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, grads: tuple, fused: bool) -> None:
        self.x_s, self.y_s, self.dy_s = torch.empty_like(x), y, torch.empty_like(y)
        self.fwd = self.bwd = type("Replay", (), {"replay": staticmethod(lambda: None)})()
        self.fwd_gemms: list = []
        self.bwd_gemms: list = []
        self.grad_out, self.fused, self.wants, self.lease = grads, fused, (True, True, False), None
        self.x_shared = self.dy_shared = self.out = None
        self.epoch = 0

    def load_weight(self, w_fp8: object) -> None:
        pass


def test_graphed_fused_backward_hands_autograd_a_fresh_dummy_grad() -> None:
    """Under Megatron's wgrad fusion the graphed backward hands autograd a dummy grad of its own, as
    the eager path does, so autograd adopts it; the graph's static one would be copied into
    ``.grad`` on every call (a weight-sized copy). The flag Megatron's DDP reads is set."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.shapes: list[tuple[str, tuple[int, ...]]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            if "clone" in str(func) or "copy" in str(func):
                self.shapes.append((str(func), tuple(out.shape)))
            return out

    weight = torch.nn.Parameter(torch.randn(4, 8))
    weight.main_grad = torch.zeros(4, 8)  # type: ignore[attr-defined]
    weight.grad_added_to_main_grad = False  # type: ignore[attr-defined]
    x = torch.randn(2, 8, requires_grad=True)
    static_dw = torch.randn(4, 8)
    g = _ReplayNothing(x, torch.randn(2, 4), (torch.randn(2, 8), static_dw, None), fused=True)
    y = graphed.GraphedLinear.apply(x, weight, None, None, g)
    with Copies() as seen:
        y.sum().backward()
    assert weight.grad_added_to_main_grad  # type: ignore[attr-defined]
    assert weight.grad is not None and weight.grad.shape == (4, 8) and weight.grad.data_ptr() != static_dw.data_ptr()
    assert not [s for s in seen.shapes if s[1] == (4, 8)], seen.shapes  # no weight-sized copy
    assert any(s[1] == (2, 4) for s in seen.shapes)  # (dy into the graph's static buffer)


def test_graph_takes_over_the_layers_fp8_weight() -> None:
    """A new FP8 weight is copied into the graph's static copy once, and then points at that copy
    (same values): the cast's own buffers are freed while the layer's micro-batch cache still
    holds the object, so a graphed layer keeps one FP8 weight, not two. Another graph of the
    layer (a second input signature) copies from it and takes it over in turn. An object the
    cache does not keep (a functional caller's) is copied from and left as it was."""
    import gc
    import weakref

    layer = mf.Linear(64, 32, params_dtype=torch.float32)
    with mf.fp8_autocast(fp8_recipe=PRESETS["current"]):
        quantizers = layer.fp8_quantizers("weight")
        assert quantizers is not None
        w_fp8 = layer.fp8_weight("weight", quantizers, is_first_microbatch=True)  # cached for the step
    want = [t.clone() for t in w_fp8.tensors()]
    own = weakref.ref(w_fp8.rowwise.data.untyped_storage())
    g1, g2 = (graphed.LinearGraph.__new__(graphed.LinearGraph) for _ in range(2))
    for g in (g1, g2):
        g.w_s, g.w_src = graphed._static_copy(w_fp8), (lambda: None)
        for t in g.w_s.tensors():
            t.zero_()
    g1.load_weight(w_fp8)
    gc.collect()
    assert own() is None  # the cast's own buffer is gone
    assert all(a is b for a, b in zip(w_fp8.tensors(), g1.w_s.tensors(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(g1.w_s.tensors(), want, strict=True))
    assert all(getattr(t, "_mf_param_derived", False) for t in w_fp8.tensors())  # accounting: a parameter's
    assert layer.fp8_weight("weight", quantizers, is_first_microbatch=False) is w_fp8  # the cache's
    g1.w_s.scale.fill_(-1.0)  # a second load of the same object copies nothing:
    g1.load_weight(w_fp8)
    assert g1.w_s.scale.item() == -1.0
    g1.w_s.scale.copy_(want[-1])
    g2.load_weight(w_fp8)  # another signature's graph: copies the values, takes the object over
    assert all(torch.equal(a, b) for a, b in zip(g2.w_s.tensors(), want, strict=True))
    assert all(a is b for a, b in zip(w_fp8.tensors(), g2.w_s.tensors(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(g1.w_s.tensors(), want, strict=True))  # g1's copy untouched
    from megatron_fp8.ops.linear import cast_weight

    mine = cast_weight(quantizers.weight, layer.weight)  # a functional caller's own cast: not the cache's
    kept = mine.tensors()
    g1.load_weight(mine)
    assert all(a is b for a, b in zip(mine.tensors(), kept, strict=True))  # copied from, left as it was
    assert all(torch.equal(a, b) for a, b in zip(g1.w_s.tensors(), kept, strict=True))


def test_graph_memory_is_counted_from_its_pool_and_static_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph's count: the live blocks of the allocator's segments of its own pool (not blocks
    pending a free, not other pools), plus its static input, output gradient and FP8 weight
    copy made outside the pool, each storage once; None where no segment of the pool holds the
    graph's output (the caller then falls back, warning)."""
    g = graphed.LinearGraph.__new__(graphed.LinearGraph)
    g.y_s, g.x_s, g.dy_s = torch.empty(8), torch.empty(4), torch.empty(2)
    g.w_s = type("W", (), {"tensors": lambda self: [g.x_s, torch.empty(3, dtype=torch.uint8)]})()
    g.x_shared = g.dy_shared = None
    y = g.y_s.untyped_storage().data_ptr()

    def segment(pool: tuple[int, int], address: int, *blocks: tuple[int, str]) -> dict:
        return {"device": 0, "segment_pool_id": pool, "address": address, "total_size": 2**20,
                "blocks": [{"size": n, "state": state} for n, state in blocks]}
    segments = [segment((7, 0), y, (512, "active_allocated"), (1024, "active_pending_free"), (4096, "inactive")),
                segment((7, 0), y + 2**20, (2048, "active_allocated")),
                segment((0, 0), 0, (9999, "active_allocated")), segment((8, 0), 0, (7777, "active_allocated"))]
    asked: list[dict] = []

    def snapshot(mempool_id: tuple[int, int] | None = None, include_traces: bool = True) -> list[dict]:
        asked.append({"mempool_id": mempool_id, "include_traces": include_traces})
        return segments  # every pool's: the count filters them itself
    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    # read once per process: a fresh cache for this test, which swaps the function
    monkeypatch.setattr(graph_buffers, "_snapshot_takes", functools.cache(graph_buffers._snapshot_takes.__wrapped__))
    outside = 16 + 8 + 3  # x_s (also in the weight's list: once), dy_s, the weight's other tensor
    assert graph_buffers.held_bytes(g, (7, 0), torch.device("cuda", 0)) == 512 + 2048 + outside
    assert graph_buffers.held_bytes(g, (8, 0), torch.device("cuda", 0)) is None  # its pool does not hold y_s
    assert graph_buffers.held_bytes(g, (7, 0), torch.device("cuda", 1)) is None  # another device's segments
    assert asked[0] == {"mempool_id": (7, 0), "include_traces": False}  # asks for its pool, without traces
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)  # an older torch's signature
    graph_buffers._snapshot_takes.cache_clear()
    assert graph_buffers.held_bytes(g, (7, 0), torch.device("cuda", 0)) == 512 + 2048 + outside
    dy = graph_buffers.SharedInput(g.dy_s)  # a static dy shared with other graphs: counted once, by shared_by_graphs
    g.dy_shared, g.dy_s = dy, dy.buffer.detach()
    assert graph_buffers.held_bytes(g, (7, 0), torch.device("cuda", 0)) == 512 + 2048 + outside - 8


def test_static_input_is_a_leaf_of_its_own() -> None:
    """The graph's static input copies x's values, shape and strides into a leaf: no autograd
    node links it to the caller's graph (such a node, made on the caller's stream, failed every
    process's first capture on the GPU); it needs a gradient exactly where x does."""
    base = torch.randn(6, 4, requires_grad=True)
    for x in (base * 2, (base * 2).t(), torch.randn(3, 5)):
        s = graphed._static_input(x)
        assert s.is_leaf and s.grad_fn is None and s.requires_grad == x.requires_grad
        assert s.stride() == x.stride() and torch.equal(s, x.detach()) and s.data_ptr() != x.data_ptr()


def test_graphs_of_one_signature_share_their_static_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """One static x and one static dy buffer per role and signature (shape, strides, dtype,
    device), made at first use, freed with the last graph holding it, counted once; each graph
    gets a leaf of its own on it, needing a gradient where its input does."""
    import gc
    import weakref

    monkeypatch.setattr(graph_buffers, "_shared", weakref.WeakValueDictionary())
    x = torch.randn(6, 4, requires_grad=True)
    a, b = graph_buffers.shared_input("x", x), graph_buffers.shared_input("x", torch.randn(6, 4))
    assert a is b and a.buffer.shape == (6, 4)
    others = [graph_buffers.shared_input("dy", x), graph_buffers.shared_input("x", x.t()),
              graph_buffers.shared_input("x", x.double()), graph_buffers.shared_input("x", torch.randn(6, 5))]
    assert len({id(o) for o in [a, *others]}) == 5 and others[1].buffer.stride() == x.t().stride()
    assert graph_buffers.shared_by_graphs() == 3 * 4 * 24 + 8 * 24 + 4 * 30  # x, dy, x.t(); double; 6x5
    leaf, other = a.view(x), a.view(torch.randn(6, 4))
    assert leaf.is_leaf and leaf.requires_grad and not other.requires_grad
    assert leaf.data_ptr() == other.data_ptr() == a.buffer.data_ptr()
    del a, b, others, leaf, other
    gc.collect()
    assert graph_buffers.shared_by_graphs() == 0 and not graph_buffers._shared


class _SavesX(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x.reshape(-1), w)
        return x @ w

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        return dy @ w.t(), x.reshape(dy.shape[0], -1).t() @ dy


@pytest.mark.parametrize("soi", [False, True])
def test_a_graph_shares_its_static_x_only_where_backward_never_reads_it(soi: bool) -> None:
    """``_saves`` finds a saved tensor on x's storage through built-in nodes (a view of x saved
    by a multiply) and custom functions (``save_for_backward``): a graph whose backward reads x
    keeps a static x of its own. The FP8 linear saves x exactly when ``save_original_input`` is on
    (the general path, which captures run; its columnwise FP8 copy otherwise)."""
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)
    assert graphed._saves(x[:, :4] * w[:4, 0], x) and graphed._saves(_SavesX.apply(x * 1, w).relu(), w)
    assert not graphed._saves((x + 1).sum(0) @ w, x) and graphed._saves((x + 1).sum(0) @ w, w)
    assert graphed._saves(_SavesX.apply(x, w) + 1, x)
    freed = (x + 1) * w[:, 0]
    freed.sum().backward()  # its saves freed: unreadable, so assumed to hold x
    assert graphed._saves(freed, torch.randn(2))
    layer = mf.Linear(16, 32, save_original_input=soi, name="fc")
    with mf.fp8_autocast(fp8_recipe=mf.recipe.PRESETS["current"]), graphed.as_captured():
        y = layer(x)
    assert graphed._saves(y, x) is soi


def test_a_replay_on_another_stream_waits_for_the_shared_buffers_last_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_take``: the first copy into a shared buffer and copies from the same stream wait for
    nothing; a copy from another stream makes that stream wait for the last writer's (and the
    buffer then belongs to it)."""
    raw = [11]
    waits: list[tuple[int, int]] = []

    class Stream:
        def __init__(self, ptr: int) -> None:
            self.ptr = ptr

        def wait_stream(self, other: Stream) -> None:
            waits.append((self.ptr, other.ptr))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: raw[0], raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(raw[0]))
    sh, device = graph_buffers.SharedInput(torch.empty(4)), torch.device("cuda", 0)
    graph_buffers.take(sh, device)
    graph_buffers.take(sh, device)
    assert waits == [] and sh.stream == 11
    raw[0] = 22
    graph_buffers.take(sh, device)
    assert waits == [(22, 11)] and sh.stream == 22
    graph_buffers.take(sh, device)
    assert waits == [(22, 11)]


def test_no_capture_under_anothers_saved_tensor_hooks() -> None:
    """A capture saves through the active saved-tensor hooks: ours that only look (the memory
    tracker, the audit) let it; non-reentrant checkpointing, offloading or any other hook do not
    (the layer then runs eagerly, warned)."""
    from torch.utils.checkpoint import checkpoint

    from megatron_fp8.audit import Recorder

    seen: list[bool] = []

    def look(t: torch.Tensor) -> torch.Tensor:
        seen.append(graphed._foreign_saved_tensor_hooks())
        return t * 1
    x = torch.randn(3, requires_grad=True)
    look(x)
    with mf.memory.track_saved_tensors():
        look(x)
    with Recorder(torch.nn.Linear(2, 2)).recording():
        look(x)
    checkpoint(look, x, use_reentrant=False)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        look(x)
    with torch.autograd.graph.save_on_cpu():
        look(x)
    assert seen == [False, False, False, True, True, True]
