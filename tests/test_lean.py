"""The lean eager path (ops.lean, ops.routes) against the general one: the same bits, the same
saved tensors, the same errors; plans only where they apply, a new plan for new settings, and a
failing route warned about and left for the general path.

On CPU the plans run with ``MEGATRON_FP8_LEAN=1`` (their routes are the general calls there, so
this checks the autograd function and the plan's bookkeeping); under ``TRITON_INTERPRET=1`` the
block and delayed casts take their fast (Triton) routes too. tests/test_lean_gpu.py checks the
fast routes on the GPU.
"""

from __future__ import annotations

import itertools
import os
import warnings

import pytest
import torch

import megatron_fp8 as mf
from megatron_fp8 import memory
from megatron_fp8.ops import lean, routes
from megatron_fp8.recipe import PRESETS, Float8BlockScaling, Format

RECIPES = {**{k: PRESETS[k] for k in ("current", "blockwise", "delayed", "mxfp8")},
           "blockwise-hybrid": Float8BlockScaling(fp8_format=Format.HYBRID)}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _steps(monkeypatch: pytest.MonkeyPatch, lean_on: str, recipe: object, soi: bool, bias: bool, fuse: bool,
           tokens: int = 128, steps: int = 2) -> tuple[list[torch.Tensor], mf.Linear]:
    """Two fwd+bwd steps of a fresh layer (same seed): outputs and every gradient."""
    monkeypatch.setenv("MEGATRON_FP8_LEAN", lean_on)
    torch.manual_seed(1)
    layer = mf.Linear(256, 128, bias=bias, params_dtype=torch.bfloat16, save_original_input=soi,
                      fuse_wgrad_accumulation=fuse, name="proj")
    if fuse:
        layer.weight.main_grad = torch.zeros(128, 256)
    x = torch.randn(2, tokens // 2, 256, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, tokens // 2, 128, dtype=torch.bfloat16)
    out: list[torch.Tensor] = []
    for _ in range(steps):
        with mf.fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
        y.backward(dy)
        out += [y.detach().clone(), x.grad.clone(), (layer.weight.main_grad if fuse else layer.weight.grad).clone()]
        if bias:
            out.append(layer.bias.grad.clone())
    return out, layer


@pytest.mark.parametrize("recipe", RECIPES)
def test_lean_equals_general_bitwise(monkeypatch: pytest.MonkeyPatch, recipe: str) -> None:
    for soi, bias, fuse in itertools.product((False, True), repeat=3):
        general, _ = _steps(monkeypatch, "0", RECIPES[recipe], soi, bias, fuse)
        planned, layer = _steps(monkeypatch, "1", RECIPES[recipe], soi, bias, fuse)
        assert len(general) == len(planned)
        for a, b in zip(general, planned):
            assert torch.equal(a, b), (recipe, soi, bias, fuse)
        plans = [p for p in layer._quantizers["weight"].__dict__["_plans"].values() if p is not None]
        assert len(plans) == 1 and plans[0].proven


@pytest.mark.parametrize("recipe", ["current", "blockwise", "delayed"])
@pytest.mark.parametrize("soi", [False, True])
def test_lean_saves_what_the_general_path_saves(monkeypatch: pytest.MonkeyPatch, recipe: str, soi: bool) -> None:
    counted = {}
    for lean_on in ("0", "1"):
        monkeypatch.setenv("MEGATRON_FP8_LEAN", lean_on)
        torch.manual_seed(0)
        layer = mf.Linear(256, 128, bias=False, params_dtype=torch.bfloat16, save_original_input=soi)
        x = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
        with memory.track_saved_tensors(layer) as saved, mf.fp8_autocast(fp8_recipe=RECIPES[recipe]):
            y = layer(x)
        counted[lean_on] = (saved.activation_bytes, saved.parameter_bytes, type(y.grad_fn).__name__)
    assert counted["0"][:2] == counted["1"][:2]
    assert counted["0"][2] == "_LinearBackward" and counted["1"][2] == "LeanLinearBackward"


def test_plans_only_where_they_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_FP8_LEAN", "1")
    layer = mf.Linear(256, 128, bias=False, params_dtype=torch.bfloat16)
    with mf.fp8_autocast(fp8_recipe=PRESETS["blockwise"]):
        padded = layer(torch.randn(17, 256, dtype=torch.bfloat16, requires_grad=True))  # tokens padded to 128
        planned = layer(torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True))
    assert type(padded.grad_fn).__name__ != "LeanLinearBackward"
    assert type(planned.grad_fn).__name__ == "LeanLinearBackward"
    monkeypatch.setenv("MEGATRON_FP8_LEAN", "auto")  # the default: CUDA inputs only
    with mf.fp8_autocast(fp8_recipe=PRESETS["blockwise"]):
        y = layer(torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True))
    assert type(y.grad_fn).__name__ == "_LinearBackward"


def test_a_changed_setting_makes_a_new_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_FP8_LEAN", "1")
    layer = mf.Linear(256, 128, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    with mf.fp8_autocast(fp8_recipe=PRESETS["current"]):
        layer(x)
        layer(x)
        plans = layer._quantizers["weight"].__dict__["_plans"]
        assert len(plans) == 1
        monkeypatch.setenv("MEGATRON_FP8_GEMM_BACKEND", "emulate")
        layer(x)
        assert len(plans) == 2
        with mf.gemm.force_backend("emulate"):  # gemm's own pin is a setting too
            layer(x)
        assert len(plans) == 3


def test_bad_lean_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_FP8_LEAN", "fast")
    layer = mf.Linear(256, 128, bias=False, params_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="MEGATRON_FP8_LEAN='fast'"), mf.fp8_autocast():
        layer(torch.randn(128, 256, dtype=torch.bfloat16))


def test_a_failing_route_warns_and_the_general_path_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    reference, _ = _steps(monkeypatch, "0", PRESETS["current"], False, True, False, steps=1)

    def refused(*args: object, **kwargs: object) -> object:
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(routes, "gemm_route", refused)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback, layer = _steps(monkeypatch, "1", PRESETS["current"], False, True, False, steps=1)
    said = [str(w.message) for w in caught if "lean FP8 path failed" in str(w.message)]
    assert len(said) == 1 and "Linear(proj)" in said[0] and "no kernel for this shape" in said[0]
    assert all(torch.equal(a, b) for a, b in zip(reference, fallback))
    assert list(layer._quantizers["weight"].__dict__["_plans"].values()) == [None]


def test_forwards_are_counted_by_the_path_that_served_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ops.paths.count_paths``: what ``megatron.launch --count-gemms`` reports, proof that a
    training loop took the lean path; a lean forward that failed counts as the general one."""
    from megatron_fp8.ops import paths

    with paths.count_paths() as counts:
        _steps(monkeypatch, "1", PRESETS["current"], False, True, False)
        _steps(monkeypatch, "0", PRESETS["blockwise"], True, False, False, steps=1)
        mf.Linear(256, 128, params_dtype=torch.bfloat16)(torch.randn(4, 256, dtype=torch.bfloat16))  # FP8 off
    assert counts == {"lean linear": 2, "general linear": 1}
    monkeypatch.setattr(routes, "gemm_route", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no kernel")))
    with warnings.catch_warnings(), paths.count_paths() as counts:
        warnings.simplefilter("ignore")
        _steps(monkeypatch, "1", PRESETS["current"], False, False, False, steps=1)
    assert counts == {"general linear": 1}
    paths.note("lean linear")  # no count open: nothing kept
    assert counts == {"general linear": 1}


def test_a_failing_backward_route_warns_and_the_general_calls_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A route that fails in the plan's first backward (made there: dy's cast, dgrad, wgrad) is
    replaced by the general call, and the gradients are the general path's."""
    reference, _ = _steps(monkeypatch, "0", PRESETS["delayed"], False, True, True)
    made = routes.gemm_route

    def refuses_dgrad(name: str, *args: object, **kwargs: object) -> object:
        if name == "dgrad":
            def run(*_: object) -> object:
                raise RuntimeError("dgrad kernel refused")
            return run
        return made(name, *args, **kwargs)

    monkeypatch.setattr(routes, "gemm_route", refuses_dgrad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planned, layer = _steps(monkeypatch, "1", PRESETS["delayed"], False, True, True)
    said = [str(w.message) for w in caught if "lean FP8 path failed in backward" in str(w.message)]
    assert len(said) == 1 and "Linear(proj)" in said[0] and "dgrad kernel refused" in said[0]
    assert all(torch.equal(a, b) for a, b in zip(reference, planned))  # main_grad added once per step
    plan = next(p for p in layer._quantizers["weight"].__dict__["_plans"].values() if p is not None)
    assert plan.backward_proven and getattr(plan.dgrad, "general", False)


@pytest.mark.skipif(not INTERPRET, reason="the Triton cast routes run on CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("recipe", ["blockwise", "delayed"])
def test_fast_cast_routes_under_the_interpreter(monkeypatch: pytest.MonkeyPatch, recipe: str) -> None:
    steps = 2 if recipe == "delayed" else 1  # the second step casts with the rolled history's scales
    general, _ = _steps(monkeypatch, "0", RECIPES[recipe], False, False, False, steps=steps)
    planned, layer = _steps(monkeypatch, "1", RECIPES[recipe], False, False, False, steps=steps)
    assert all(torch.equal(a, b) for a, b in zip(general, planned))
    plan = next(p for p in layer._quantizers["weight"].__dict__["_plans"].values() if p is not None)
    assert not getattr(plan.cast_x, "general", False) and not getattr(plan.dy_route, "general", False)


def test_lean_mode_default_is_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEGATRON_FP8_LEAN", raising=False)
    assert lean.lean_mode() == "auto"


def test_copies_and_pickles_make_their_own_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans and routes hold their quantizers by reference: a deep copy leaves them out (else the
    copy's steps would update the original's delayed-scaling history), and the layer pickles."""
    import copy
    import io

    monkeypatch.setenv("MEGATRON_FP8_LEAN", "1")
    recipe = PRESETS["delayed"]
    layer = mf.Linear(256, 128, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    with mf.fp8_autocast(fp8_recipe=recipe):
        layer(x)
    twin = copy.deepcopy(layer)
    before = layer._quantizers["weight"].input.amax_history.clone()
    with mf.fp8_autocast(fp8_recipe=recipe):
        twin(x * 4)
    assert torch.equal(layer._quantizers["weight"].input.amax_history, before)
    assert not torch.equal(twin._quantizers["weight"].input.amax_history, before)
    assert "_plans" in twin._quantizers["weight"].__dict__  # its own, made at its first call
    torch.save(layer, io.BytesIO())


def test_dtypes_a_cast_refuses_raise_the_general_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float64 weight (which no FP8 cast takes) raises the general path's TypeError, also where
    the fast cast routes exist (under the interpreter: they decline it)."""
    monkeypatch.setenv("MEGATRON_FP8_LEAN", "1")
    layer = mf.Linear(256, 128, bias=False, params_dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"), mf.fp8_autocast(fp8_recipe=PRESETS["blockwise"]):
        layer(torch.randn(128, 256, dtype=torch.float64))


@pytest.mark.distributed
def test_lean_tensor_parallel_layers_equal_the_general_path() -> None:
    """Column / row layers at TP=2, SP on and off, every recipe, the flag on and off: the lean path
    (with the layers' gathers and reductions inside it) gives the general path's bits."""
    from tests.dist_workers.launch import run_workers

    report = run_workers("lean_tp_worker.py", 2).fail_if_broken()
    from tests.conftest import RECIPES as WORKER_RECIPES

    cases = 2 * 2 * len(WORKER_RECIPES) * 2  # kind x SP x recipe x flag
    steps = sum(2 if r == "delayed" else 1 for r in WORKER_RECIPES)
    assert report["counts"]["lean_ran"] == cases * report["world"]
    assert report["counts"]["lean"] == 2 * 2 * 2 * steps * 4 * report["world"]
    assert report["failures"] == 0


class _SaysCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: lets the cuBLASLt routes be built and called on the
    CPU, with cuBLASLt's bound call replaced by a matmul (``_fake_lt``)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _fake_lt(monkeypatch: pytest.MonkeyPatch, kernel: bool = True) -> list[tuple]:
    """cuBLASLt serving every GEMM natively, ``bind`` a stand-in whose bound call computes
    ``out (+)= a @ b.T`` in FP32 (None where ``kernel`` is False); what bind and the bound call
    were handed, in order."""
    from megatron_fp8 import gemm as gemm_mod
    from megatron_fp8.gemm import Backend

    seen: list[tuple] = []

    def bind(a, sa, la, b, sb, lb, out_dtype, fast_accum=False, accumulate=False):  # noqa: ANN001, ANN202
        seen.append(("bind", sa, la, sb, lb, fast_accum, accumulate))

        def bound(a_, sa_, b_, sb_, out):  # noqa: ANN001, ANN202
            seen.append(("call", sa_, sb_))
            y = a_.float() @ b_.float().t()
            out.add_(y.to(out.dtype)) if accumulate else out.copy_(y)
            return True
        return bound if kernel else None
    monkeypatch.setattr(routes.cublaslt, "bind", bind)
    monkeypatch.setattr(routes.cublaslt, "serves", lambda *_a, **_k: True)
    monkeypatch.setattr(gemm_mod, "select_backend", lambda *_a: Backend.NATIVE)
    return seen


@pytest.mark.parametrize("layouts", ["tensor", "blocks", "hybrid blocks"])
def test_cublaslt_routes_hand_it_its_scales_and_record_as_gemm(monkeypatch: pytest.MonkeyPatch, layouts: str) -> None:
    """The GEMM and wgrad-add routes on cuBLASLt's bound call (``routes.gemm_route`` /
    ``accumulate_route``), built and called on the CPU against a stand-in for the call: per-tensor
    scales go to it as they are, block scales laid out as ``gemm.block_scale_layout`` lays them
    (at binding and at every call); the result is the call's; ``record_gemms`` names them as
    ``gemm`` does (``[cublaslt]`` for HYBRID blocks); no kernel for the problem leaves ``gemm``'s route."""
    from megatron_fp8 import gemm as gemm_mod
    from megatron_fp8.quant.formats import ScaleLayout as L
    from megatron_fp8.quant.tensor import Operand

    seen = _fake_lt(monkeypatch)
    m = n = k = 256
    torch.manual_seed(0)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    a_dt = e5m2 if layouts == "hybrid blocks" else e4m3
    a = torch.randn(m, k).to(a_dt).as_subclass(_SaysCuda)
    b = torch.randn(n, k).to(e4m3).as_subclass(_SaysCuda)
    if layouts == "tensor":
        la = lb = L.TENSOR
        sa, sb = torch.tensor(0.5), torch.tensor(2.0)
    else:
        la, lb = L.BLOCK_1x128, L.BLOCK_128x128
        sa, sb = torch.rand(m, k // 128) + 0.5, torch.rand(n // 128, k // 128) + 0.5

    def scale(s: torch.Tensor, layout: L) -> torch.Tensor:
        return s if layout is L.TENSOR else gemm_mod.block_scale_layout(s, layout)

    def same(got: torch.Tensor, s: torch.Tensor, layout: L) -> bool:
        return got is s if layout is L.TENSOR else torch.equal(got, scale(s, layout))

    with gemm_mod.record_gemms() as calls:
        route = routes.gemm_route("fprop", Operand(a, sa, la), Operand(b, sb, lb), torch.bfloat16, True)
        y = route(a, sa, b, sb)
        into = torch.ones(m, n)
        add = routes.accumulate_route("wgrad", Operand(a, sa, la), Operand(b, sb, lb), into)
        assert add(a, sa, b, sb, into) is True
    (_, bsa, bla, bsb, blb, fast, acc), (_, csa, csb) = seen[0], seen[1]
    assert (bla, blb, fast, acc) == (la, lb, la is L.TENSOR, False)
    assert same(bsa, sa, la) and same(bsb, sb, lb) and same(csa, sa, la) and same(csb, sb, lb)
    assert seen[2][6] is True and same(seen[3][1], sa, la) and same(seen[3][2], sb, lb)  # the add's bind, call
    want = a.float() @ b.float().t()
    assert torch.equal(y.float(), want.to(torch.bfloat16).float()) and torch.equal(into, want + 1)
    tag = "[cublaslt]" if layouts == "hybrid blocks" else ""
    assert [(c.name, c.layouts, c.mnk) for c in calls] == [(f"fprop{tag}", (la, lb), (m, n, k)),
                                                          (f"wgrad{tag}", (la, lb), (m, n, k))]
    _fake_lt(monkeypatch, kernel=False)
    assert getattr(routes.gemm_route("fprop", Operand(a, sa, la), Operand(b, sb, lb), torch.bfloat16, True),
                   "general", False)
    assert getattr(routes.accumulate_route("wgrad", Operand(a, sa, la), Operand(b, sb, lb), into), "general", False)
