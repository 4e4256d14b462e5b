"""Per-layer CUDA graphs (``MEGATRON_FP8_GRAPHS=1``, ops/graphed.py) on the GPU: a graphed FP8
``Linear`` gives the eager layer's outputs and gradients bit for bit over several steps of
micro-batches (weights updated in place between steps, the FP8 weight cast once per step),
reports the same GEMMs, falls back to eager (warning) where one graph cannot serve, and
replays: the capture happens once."""

from __future__ import annotations

import warnings

import pytest
import torch

import megatron_fp8 as mf
from megatron_fp8.ops import paths
from megatron_fp8.recipe import PRESETS, Float8BlockScaling, Format

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

RECIPES = {"current": PRESETS["current"], "blockwise": PRESETS["blockwise"],
           "blockwise-hybrid": Float8BlockScaling(fp8_format=Format.HYBRID)}


def _train(monkeypatch: pytest.MonkeyPatch, graphs: str, recipe: object, soi: bool, bias: bool, fused: bool,
           tokens: int = 256) -> tuple[list[torch.Tensor], list[tuple[str, str]], dict[str, int]]:
    """Three steps of two micro-batches (``is_first_microbatch`` as Megatron sets it), an SGD
    update in place between steps; every output and gradient, cloned."""
    monkeypatch.setenv("MEGATRON_FP8_GRAPHS", graphs)
    torch.manual_seed(5)
    layer = mf.Linear(512, 384, bias=bias, params_dtype=torch.bfloat16, device="cuda", save_original_input=soi,
                      fuse_wgrad_accumulation=fused, name="fc")
    if fused:
        layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32, device="cuda")
    out: list[torch.Tensor] = []
    with mf.gemm.record_gemms() as calls, paths.count_paths() as counts:
        for _step in range(3):
            for micro in range(2):
                x = torch.randn(2, tokens // 2, 512, dtype=torch.bfloat16, device="cuda", requires_grad=True)
                h = x * 1.5  # not a leaf: as in a model
                dy = torch.randn(2, tokens // 2, 384, dtype=torch.bfloat16, device="cuda")
                with mf.fp8_autocast(fp8_recipe=recipe):
                    y = layer(h, is_first_microbatch=micro == 0)
                y.backward(dy)
                out += [y.detach().clone(), x.grad.clone()]
            out.append(layer.weight.main_grad.clone() if fused else layer.weight.grad.clone())
            if bias:
                out.append(layer.bias.grad.clone())
            with torch.no_grad():
                for p in layer.parameters():
                    p -= 0.1 * (p.main_grad.to(p.dtype) if fused and p is layer.weight else p.grad)
                    p.grad = None
                if fused:
                    layer.weight.main_grad.zero_()
    torch.cuda.synchronize()
    return out, [(c.name, c.backend.value) for c in calls], dict(counts)


def _graphs_of(layer: mf.Linear) -> list:
    """The layer's captured graphs (``graph_for`` keeps them on its quantizers), one per input signature."""
    from megatron_fp8.ops import graphed

    return [g for g in layer._quantizers["weight"].__dict__["_graphs"].values() if isinstance(g, graphed.LinearGraph)]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("soi", [False, True])
def test_graphed_equals_eager(monkeypatch: pytest.MonkeyPatch, recipe: str, soi: bool) -> None:
    eager, eager_calls, eager_paths = _train(monkeypatch, "0", RECIPES[recipe], soi, True, False)
    graphed, graphed_calls, graphed_paths = _train(monkeypatch, "1", RECIPES[recipe], soi, True, False)
    for i, (a, b) in enumerate(zip(eager, graphed, strict=True)):
        assert torch.equal(a, b), (recipe, soi, i, (a.float() - b.float()).abs().max().item())
    assert graphed_paths.get("graphed linear") == 6, graphed_paths  # every forward replayed
    # the same GEMMs reported per replay, none emulated (a capture may name another native kernel: "[cublaslt]")
    assert sorted(n.split("[")[0] for n, _ in graphed_calls) == sorted(n.split("[")[0] for n, _ in eager_calls)
    assert {b for _, b in graphed_calls} == {"native"}
    assert sum(eager_paths.values()) == 6


def test_graphed_fused_wgrad_and_unaligned_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """``main_grad`` accumulation inside the graph (Megatron's fusion), and a token count the
    block recipe pads (200: not a multiple of 128)."""
    for recipe, tokens in (("current", 256), ("blockwise", 200)):
        eager, _, _ = _train(monkeypatch, "0", RECIPES[recipe], False, False, True, tokens)
        graphed, _, counts = _train(monkeypatch, "1", RECIPES[recipe], False, False, True, tokens)
        assert counts.get("graphed linear") == 6, counts
        for i, (a, b) in enumerate(zip(eager, graphed, strict=True)):
            assert torch.equal(a, b), (recipe, i)


def test_second_forward_before_backward_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two micro-batches in flight (a pipeline schedule): the second runs eagerly, with a
    warning naming the layer, and both backwards give the eager gradients."""
    results = {}
    for graphs in ("0", "1"):
        monkeypatch.setenv("MEGATRON_FP8_GRAPHS", graphs)
        torch.manual_seed(2)
        layer = mf.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda", name="inflight")
        xs = [torch.randn(256, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3)]
        with warnings.catch_warnings(record=True) as caught, paths.count_paths() as counts:
            warnings.simplefilter("always")
            with mf.fp8_autocast(fp8_recipe=PRESETS["current"]):
                y0 = layer(xs[0] * 1.0)  # captures, replays
                y1 = layer(xs[1] * 1.0)  # the graph holds y0's micro-batch: eager
            kept = [y0.detach().clone(), y1.detach().clone()]  # y0 is the graph's buffer until its next forward
            (y0.float().square().sum() + y1.float().square().sum()).backward()
            with mf.fp8_autocast(fp8_recipe=PRESETS["current"]):
                y2 = layer(xs[2] * 1.0)  # free again: replayed
            y2.float().sum().backward()
        results[graphs] = ([*kept, y2, *(x.grad for x in xs), layer.weight.grad], dict(counts),
                           [str(w.message) for w in caught])
    for a, b in zip(results["0"][0], results["1"][0], strict=True):
        assert torch.equal(a, b)
    assert results["1"][1] == {"graphed linear": 2, "lean linear": 1}, results["1"][1]
    assert any("Linear(inflight)" in m and "second micro-batch" in m for m in results["1"][2]), results["1"][2]


def test_two_signatures_share_the_cached_weight_across_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Micro-batches of two token counts (two graphs of one layer), three steps with the weight
    updated in place between them: the layer's cached FP8 weight is pointed at one graph's copy,
    the other graph copies from it, and every output and gradient is the eager path's bit for bit."""
    results = {}
    for graphs in ("0", "1"):
        monkeypatch.setenv("MEGATRON_FP8_GRAPHS", graphs)
        torch.manual_seed(4)
        layer = mf.Linear(256, 384, params_dtype=torch.bfloat16, device="cuda", name="twosig")
        out: list[torch.Tensor] = []
        with paths.count_paths() as counts:
            for _step in range(3):
                for micro, tokens in enumerate((256, 128, 256)):
                    x = torch.randn(tokens, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
                    with mf.fp8_autocast(fp8_recipe=PRESETS["current"]):
                        y = layer(x * 1.5, is_first_microbatch=micro == 0)
                    y.float().square().sum().backward()
                    out += [y.detach().clone(), x.grad.clone()]
                out.append(layer.weight.grad.clone())
                if graphs == "1":
                    cached = layer._w_cache["weight"]
                    kept = {t.data_ptr() for g in _graphs_of(layer) for t in g.w_s.tensors()}
                    assert len(kept) == 2 * len(cached.tensors())  # two graphs, a copy each
                    assert {t.data_ptr() for t in cached.tensors()} <= kept  # one copy: a graph's
                with torch.no_grad():
                    layer.weight -= 0.1 * layer.weight.grad
                    layer.weight.grad = None
        results[graphs] = (out, dict(counts))
    for i, (a, b) in enumerate(zip(results["0"][0], results["1"][0], strict=True)):
        assert torch.equal(a, b), i
    assert results["1"][1] == {"graphed linear": 9}, results["1"][1]


def test_delayed_scaling_warns_and_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_FP8_GRAPHS", "1")
    layer = mf.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda", name="delayedfc")
    x = torch.randn(256, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    with pytest.warns(RuntimeWarning, match=r"Linear\(delayedfc\).*per-step state"), paths.count_paths() as counts:
        with mf.fp8_autocast(fp8_recipe=PRESETS["delayed"]):
            layer(x).sum().backward()
    assert "graphed linear" not in counts


def test_a_copy_of_a_graphed_layer_makes_its_own_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``copy.deepcopy`` leaves the graphs behind (they hold the original's buffers); the copy
    captures its own and computes what the original does."""
    import copy

    monkeypatch.setenv("MEGATRON_FP8_GRAPHS", "1")
    layer = mf.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda", name="copied")
    x = torch.randn(256, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    outs = []
    for module in (layer, None):
        module = module if module is not None else copy.deepcopy(layer)
        with mf.fp8_autocast(fp8_recipe=PRESETS["current"]), paths.count_paths() as counts:
            y = module(x * 1.0)
        outs.append(y.detach().clone())
        y.float().sum().backward()
        assert counts == {"graphed linear": 1}, counts
    assert torch.equal(outs[0], outs[1])


def test_graphs_say_what_they_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a layer's capture leaves allocated is counted: at least its static input, output,
    output gradient and input gradient and its FP8 weight copy, and two layers of one shape
    alike; said once, naming the first layer."""
    import weakref

    from megatron_fp8.ops import graph_buffers

    monkeypatch.setattr(graph_buffers, "_live", weakref.WeakSet())
    monkeypatch.setattr(graph_buffers, "_shared", weakref.WeakValueDictionary())  # not earlier tests' graphs' buffers
    monkeypatch.setenv("MEGATRON_FP8_GRAPHS", "1")
    layers = [mf.Linear(512, 384, params_dtype=torch.bfloat16, device="cuda", name=name) for name in ("held", "twin")]
    x = torch.randn(256, 512, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mf.fp8_autocast(fp8_recipe=PRESETS["current"]):
            y = layers[1](layers[0](x * 1.5)[..., :128].repeat(1, 4))
        y.float().sum().backward()
    held = dict(graph_buffers.held_by_graphs())
    floor = (256 * 512) * 2 + (256 * 384) * 2 + 2 * (384 * 512)  # dx, y (BF16); weight (FP8, 2 copies)
    assert sorted(held) == ["Linear(held)", "Linear(twin)"] and held["Linear(held)"] >= floor, (held, floor)
    assert graph_buffers.shared_by_graphs() == (256 * 512) * 2 + (256 * 384) * 2  # one static x, one static dy for both
    assert held["Linear(held)"] == held["Linear(twin)"], held  # the same buffers counted the same
    said = [str(w.message) for w in caught if "keep their buffers" in str(w.message)]
    assert len(said) == 1 and "Linear(held)" in said[0], said
    assert not [w for w in caught if "approximate" in str(w.message)]  # counted from the graphs' pools


def test_layers_of_one_shape_share_static_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three layers of one shape in a chain, two steps of two micro-batches: their graphs copy x
    and dy into one shared buffer each (the flag's layer, whose backward reads x, keeps its own
    static x), the last layer runs on a side stream in each step's second micro-batch, and every
    output and gradient is the eager path's bit for bit."""
    results = {}
    for graphs in ("0", "1"):
        monkeypatch.setenv("MEGATRON_FP8_GRAPHS", graphs)
        torch.manual_seed(6)
        layers = [mf.Linear(384, 384, bias=i == 2, params_dtype=torch.bfloat16, device="cuda",
                            save_original_input=i == 1, name=f"chain{i}") for i in range(3)]
        side = torch.cuda.Stream()
        out: list[torch.Tensor] = []
        for _step in range(2):
            for micro in range(2):
                x = torch.randn(256, 384, dtype=torch.bfloat16, device="cuda", requires_grad=True)
                with mf.fp8_autocast(fp8_recipe=PRESETS["blockwise"]):
                    first = micro == 0
                    h = layers[1](layers[0](x * 1.5, is_first_microbatch=first).relu(), is_first_microbatch=first)
                    if micro == 1:
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            y = layers[2](h, is_first_microbatch=False)
                        torch.cuda.current_stream().wait_stream(side)
                    else:
                        y = layers[2](h, is_first_microbatch=True)
                y.float().square().sum().backward()
                out += [y.detach().clone(), x.grad.clone()]
            with torch.no_grad():
                for p in (p for layer in layers for p in layer.parameters()):
                    out.append(p.grad.clone())
                    p -= 0.1 * p.grad
                    p.grad = None
        torch.cuda.synchronize()
        results[graphs] = out
        if graphs == "1":
            made = [_graphs_of(layer)[0] for layer in layers]
            xs, dys = [g.x_s.data_ptr() for g in made], {g.dy_s.data_ptr() for g in made}
            assert xs[0] == xs[2] != xs[1] and len(dys) == 1, (xs, dys)
            assert [g.x_shared is not None for g in made] == [True, False, True]
            assert all(g.dy_shared is not None and not g.dy_s.requires_grad for g in made)
    for i, (a, b) in enumerate(zip(results["0"], results["1"], strict=True)):
        assert torch.equal(a, b), i


def test_real_graphs_keep_kept_outputs_free_dropped_forwards_and_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """On real graphs: a forward without backward frees its graph; views of an output kept past
    its backward keep their values (later calls run eagerly, warned); a dropped layer's graphs
    go by reference counting alone (the captured nodes let go of the quantizers)."""
    import gc
    import weakref

    monkeypatch.setenv("MEGATRON_FP8_GRAPHS", "1")
    torch.manual_seed(3)
    layer = mf.Linear(512, 384, bias=False, params_dtype=torch.bfloat16, device="cuda", name="keep")

    def call(lay: mf.Linear, x: torch.Tensor) -> torch.Tensor:
        with mf.fp8_autocast(fp8_recipe=PRESETS["current"]):
            return lay(x * 1.5)

    kept, copies = [], []
    with paths.count_paths() as counts, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = call(layer, torch.randn(256, 512, dtype=torch.bfloat16, device="cuda", requires_grad=True))
        del y  # no backward: the graph is free again
        for _ in range(3):
            y = call(layer, torch.randn(256, 512, dtype=torch.bfloat16, device="cuda", requires_grad=True))
            y.backward(torch.randn_like(y))
            kept.append(y.detach())
            copies.append(y.detach().clone())
            del y
    torch.cuda.synchronize()
    assert all(torch.equal(k, c) for k, c in zip(kept, copies, strict=True))
    assert counts.get("graphed linear") == 2, counts
    assert not [w for w in caught if "second micro-batch" in str(w.message)]
    assert [w for w in caught if "clone what you keep" in str(w.message)]
    del kept, copies
    graph = next(g for g in layer._quantizers["weight"].__dict__["_graphs"].values() if g is not None)
    ref = weakref.ref(graph)
    del graph
    gc.disable()
    try:
        del layer
        assert ref() is None
    finally:
        gc.enable()
