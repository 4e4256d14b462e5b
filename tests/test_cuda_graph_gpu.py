"""Our layers inside a CUDA graph (skip without CUDA; run on the device machine).

Launch-bound steps (small K, grouped experts) run at the GPU's pace only when the host's launches
are replayed from a graph (Megatron's CUDA-graph options, TE's make_graphed_callables). A whole
training step of a Linear or a GroupedLinear must therefore be capturable: no host syncs, no
host-side state the replay would miss. Bitwise: a replay on fresh data equals an eager step of
an identical layer on the same data (same kernels), for current scaling and 1x128/128x128 blocks
(stateless recipes; delayed scaling's history would advance differently between the two), with
save_original_input off and on. Grouped layers: ``MEGATRON_FP8_GROUPED_GEMM=auto`` captures
cuBLAS per expert (the eager reference runs ``loop``, the same kernels), ``triton`` captures the
one-launch Triton kernels (eager ``triton``).
"""

from __future__ import annotations

import pytest
import torch

import megatron_fp8 as mf
from megatron_fp8 import gemm as core
from megatron_fp8.modules.grouped import GroupedLinear
from megatron_fp8.recipe import PRESETS
from megatron_fp8.testing import capture_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
M, K, N = 512, 384, 256
SPLITS = [128, 0, 256, 128]


def _module(kind: str, flag: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "linear":
        return mf.Linear(K, N, params_dtype=torch.bfloat16, device="cuda", save_original_input=flag)
    return GroupedLinear(len(SPLITS), K, N, params_dtype=torch.bfloat16, device="cuda", save_original_input=flag)


def _stepper(module: torch.nn.Module, kind: str, recipe, x: torch.Tensor, dy: torch.Tensor):
    params = list(module.parameters())

    def step() -> list[torch.Tensor]:
        x.grad = None
        for p in params:
            p.grad = None
        with mf.fp8_autocast(fp8_recipe=recipe):
            y = module(x) if kind == "linear" else module(x, SPLITS)
        y.backward(dy)
        return [y, x.grad, *(p.grad for p in params)]

    return step


def _replay_on_fresh_data(graph: torch.cuda.CUDAGraph, x: torch.Tensor, dy: torch.Tensor, seed: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """New x and dy drawn from ``seed``, copied into the captured step's inputs, then a replay."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x_new = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    dy_new = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
    with torch.no_grad():
        x.copy_(x_new)
    dy.copy_(dy_new)
    graph.replay()
    return x_new, dy_new


@pytest.mark.parametrize("flag", [False, True], ids=["flag-off", "flag-on"])
@pytest.mark.parametrize("recipe", ["current", "blockwise"])
@pytest.mark.parametrize("kind", ["linear", "grouped-auto", "grouped-triton"])
def test_step_replays_bitwise(kind: str, recipe: str, flag: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    path = kind.partition("-")[2]
    kind = kind.partition("-")[0]
    if path:
        monkeypatch.setenv("MEGATRON_FP8_GROUPED_GEMM", path)
    x = torch.empty(M, K, device="cuda", dtype=torch.bfloat16).normal_().requires_grad_()
    dy = torch.empty(M, N, device="cuda", dtype=torch.bfloat16).normal_()
    step, calls = _stepper(_module(kind, flag), kind, PRESETS[recipe], x, dy), []

    def step_recorded() -> list[torch.Tensor]:  # the GEMMs of the captured call (not the warm-up's)
        if not torch.cuda.is_current_stream_capturing():
            return step()
        with core.record_gemms() as captured:
            out = step()
        calls.extend(captured)
        return out

    graph, outs = capture_step(step_recorded)
    assert calls
    if kind == "grouped":  # what the capture ran: per-expert cuBLAS under auto, one launch under triton
        assert all(("[triton]" in c.name) == (path == "triton") for c in calls), [c.name for c in calls]
    if path == "auto":
        monkeypatch.setenv("MEGATRON_FP8_GROUPED_GEMM", "loop")
    eager = _module(kind, flag)
    for seed in (1, 2):  # two fresh inputs: the replay reads its inputs, not what it captured
        x_new, dy_new = _replay_on_fresh_data(graph, x, dy, seed)
        xe = x_new.clone().requires_grad_()
        want = _stepper(eager, kind, PRESETS[recipe], xe, dy_new)()
        assert len(want) == len(outs)
        for i, (got, ref) in enumerate(zip(outs, want)):
            assert torch.equal(got, ref), f"{kind} {recipe} flag={flag} data {seed}: output {i} differs"



@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_padded_splits_replay_after_other_splits(recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Router-like splits (not multiples of 16 / 128) are padded per expert through a row index
    whose counts reach the device from pinned memory (``kernels.device_ints``): capturable, and
    the graph replays bitwise like an eager step even after other splits evicted the cache."""
    from megatron_fp8.quant import kernels

    monkeypatch.setenv("MEGATRON_FP8_GROUPED_GEMM", "loop")  # the same kernels and padding eager and captured
    splits = [100, 3, 250, 159]
    module = GroupedLinear(len(splits), K, N, params_dtype=torch.bfloat16, device="cuda")
    x = torch.empty(M, K, device="cuda", dtype=torch.bfloat16).normal_().requires_grad_()
    dy = torch.empty(M, N, device="cuda", dtype=torch.bfloat16).normal_()

    def step(layer: GroupedLinear, xs: torch.Tensor, dys: torch.Tensor) -> list[torch.Tensor]:
        xs.grad = None
        layer.zero_grad(set_to_none=True)
        with mf.fp8_autocast(fp8_recipe=PRESETS[recipe]):
            y = layer(xs, splits)
        y.backward(dys)
        return [y, xs.grad, *(w.grad for w in layer.weights)]

    graph, outs = capture_step(lambda: step(module, x, dy))
    for i in range(kernels._INTS_KEPT + 2):  # other lists: the warm-up's entries leave the cache
        kernels.device_ints([M - 1 - i, 1 + i, 0, 0], torch.device("cuda"))
    torch.cuda.empty_cache()
    eager = GroupedLinear(len(splits), K, N, params_dtype=torch.bfloat16, device="cuda")
    eager.load_state_dict(module.state_dict())
    x_new, dy_new = _replay_on_fresh_data(graph, x, dy, 3)
    want = step(eager, x_new.clone().requires_grad_(), dy_new)
    for i, (got, ref) in enumerate(zip(outs, want)):
        assert torch.equal(got, ref), f"{recipe}: output {i} differs"


_FRESH_PROCESS = """
import torch
import megatron_fp8 as mf
from megatron_fp8.modules.grouped import GroupedLinear
from megatron_fp8.recipe import PRESETS
from megatron_fp8.testing import capture_step
splits = [128, 256, 128]
x = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
layer = GroupedLinear(3, 384, 256, params_dtype=torch.bfloat16, device="cuda")
def step():
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    with mf.fp8_autocast(fp8_recipe=PRESETS["current"]):
        y = layer(x, splits)
    y.backward(dy)
capture_step(step)[0].replay()
torch.cuda.synchronize()
print("captured and replayed")
"""


def test_grouped_capture_in_a_fresh_process() -> None:
    """The first cuBLAS GEMMs of a process may come inside the capture (``auto`` runs none in
    eager grouped steps): the eager warm-up must have created the cuBLAS handles of the forward's
    thread and of the autograd thread (``gemm_grouped._cublas_ready``), or ``cublasCreate`` fails there."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MEGATRON_FP8_GROUPED_GEMM": "auto"}  # eager steps then run no cuBLAS GEMM
    run = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and "captured and replayed" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("path", ["auto", "torch"])
@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_graphs_replay_after_later_captures(recipe: str, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron captures one graph per layer and replays them all every step: a graph must still
    replay, bitwise, after later captures (``torch.cuda.graph`` empties the device and pinned-host
    allocator caches on entry, so memory a graph uses but nobody holds would be gone by then) and
    after eager steps of other token splits (which evict cached expert offsets, ``kernels.
    segment_offsets``, but not those a graph captured)."""
    from megatron_fp8.quant import kernels

    monkeypatch.setenv("MEGATRON_FP8_GROUPED_GEMM", path)
    kinds = ["grouped", "linear", "grouped"]
    xs = [torch.empty(M, K, device="cuda", dtype=torch.bfloat16).normal_().requires_grad_() for _ in kinds]
    dys = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16).normal_() for _ in kinds]
    # the steps (their layers) stay alive with their graphs: a graph reads their weights' memory
    steps = [_stepper(_module(kind, False), kind, PRESETS[recipe], x, dy) for kind, x, dy in zip(kinds, xs, dys)]
    captured = [capture_step(step) for step in steps]
    for i in range(kernels._INTS_KEPT + 1):  # other splits evict the eager offsets cache
        kernels.segment_offsets([128 * (i + 1), 128], torch.device("cuda"))
    monkeypatch.setenv("MEGATRON_FP8_GROUPED_GEMM", "loop" if path == "auto" else path)  # the captured kernels
    for seed in (1, 2):
        for i, (kind, (graph, outs)) in enumerate(zip(kinds, captured)):
            x_new, dy_new = _replay_on_fresh_data(graph, xs[i], dys[i], seed * 10 + i)
            want = _stepper(_module(kind, False), kind, PRESETS[recipe], x_new.clone().requires_grad_(), dy_new)()
            for j, (got, ref) in enumerate(zip(outs, want, strict=True)):
                assert torch.equal(got, ref), f"graph {i} ({kind}, {recipe}, {path}), data {seed}: output {j} differs"


@pytest.mark.parametrize("flag", [False, True], ids=["flag-off", "flag-on"])
@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_microbatches_replay_after_weight_updates(recipe: str, flag: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron-LM's whole-iteration graph: a step of two micro-batches (the first casts the
    weight, the second reuses that cast: ``is_first_microbatch``), eager warm-up steps under the
    capture's settings for the whole run (what the plug-in sets, ``graphed.run_as_captured``), a
    capture, then the weight updated in place between replays (the optimizer runs outside the
    graph). Every replay equals an eager step of an identical layer, bit for bit: the captured
    cast reads the updated weight and the second micro-batch's reuse follows it."""
    from megatron_fp8.ops import graphed

    for key, value in graphed.capture_settings().items():
        monkeypatch.setenv(key, value)
    layers = [_module("linear", flag), _module("linear", flag)]  # graphed, eager: same seed, same weights
    xs = [torch.empty(M, K, device="cuda", dtype=torch.bfloat16).normal_().requires_grad_() for _ in range(2)]
    dys = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16).normal_() for _ in range(2)]

    def step(layer: torch.nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        layer.is_first_microbatch = True  # Megatron's set_is_first_microbatch() at a step's start
        outs = []
        with mf.fp8_autocast(fp8_recipe=PRESETS[recipe]):
            for x, dy in zip(inputs, dys):
                y = layer(x)
                y.backward(dy)
                outs.append(y)
        return [*outs, *(x.grad for x in inputs), *(p.grad for p in layer.parameters())]

    graphed_layer, eager = layers
    for _ in range(2):  # Megatron's eager warm-up iterations, on the current stream
        step(graphed_layer, xs)
    for t in [*xs, *graphed_layer.parameters()]:
        t.grad = None  # the capture's first micro-batch makes the grads; its second adds to them
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(graphed_layer, xs)
    g = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(3):
        with torch.no_grad():  # the optimizer's in-place update, the same on both layers
            delta = 1e-2 * torch.randn(N, K, device="cuda", generator=g)
            for layer in layers:
                layer.weight.add_(delta.to(layer.weight.dtype))
        graph.replay()
        for t in [*xs, *eager.parameters()]:
            t.grad = None
        want = step(eager, [x.detach().clone().requires_grad_() for x in xs])
        for i, (got, ref) in enumerate(zip(outs, want, strict=True)):
            assert torch.equal(got, ref), f"{recipe} flag={flag}: output {i} differs after a weight update"
