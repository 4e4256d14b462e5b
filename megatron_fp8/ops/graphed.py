"""Per-layer CUDA graphs for the eager FP8 linear: opt-in, ``MEGATRON_FP8_GRAPHS=1``; experimental
(on the H100 the graphed GPU tests pass; in Megatron-LM's dense-1b loop the graphs were faster
than eager in 8 of 11 same-round pairs, by 5-33%, and 2-13% slower in three, with 3.4 GB more
memory since the static inputs are shared: docs/benchmarks.md runs AV, AW, AX).

An eager FP8 linear pays ~0.6-0.9 ms of host time per forward+backward (its casts, GEMMs and
autograd Python), more than its GPU work below hidden ~4096: the GPU idles (docs/benchmarks.md).
With graphs on, each FP8 linear captures its forward (x's casts, fprop) and its backward (dy's
casts, dgrad, wgrad, ``main_grad`` accumulation) once per input signature, as
``torch.cuda.make_graphed_callables`` does for a module, and every later call replays them: the
host cost of a call becomes two copies into static buffers and two graph launches. The loop
around it stays eager (Megatron-LM's own, unchanged).

What a call does, graphed:

=========  =====================================================================================
forward    x -> the graph's static input (a copy; one buffer for all graphs of x's signature
           where backward does not read x); the FP8 weight -> the graph's static copy
           (only when the layer cast it anew: the first micro-batch of a step); replay; the
           output is an alias of the graph's static output
backward   dy -> static (a copy, into a buffer shared likewise); replay; dx / dw / db are
           aliases of the graph's static grads
=========  =====================================================================================

Numbers: the captured calls are the layer's own (``ops.linear.linear``: the general path's
capture routes), so outputs and gradients are meant to be those of the eager path bit for bit
(tests/test_graphed_linear_gpu.py checks it; passed on the H100, run AI). Where it applies: CUDA,
gradients on, no tensor-parallel communication (``comm``), stateless recipes (current scaling,
1x128 / 128x128 blocks); delayed scaling updates Python-side state per step and stays eager.
One graph pair serves one micro-batch at a time: a second forward of the same layer and shape
before the first one's backward (pipeline schedules) runs eagerly, with a warning (a forward
whose autograd graph went without a backward frees the graph). What a replay overwrites stays
safe: an earlier call's output still alive at the next call keeps its values (the last output
itself alone, a loop's variable, gets a copy of its own; views of it kept past the backward make
the call run eagerly, warned), a leaf reached through a view gets a copy of the static dx as its
``.grad``, and a backward through a forward whose graph a later forward replayed again
(``retain_graph=True``) raises. Saved-tensor hooks active at a call (checkpointing, offloading)
run it eagerly, warned, as they stop a capture. Anything else
that stops a layer from being graphed warns once, naming the layer and why, and the layer runs
eagerly.

Memory: the graph keeps its buffers (static output, grads, what its backward reads) between
calls, where the eager path frees them after backward; its static x and dy are shared with every
graph of their signature (``SharedInput``; not x where backward reads it). ``save_original_input`` saves
the static copy of x (so the flag's saving is the columnwise FP8 copy of the static buffers, not
memory shared with another module), and saved-tensor accounting (``megatron_fp8.memory``) sees
none of a graphed layer's tensors. The layer's FP8 weight is held once: its micro-batch cache
points at the graph's copy. Every capture warms up and captures on one side stream: with a
stream each, every stream kept its warm-up outputs and cuBLASLt workspace, and 16 dense-1b
linears kept 8,582 MiB between steps against 3,746 MiB (run AW). Never silent about it: each
capture counts what it keeps (``LinearGraph.held``: its pool's live blocks and its static
buffers outside the pool; listed by ``graph_buffers.held_by_graphs()``; what its pool reserved besides is
``LinearGraph.reserved``), the first capture of a process warns once, and the Megatron plug-in
prints the totals (``held_note``) after the model's first forward.
"""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import gemm as gemm_mod
from ..quant.tensor import QuantizedTensor
from . import paths, routes
from .graph_buffers import ENV, SharedInput, count_held, note_held, shared_input, take

_MAX_SIGNATURES = 4  # graph pairs per layer (one per input shape); beyond, the layer runs eagerly
_warned: set[tuple[str, str]] = set()


def graphs_on() -> bool:
    """``MEGATRON_FP8_GRAPHS``: ``1`` captures and replays FP8 linears (module docstring), ``0``
    (the default) runs them eagerly."""
    v = os.environ.get(ENV, "0").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{ENV}={v!r}; allowed: '1' (FP8 linears replay per-layer CUDA graphs) or '0' (eager)")
    return v == "1"


def _warn_once(owner: str, why: str) -> None:
    if (owner, why) not in _warned:
        _warned.add((owner, why))
        warnings.warn(f"megatron_fp8: {owner}: {ENV}=1 but {why}; it runs eagerly", RuntimeWarning, stacklevel=4)


def _owner(q: Any) -> str:
    return q.input.name.rsplit(" ", 1)[0]  # "Linear(proj)" of "Linear(proj) input"


def _not_graphable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, w_fp8: QuantizedTensor,
                   q: Any, comm: Any) -> str | None:
    """Why this call cannot be graphed (a warning's words), or None."""
    from ..quant.block_scaling import Block1DQuantizer, Block2DQuantizer
    from ..quant.quantizer import _grouped
    from ..quant.tensor_scaling import CurrentScalingQuantizer

    if not x.is_cuda:
        return "CUDA graphs need CUDA tensors"
    if comm is not None:
        return "tensor-parallel communication is not captured yet"
    stateless = (CurrentScalingQuantizer, Block1DQuantizer, Block2DQuantizer)
    if not all(type(t) in stateless for t in (q.input, q.weight, q.grad_output)):
        return f"its recipe's quantizers ({type(q.input).__name__}) keep per-step state; graphs serve current " \
               f"scaling and 1x128 / 128x128 blocks"
    if any(_grouped(getattr(t, "group", None)) for t in (q.input, q.grad_output)):
        return "its amaxes are reduced over a process group"
    if any(op is not None and op.pack is not None for op in (w_fp8.rowwise, w_fp8.columnwise)):
        return "its FP8 weight is a view of a grouped cast"
    if not (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return "nothing it computes needs a gradient"
    if _foreign_saved_tensor_hooks():
        return ("a saved-tensor hook is active (non-reentrant activation checkpointing or offloading): a capture "
                "cannot save through it")
    return None


def _foreign_saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks other than ours that only look (``memory.keeps_saved_tensors``)
    are active: a capture's saves would go through them (checkpointing drops them to recompute)."""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, TypeError, RuntimeError):  # a torch without this query (2.13 has it)
        return False
    return hooks is not None and not getattr(hooks[0], "keeps_saved_tensors", False)


class LinearGraph:
    """One layer's captured forward and backward for one input signature, and their buffers."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.x_s: torch.Tensor | None = None
        self.w_s: QuantizedTensor | None = None
        self.w_src: Callable[[], Any] = lambda: None  # weakref of the FP8 weight last copied in
        self.y_s: torch.Tensor | None = None
        self.dy_s: torch.Tensor | None = None
        self.wants: tuple[bool, bool, bool] = (False, False, False)  # grads of x, weight, bias
        self.fwd = torch.cuda.CUDAGraph()
        self.bwd = torch.cuda.CUDAGraph()
        self.grad_out: tuple[torch.Tensor | None, ...] = ()  # what backward returns (kept: see _capture)
        self.fused = False  # the wgrad is added into weight.main_grad (Megatron's fusion)
        self.fwd_gemms: list[gemm_mod.GemmCall] = []
        self.bwd_gemms: list[gemm_mod.GemmCall] = []
        self.lease: weakref.ref[_Lease] | None = None  # set from a forward until its backward ran or its graph went
        self.epoch = 0  # forwards replayed: a backward after another forward's replay is refused
        self.y_uses = 0  # the static output's storage use count with no output of it alive (_uses)
        self.out: weakref.ref[torch.Tensor] | None = None  # the output the last forward returned
        self.x_shared: SharedInput | None = None  # x_s's buffer where shared with other graphs (graph_buffers)
        self.dy_shared: SharedInput | None = None  # likewise dy_s's
        self.held = 0  # bytes it keeps allocated (static buffers, saved tensors, its FP8 weight copy)
        self.reserved = 0  # bytes the caching allocator reserved more over its capture (its pool, warm-up caches)

    def load_weight(self, w_fp8: QuantizedTensor) -> None:
        """Copy the layer's FP8 weight into the graph's, unless it is the one copied last. Where
        the layer's micro-batch cache keeps ``w_fp8`` (``w_fp8.cached``) for the rest of the
        step, point it at the graph's copy (same values), so that the cast's own buffers go: the
        cache held a second FP8 copy of every graphed weight (2 bytes a parameter, run AW). (An
        object a caller of ``ops.linear.linear`` keeps is left as it is: a later load would
        change its values.)"""
        assert self.w_s is not None
        if self.w_src() is w_fp8:
            return
        torch._foreach_copy_(self.w_s.tensors(), w_fp8.tensors())
        if w_fp8.cached:
            w_fp8.rowwise, w_fp8.columnwise, w_fp8.scale = self.w_s.rowwise, self.w_s.columnwise, self.w_s.scale
        self.w_src = weakref.ref(w_fp8)


class _Lease:
    """Holds a graph from a forward until its backward ran or its autograd graph is gone (the
    graph's buffers hold that micro-batch's activations). The graph keeps a weak reference: a
    forward whose backward never comes (its output dropped, an evaluation with gradients on)
    frees the graph when its autograd graph goes."""

    __slots__ = ("graph", "__weakref__")

    def __init__(self, graph: LinearGraph) -> None:
        self.graph = graph
        graph.lease = weakref.ref(self)

    def release(self) -> None:
        lease = self.graph.lease
        if lease is not None and lease() is self:  # not a later forward's
            self.graph.lease = None

    def __del__(self) -> None:
        self.release()


class GraphedLinear(torch.autograd.Function):
    """A captured linear, replayed: the same outputs and gradients as the eager call."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                w_fp8: QuantizedTensor, g: LinearGraph) -> torch.Tensor:
        assert g.x_s is not None and g.y_s is not None
        if g.x_shared is not None:
            take(g.x_shared, x.device)
        g.x_s.copy_(x)
        g.load_weight(w_fp8)
        g.fwd.replay()
        _replay_records(g.fwd_gemms)
        paths.note("graphed linear")
        g.epoch += 1
        ctx.lease, ctx.weight, ctx.epoch = _Lease(g), weight, g.epoch
        # x a view of a leaf: the view's backward hands the leaf a fresh view of the static dx,
        # which autograd would adopt as its .grad (the next replay would overwrite it): a copy
        ctx.copy_dx = x._base is not None and x._base.requires_grad and x._base.grad_fn is None
        out = g.y_s.detach()
        g.out = weakref.ref(out)
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        lease: _Lease = ctx.lease
        g = lease.graph
        assert g.dy_s is not None
        if ctx.epoch != g.epoch:  # (retain_graph=True, then another forward replayed over its activations)
            raise RuntimeError(f"megatron_fp8: {g.owner}: a backward through a CUDA-graphed forward after a later "
                               f"forward replayed the same graph (its buffers hold the later micro-batch now); "
                               f"with retain_graph=True run the backwards before the next forward, or set {ENV}=0")
        if g.dy_shared is not None:
            take(g.dy_shared, dy.device)
        g.dy_s.copy_(dy)
        g.bwd.replay()
        _replay_records(g.bwd_gemms)
        lease.release()
        dx, dw, db = g.grad_out
        if dx is not None and ctx.copy_dx:
            dx = dx.clone()
        if g.fused and g.wants[1] and hasattr(ctx.weight, "grad_added_to_main_grad"):
            from .linear import added_to_main_grad  # (ops.linear imports this module)

            # the flag, and a dummy grad of its own, as the eager fused wgrad hands them (ops.linear):
            # autograd adopts a fresh tensor, where it would copy the graph's (a weight-sized copy a call)
            dw = added_to_main_grad(ctx.weight)
        return dx, dw, db, None, None


def _replay_records(calls: list[gemm_mod.GemmCall]) -> None:
    """Tell open ``record_gemms()`` blocks about the GEMMs a replay ran (the capture recorded them
    once, hidden from them: ``_isolated``)."""
    if gemm_mod._state.records:
        for c in calls:
            gemm_mod.record(c.name, c.backend, c.layouts, c.mnk)


@contextlib.contextmanager
def _isolated() -> Iterator[list[gemm_mod.GemmCall]]:
    """The GEMMs recorded inside the block, kept from every open ``record_gemms()`` and path
    count (a capture runs no GEMM: its replays are what count)."""
    outer, opened = gemm_mod._state.records, list(paths._open)
    calls: list[gemm_mod.GemmCall] = []
    gemm_mod._state.records = [calls]
    paths._open.clear()
    try:
        yield calls
    finally:
        gemm_mod._state.records = outer
        paths._open[:] = opened


@contextlib.contextmanager
def _scratch_main_grad(weight: torch.Tensor) -> Iterator[None]:
    """Warm-up calls add their wgrad into a scratch ``main_grad``, not the real one (Megatron's
    gradient-accumulation fusion): ``_aliases`` hands the scratch one on. (The flag a fused wgrad
    sets, ``grad_added_to_main_grad``, lands on the aliases, never on the weight.)"""
    real = getattr(weight, "main_grad", None)
    if real is not None:
        weight.main_grad = torch.zeros_like(real)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if real is not None:
            weight.main_grad = real  # type: ignore[attr-defined]


def _static_input(x: torch.Tensor) -> torch.Tensor:
    """The graph's static input: ``x``'s values, shape and strides in a leaf of its own that needs a
    gradient where ``x`` does. A copy made with autograd on was no leaf: a node on the caller's
    stream (copy_'s backward) linked it to the caller's graph, the captured backward reached that
    node, and the engine's stream sync with it left the capture (CUDA: "operation would make the
    legacy stream depend on a capturing blocking stream"; every process's first capture failed so
    in runs AI, AV, AW, and the retry, made on the capture stream, held). It also kept the
    caller's first micro-batch's autograd graph alive in the capture's."""
    x_s = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    with torch.no_grad():
        x_s.copy_(x)
    return x_s.requires_grad_(x.requires_grad)


def _nodes(y: torch.Tensor) -> Iterator[Any]:
    """Every node of ``y``'s autograd graph, once each."""
    seen: set[int] = set()
    stack = [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(n for n, _ in node.next_functions)


def _saves(y: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``y``'s autograd graph saved a tensor on ``x``'s storage for backward (a custom
    function's ``saved_tensors``, a built-in node's ``_saved_*`` tensors); True where a node's
    saves cannot be read."""
    storage = x.untyped_storage().data_ptr()
    for node in _nodes(y):
        try:
            saved: list[Any] = list(node.saved_tensors) if hasattr(node, "saved_tensors") else []
            saved += [getattr(node, a) for a in dir(node) if a.startswith("_saved_")]
        except RuntimeError:  # a save it cannot read back: assume x among them (x keeps a buffer of its own)
            return True
        for t in saved:
            for u in t if isinstance(t, (tuple, list)) else (t,):
                if isinstance(u, torch.Tensor) and u.untyped_storage().data_ptr() == storage:
                    return True
    return False


def _static_copy(qt: QuantizedTensor) -> QuantizedTensor:
    """``qt`` with every tensor cloned (same shapes and strides): the graph's own FP8 weight,
    marked parameter-derived as the cast was (the layer's cache points at it: ``load_weight``)."""
    from dataclasses import replace

    from .linear import mark_param_derived  # (ops.linear imports this module)

    def op(o: Any) -> Any:
        return None if o is None else replace(o, data=o.data.clone(), scale_inv=o.scale_inv.clone())
    return mark_param_derived(replace(qt, rowwise=op(qt.rowwise), columnwise=op(qt.columnwise),
                                      scale=qt.scale.clone() if qt.scale is not None else None, cached=False))


_capturing: list[bool] = []  # a capture (or its warm-up) of ours is under way: its calls run eagerly

# What a capture decides differently from an eager call, set for the warm-up so that it runs the
# very kernels the capture records (each built and loaded before the capture: building or loading
# one inside it invalidates the capture): the general path (a capture never takes the lean one),
# and current scaling's amax, scale and CUDA cast (``MEGATRON_FP8_CUDA_CURRENT=capture``).
_CAPTURE_SETTINGS = {"MEGATRON_FP8_LEAN": "0", "MEGATRON_FP8_CUDA_CURRENT": "1"}


def capture_settings() -> dict[str, str]:
    """The settings a capture runs under (``_CAPTURE_SETTINGS``), less one the user pinned
    (``MEGATRON_FP8_CUDA_CURRENT=0``)."""
    pinned = os.environ.get("MEGATRON_FP8_CUDA_CURRENT") not in (None, "capture")
    return {k: v for k, v in _CAPTURE_SETTINGS.items() if not (pinned and k == "MEGATRON_FP8_CUDA_CURRENT")}


@contextlib.contextmanager
def as_captured() -> Iterator[None]:
    """``capture_settings()`` for the warm-up's eager calls; those keys restored after (only
    those: the rest of the environment is left as other code sets it meanwhile)."""
    settings = capture_settings()
    before = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_as_captured() -> dict[str, str]:
    """``capture_settings()`` for the rest of the process: for a caller that captures whole steps
    of ours after eager warm-up steps it does not mark (Megatron-LM's whole-iteration graph), so
    that the warm-up builds and launches the kernels the capture will (a kernel first built
    inside a capture failed it, run AH). Returns what it set."""
    settings = capture_settings()
    os.environ.update(settings)
    return settings


def _recover_rng() -> bool:
    """After a failed capture: a capture that fails leaves CUDA's default random-number generator
    in its capture mode (PyTorch ends that mode only when a capture ends well), and every later
    random op raises ("Offset increment outside graph capture"). A trivial capture that ends well
    ends the mode. Whether it did."""
    try:
        probe = torch.cuda.CUDAGraph()
        with torch.cuda.graph(probe):
            torch.empty(1, device="cuda").zero_()
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - reported by the caller
        return False


def _capture(run: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None, w_fp8: QuantizedTensor, owner: str, fused: bool) -> LinearGraph:
    _capturing.append(True)
    try:
        return _capture_now(run, x, weight, bias, w_fp8, owner, fused)
    finally:
        _capturing.pop()


def _aliases(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Leaves sharing the weight's and bias's storage (Megatron's ``main_grad`` attributes carried
    over): what a capture's (or its warm-up's) autograd graph reaches instead of the parameters.
    Their gradients are taken there, so the capture's backward never reaches the parameters' own
    gradient accumulators, which an earlier eager step made on the default stream (PyTorch warned
    of that stream mismatch in the capture, run AK). With them the warning is gone, but a
    process's first capture still failed once on an H100 and its retry held (run AL): that
    failure had another cause, found since in the static input (``_static_input``)."""
    w = weight.detach().requires_grad_(weight.requires_grad)
    for name in ("main_grad", "grad_added_to_main_grad", "zero_out_wgrad"):  # what the fused wgrad reads
        if hasattr(weight, name):
            setattr(w, name, getattr(weight, name))
    return w, (bias.detach().requires_grad_(bias.requires_grad) if bias is not None else None)


_side: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream every capture of ours on ``device`` warms up and captures on, as
    ``torch.cuda.graph`` keeps one capture stream per process. A new stream per capture cost
    memory: each stream kept its own cuBLASLt workspace (32 MiB) and its warm-ups' GEMM outputs
    stayed allocated; on the H100, 16 dense-1b linears (4096 tokens) kept 8,582 MiB between steps
    with a stream each against 3,746 MiB with one (run AW, scripts/probes/graphs_memory.py).
    So every graph's GEMMs use the side stream's cuBLAS workspaces: two graphs replayed at once on
    two streams would share them, as graphs captured on ``torch.cuda.graph``'s own stream do; the
    layers replay on the caller's stream, one after another."""
    if device not in _side:
        _side[device] = torch.cuda.Stream(device)
    return _side[device]


def _capture_now(run: Callable[..., torch.Tensor], x: torch.Tensor,
                 weight: torch.Tensor, bias: torch.Tensor | None, w_fp8: QuantizedTensor, owner: str,
                 fused: bool) -> LinearGraph:
    before, reserved = torch.cuda.memory_allocated(x.device), torch.cuda.memory_reserved(x.device)
    g = LinearGraph(owner)
    g.fused = fused
    x_s = _static_input(x)
    g.x_s, g.w_s = x_s, _static_copy(w_fp8)
    g.wants = (x.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)

    def inputs(w: torch.Tensor, b: torch.Tensor | None) -> list[torch.Tensor]:
        got = [t for t, want in zip((x_s, w, b), g.wants, strict=True) if want]
        assert all(t is not None for t in got)
        return got

    side = _side_stream(x.device)
    side.wait_stream(torch.cuda.current_stream())
    with _isolated(), _scratch_main_grad(weight), as_captured(), torch.cuda.stream(side):
        for warm_up in range(2):  # Triton compiles, NVRTC builds, cuBLAS handles and workspaces, caches
            w, b = _aliases(weight, bias)
            y = run(x_s, g.w_s, w, b)
            if warm_up == 0:  # backward reads x (save_original_input): the input stays the graph's own
                keeps_x = _saves(y, x_s)
            torch.autograd.grad(y, inputs(w, b), y, allow_unused=True)
        del y, w, b  # the warm-ups' outputs are not kept through the captures
    torch.cuda.current_stream().wait_stream(side)
    if not keeps_x:  # read by the forward's replay alone: one buffer for every graph of this signature
        g.x_shared = shared_input("x", x)  # (the capture runs nothing: the first replay copies x in)
        x_s = g.x_s = g.x_shared.view(x)
    pool = torch.cuda.graph_pool_handle()  # this layer's own: no other graph reuses its buffers
    with _isolated() as fwd_gemms, torch.cuda.graph(g.fwd, pool=pool, stream=side,
                                                        capture_error_mode="thread_local"):
        w, b = _aliases(weight, bias)
        g.y_s = run(x_s, g.w_s, w, b)
    g.dy_shared = shared_input("dy", g.y_s)  # read by the backward's replay alone
    g.dy_s = g.dy_shared.buffer.detach()  # needs no gradient (a copy into it under create_graph)
    with _isolated() as bwd_gemms, torch.cuda.graph(g.bwd, pool=pool, stream=side, capture_error_mode="thread_local"):
        got = iter(torch.autograd.grad(g.y_s, inputs(w, b), g.dy_s, retain_graph=True, allow_unused=True))
        grads = [next(got) if w else None for w in g.wants]
    # backward hands autograd these same objects every time: held here too, autograd never takes
    # one as a leaf's .grad or an accumulation buffer (it copies), so no replay overwrites a gradient
    g.grad_out = tuple(t.detach() if t is not None else None for t in grads)
    g.fwd_gemms, g.bwd_gemms = list(fwd_gemms), list(bwd_gemms)
    _drop_quantizers(g.y_s)
    g.y_uses = _uses(g.y_s)
    g.held = count_held(g, pool, x.device, before)
    g.reserved = torch.cuda.memory_reserved(x.device) - reserved
    note_held(g)
    return g


def _uses(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (torch's count of references to it), or 0 where
    this torch cannot say."""
    try:
        return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))
    except (AttributeError, RuntimeError, TypeError):
        return 0


def _drop_quantizers(y: torch.Tensor) -> None:
    """Clear the layer's quantizers from the autograd nodes of the captured call, which the graph
    keeps (through its static output) only for the tensors they saved: the quantizers keep the
    graph (``graph_for``), so otherwise only Python's cyclic collector, which Megatron-LM's
    ``--manual-gc`` runs rarely, would free a dropped layer's graphs and their pool."""
    for node in _nodes(y):
        if getattr(node, "quantizers", None) is not None:
            node.quantizers = None


def _new_graph(run: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None, w_fp8: QuantizedTensor, q: Any, fused: bool, comm: Any,
               held: int) -> LinearGraph | None:
    """A new signature's graph, or None (warned once, naming the layer and why) where it runs eagerly."""
    why = _not_graphable(x, weight, bias, w_fp8, q, comm)
    if why is None and held >= _MAX_SIGNATURES:
        why = f"it holds graphs for {_MAX_SIGNATURES} input shapes already"
    if why is not None:
        _warn_once(_owner(q), why)
        return None
    caller = torch.cuda.current_stream(x.device) if x.is_cuda else None
    try:
        return _capture_tried_twice(run, x, weight, bias, w_fp8, q, fused)
    finally:  # torch.cuda.graph's exit leaves its capture stream current when capture_end raises
        if caller is not None and torch.cuda.current_stream(x.device) != caller:
            torch.cuda.set_stream(caller)


def _capture_tried_twice(run: Callable[..., torch.Tensor], x: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor | None, w_fp8: QuantizedTensor, q: Any,
                         fused: bool) -> LinearGraph | None:
    """``_capture``, tried once more where it fails (a process's first capture failed once on the
    H100 and the second held, runs AI-AW; the second ran on the stream the failed capture left
    current, as it does here: ``_new_graph`` restores the caller's afterwards). Since the cause
    was found (``_static_input``) no capture failed (run AX, nine Megatron-LM processes)."""
    first = None
    for attempt in range(2):
        try:
            g = _capture(run, x, weight, bias, w_fp8, _owner(q), fused)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - a call the graph cannot hold: eager from now on
            inner = exc.__context__
            if isinstance(inner, torch.OutOfMemoryError) or (inner is not None and not isinstance(inner, Exception)):
                _recover_rng()  # (a caller that goes on after it draws random numbers again)
                raise inner from exc  # out of memory, or an interrupt, inside the capture: not the capture's fault
            said = _failure(exc) if first is None else f"{first}; then {_failure(exc)}"
            if not _recover_rng():
                raise RuntimeError(f"megatron_fp8: {_owner(q)}: the CUDA-graph capture of its forward and backward "
                                   f"failed ({said}), and CUDA's random-number generator could not be taken out of "
                                   f"capture mode after it, so this process cannot go on; set {ENV}=0") from exc
            if attempt == 0:
                first = said  # reported below, where the second attempt succeeds
                continue
            _warn_once(_owner(q), f"its capture failed twice ({said})")
            return None
        if first is not None and not _retried:
            _retried.append(_owner(q))
            warnings.warn(f"megatron_fp8: {_owner(q)}: its first CUDA-graph capture failed ({first}); a second "
                          "succeeded (said once per process)", RuntimeWarning, stacklevel=5)
        return g
    return None


_retried: list[str] = []  # the layer whose capture succeeded only at the second attempt (said once)


def _failure(exc: BaseException) -> str:
    """What a failed capture raised: the error inside the capture (which capture_end's error hides)
    and where, then capture_end's."""
    cause = exc.__context__ or exc
    said = f"{type(cause).__name__}: {str(cause).splitlines()[0][:300] if str(cause) else ''}{_where(cause)}"
    if cause is not exc:
        said += f"; then {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return said


def _where(exc: BaseException) -> str:
    """`` at <file>:<line> (<function>)`` of the frame that raised ``exc``, and of the last of
    ours on the way where that is another's (a CUDA error inside a capture names no call)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    said = [f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} ({frames[-1].name})"]
    ours = [f for f in frames if f"{os.sep}megatron_fp8{os.sep}" in f.filename]
    if ours and ours[-1] is not frames[-1]:
        said.append(f"from {os.path.basename(ours[-1].filename)}:{ours[-1].lineno} ({ours[-1].name})")
    return " at " + " ".join(said)


def graph_for(run: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None, w_fp8: QuantizedTensor, q: Any, soi: bool, fused: bool,
              comm: Any) -> LinearGraph | None:
    """The layer's graph for this call (captured at its first call), or None where the call runs
    eagerly (graphs off, a capture under way, a reason ``_not_graphable`` names, the graph held by
    a micro-batch whose backward is still to come). ``run(x, w_fp8)``: the layer's eager call,
    which the graph captures; ``soi``, ``fused``: the call's ``save_original_input`` and wgrad fusion."""
    if _capturing or not torch.is_grad_enabled() or not graphs_on():
        return None
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # the caller's own capture
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        _warn_once(_owner(q), "torch.autocast is on")
        return None
    graphs: dict[tuple[Any, ...], LinearGraph | None] = q.__dict__.setdefault("_graphs", {})
    main_grad = getattr(weight, "main_grad", None) if fused else None
    key = (x.shape, x.stride(), x.dtype, x.device, x.requires_grad, weight.data_ptr(), weight.requires_grad,
           None if bias is None else (bias.data_ptr(), bias.requires_grad),
           None if main_grad is None else main_grad.data_ptr(), fused, getattr(q.input, "group", None),
           getattr(q.grad_output, "group", None), comm, soi, routes.settings())
    g = graphs.get(key, False)
    if g is False:  # the first call of this signature: graphable, and captured, or run eagerly from now on
        g = graphs[key] = _new_graph(run, x, weight, bias, w_fp8, q, fused, comm,
                                     sum(v is not None for v in graphs.values()))
    if g is None:
        return None
    if g.lease is not None and g.lease() is not None:
        _warn_once(g.owner, "a second micro-batch's forward came before the first one's backward (its graph "
                   "holds one micro-batch)")
        return None
    if _foreign_saved_tensor_hooks():
        _warn_once(g.owner, "a saved-tensor hook is active (non-reentrant activation checkpointing or offloading): "
                   "a replay cannot save through it")
        return None
    if g.y_uses and not _outputs_released(g):
        _warn_once(g.owner, "an earlier call's output is still alive through views of it (e.g. y.detach() kept past "
                   "its backward), which a replay would overwrite; clone what you keep")
        return None
    return g


def _outputs_released(g: LinearGraph) -> bool:
    """Whether no tensor of an earlier call still shares the static output, which the next replay
    overwrites. The last output itself alone (a loop's variable that its next call reassigns)
    is given a copy of its own values, one copy; any other tensor on it (``y.detach()`` kept)
    makes the call run eagerly."""
    uses = _uses(g.y_s)
    if uses <= g.y_uses:
        return True
    last = g.out() if g.out is not None else None
    if last is None or uses != g.y_uses + 1:
        return False
    last.data = last.data.clone()
    return True
