"""Hostile input and faults (the hostile-input issue's cases): each asserts the behaviour that
replaced a silent wrong number, a hang or lost state.

* recipe values that cannot give a finite, non-zero cast of a normal tensor are refused, naming
  the field and its range;
* corrupt or mismatched FP8 state is refused at ``load_state_dict``, naming the layer and key,
  and a checkpoint of another recipe is refused at every forward until the recipe matches
  (the loaded state is kept meanwhile);
* a delayed-scaling layer saved after N = 1, 2, 5 steps and loaded in a fresh process makes the
  next step bitwise as the uninterrupted run (every recipe), and so does a TP=2 pair through
  ``state_dict`` and megatron-core's ``dist_checkpointing``;
* integer input with FP8 off raises as ``nn.Linear`` does; ``m_splits`` given as None or as
  NumPy ints; an empty YAML and a key given twice; ``nn.Linear``'s state_dict into ``Linear``;
* tensor-parallel ranks that disagree on the recipe, on FP8 on/off or on their sequence shard's
  length raise on every rank, naming each rank's value (``dist_workers/hostile_worker.py``).

Non-finite values (the contract's "must surface" section): ``tests/test_nonfinite.py`` (the
reference path and layers), ``tests/test_nonfinite_kernels.py`` (the Triton casts) and, for a
NaN on one tensor-parallel rank, ``dist_workers/hostile_worker.py``.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import megatron_fp8 as mf
from megatron_fp8.config import load_config
from megatron_fp8.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
)
from tests.dist_workers.launch import run_workers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- recipe values ----
@pytest.mark.parametrize("make, field", [
    (lambda: DelayedScaling(margin=200), "margin"),
    (lambda: DelayedScaling(margin=2000), "margin"),
    (lambda: DelayedScaling(margin=17), "margin"),
    (lambda: DelayedScaling(amax_history_len=10**7), "amax_history_len"),
    (lambda: Float8CurrentScaling(amax_epsilon=1e30), "amax_epsilon"),
    (lambda: Float8CurrentScaling(amax_epsilon=float("inf")), "amax_epsilon"),
    (lambda: Float8CurrentScaling(amax_epsilon=float("nan")), "amax_epsilon"),
    (lambda: Float8BlockScaling(amax_epsilon=2.0), "amax_epsilon"),
])
def test_degenerate_recipe_values_are_refused(make: object, field: str) -> None:
    with pytest.raises(ValueError, match=rf"\.{field}=.* allowed: .*\[") as e:
        make()  # type: ignore[operator]
    assert field in str(e.value)


def test_the_largest_allowed_values_still_cast_a_normal_tensor_to_nonzero() -> None:
    x = torch.randn(128, 256)
    for recipe in (DelayedScaling(margin=16, amax_history_len=1), Float8CurrentScaling(amax_epsilon=1.0)):
        layer = mf.Linear(256, 128)
        for _ in range(2):  # delayed: the second step casts with the history's scale
            with mf.fp8_autocast(fp8_recipe=recipe):
                y = layer(x)
        assert torch.isfinite(y).all() and y.abs().sum() > 0, recipe


# ---- FP8 state ----
def _delayed_layer_with_state() -> tuple[mf.Linear, dict]:
    torch.manual_seed(0)
    layer = mf.Linear(256, 128, name="decoder.layers.3.mlp.linear_fc2")
    for _ in range(2):
        with mf.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=8)):
            layer(torch.randn(128, 256, requires_grad=True)).sum().backward()
    return layer, layer.state_dict()


def _with_state(sd: dict, edit: object) -> dict:
    state = torch.load(io.BytesIO(sd["_extra_state"].numpy().tobytes()), weights_only=True)
    edit(state)  # type: ignore[operator]
    buf = io.BytesIO()
    torch.save(state, buf)
    return {**sd, "_extra_state": torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)}


def _set(state: dict, role: str, key: str, value: torch.Tensor) -> None:
    state["quantizers"]["weight"][role][key] = value


@pytest.mark.parametrize("edit, match", [
    (lambda s: _set(s, "input", "scale", torch.tensor(float("nan"))), "scale=nan"),
    (lambda s: _set(s, "weight", "scale", torch.tensor(0.0)), "scale=0.0"),
    (lambda s: _set(s, "grad_output", "scale", torch.tensor(-2.0)), "scale=-2.0"),
    (lambda s: _set(s, "input", "amax_history", torch.full((8,), float("nan"))), "non-finite or negative"),
    (lambda s: _set(s, "input", "amax_history", torch.full((8,), float("inf"))), "non-finite or negative"),
    (lambda s: _set(s, "input", "amax_history", torch.zeros(2, 4)), "1-D"),
    (lambda s: s["quantizers"]["weight"]["input"].pop("scale"), "lacks"),
])
def test_corrupt_fp8_state_is_refused_at_load_naming_layer_and_key(edit: object, match: str) -> None:
    _, sd = _delayed_layer_with_state()
    fresh = mf.Linear(256, 128, name="decoder.layers.3.mlp.linear_fc2")
    with pytest.raises(ValueError, match=match) as e:
        fresh.load_state_dict(_with_state(sd, edit))
    assert "Linear(decoder.layers.3.mlp.linear_fc2)" in str(e.value) and "'_extra_state'" in str(e.value)


def test_garbage_extra_state_is_refused() -> None:
    _, sd = _delayed_layer_with_state()
    with pytest.raises(ValueError, match="not megatron_fp8 FP8 state"):
        mf.Linear(256, 128).load_state_dict({**sd, "_extra_state": torch.arange(10, dtype=torch.uint8)})


def test_wrong_history_length_is_refused_at_the_first_forward_and_the_state_kept() -> None:
    _, sd = _delayed_layer_with_state()
    layer = mf.Linear(256, 128)
    layer.load_state_dict(sd)
    for _ in range(2):
        with pytest.raises(ValueError, match="amax_history_len=8.*run it under the checkpoint's recipe"):
            with mf.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=16)):
                layer(torch.randn(128, 256))
    with mf.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=8)):
        layer(torch.randn(128, 256))
    assert layer._quantizers["weight"].input.amax_history.shape == (8,)


def test_nn_linear_state_dict_loads_into_linear_like_into_the_parallel_layers() -> None:
    ref = torch.nn.Linear(256, 128)
    layer = mf.Linear(256, 128)
    layer.load_state_dict(ref.state_dict())  # no _extra_state: FP8 state starts fresh
    assert torch.equal(layer.weight, ref.weight) and torch.equal(layer.bias, ref.bias)


_RESUME = textwrap.dedent("""
    import sys, torch, megatron_fp8 as mf
    from megatron_fp8.recipe import PRESETS
    RECIPES = {"delayed8": mf.recipe.DelayedScaling(amax_history_len=8), "current": PRESETS["current"],
               "blockwise": PRESETS["blockwise"], "mxfp8": PRESETS["mxfp8"]}  # delayed first: see the test
    mode, path = sys.argv[1], sys.argv[2]
    def batch(i):
        g = torch.Generator().manual_seed(100 + i)
        return torch.randn(128, 256, generator=g) * (1 + i), torch.randn(128, 128, generator=g)
    def step(layer, recipe, i):
        x, dy = batch(i)
        x.requires_grad_()
        with mf.fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
        y.backward(dy)
        out = torch.cat([y.detach().flatten(), x.grad.flatten(), layer.weight.grad.flatten()])
        layer.zero_grad()
        return out
    def fresh():
        torch.manual_seed(0)
        return mf.Linear(256, 128)
    if mode == "save":  # one uninterrupted run per recipe: checkpoints after steps 1, 2, 5 and the step after
        for name, recipe in RECIPES.items():
            layer = fresh()
            for i in range(6):
                if i in (1, 2, 5):
                    torch.save(layer.state_dict(), f"{path}-{name}-{i}.ckpt")
                out = step(layer, recipe, i)
                if i in (1, 2, 5):
                    torch.save(out, f"{path}-{name}-{i}.want")
    else:  # a fresh process per N; its first FP8 step is the delayed layer's
        n = int(mode)
        for name, recipe in RECIPES.items():
            layer = fresh()
            layer.load_state_dict(torch.load(f"{path}-{name}-{n}.ckpt"))
            torch.save(step(layer, recipe, n), f"{path}-{name}-{n}.got")
""")


def test_resume_in_a_fresh_process_is_bitwise(tmp_path: os.PathLike[str]) -> None:
    """Saved after N = 1, 2, 5 FP8 steps, loaded in a new process: the next step (out, dx, dw) is
    the uninterrupted run's, bitwise, for every recipe. (After one step the saved step count used
    to equal the new process's count, so the history was not rolled.)"""
    script = os.path.join(tmp_path, "resume.py")
    with open(script, "w") as f:
        f.write(_RESUME)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    path = os.path.join(tmp_path, "run")
    for mode in ("save", "1", "2", "5"):
        subprocess.run([sys.executable, script, mode, path], check=True, env=env, timeout=120)
    for name in ("delayed8", "current", "blockwise", "mxfp8"):
        for n in (1, 2, 5):
            want, got = torch.load(f"{path}-{name}-{n}.want"), torch.load(f"{path}-{name}-{n}.got")
            assert torch.equal(got, want), f"{name}: the step after resuming from step {n} differs"


@pytest.mark.distributed
@pytest.mark.megatron
def test_tp_pair_resumes_exactly_in_fresh_processes(tmp_path: os.PathLike[str]) -> None:
    """A TP=2 column (SP) -> row pair under delayed scaling, saved after steps 1, 2, 5 (state_dict
    per rank, and megatron-core's dist_checkpointing) and loaded in new torchrun processes: the
    next step's output, input grad and weight grads bitwise the uninterrupted run's
    (``dist_workers/resume_worker.py``)."""
    pytest.importorskip("megatron.core")
    run_workers("resume_worker.py", 2, "save", str(tmp_path), timeout=180).fail_if_broken()
    for n in (1, 2, 5):  # each from a fresh process
        report = run_workers("resume_worker.py", 2, "load", str(n), str(tmp_path), timeout=180).fail_if_broken()
        assert report["counts"]["resume"] == 2 * report["world"] and report["failures"] == 0


# ---- inputs ----
def test_integer_input_raises_as_nn_linear_does() -> None:
    x = torch.randint(0, 5, (8, 64))
    with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype"):
        torch.nn.Linear(64, 32)(x)
    with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype"):
        mf.Linear(64, 32)(x)
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        mf.GroupedLinear(2, 64, 32)(x, [4, 4])


def test_m_splits_none_and_numpy_ints() -> None:
    layer = mf.GroupedLinear(3, 32, 16, name="mlp.experts.linear_fc1")
    x = torch.randn(7, 32)
    with pytest.raises(TypeError, match=r"linear_fc1.*m_splits=None.*list of 3 ints"):
        layer(x, None)  # type: ignore[arg-type]
    want = layer(x, [2, 0, 5])
    assert torch.equal(layer(x, [np.int64(2), np.int32(0), np.uint8(5)]), want)
    assert torch.equal(layer(x, np.array([2, 0, 5])), want)
    with pytest.raises(ValueError, match="non-negative ints"):
        layer(x, [2.0, 0, 5])


def test_yaml_empty_file_and_duplicate_keys_are_errors(tmp_path: os.PathLike[str]) -> None:
    cases = {"empty.yaml": ("# only a comment\n", "empty"),
             "dup.yaml": ("fp8:\n  recipe: current\n  recipe: blockwise\n", "'recipe' appears twice"),
             "dup_top.yaml": ("layers: []\nlayers: []\n", "'layers' appears twice")}
    for name, (text, match) in cases.items():
        path = os.path.join(tmp_path, name)
        with open(path, "w") as f:
            f.write(text)
        with pytest.raises(ValueError, match=match):
            load_config(path)


def test_mxfp8_and_blocks_still_load_their_stateless_checkpoints() -> None:
    for recipe in (Float8BlockScaling(), MXFP8BlockScaling(), Float8CurrentScaling()):
        a = mf.Linear(256, 128)
        with mf.fp8_autocast(fp8_recipe=recipe):
            a(torch.randn(128, 256))
        b = mf.Linear(256, 128)
        b.load_state_dict(a.state_dict())
        x = torch.randn(128, 256)
        with mf.fp8_autocast(fp8_recipe=recipe):
            assert torch.equal(a(x), b(x))


# ---- ranks that disagree ----
@pytest.mark.distributed
def test_tensor_parallel_ranks_that_disagree_fail_fast_on_every_rank() -> None:
    report = run_workers("hostile_worker.py", 2, timeout=120).fail_if_broken()
    assert report["counts"]["disagree"] == 4 * report["world"]  # four cases, an error on every rank
    assert report["counts"]["agree"] == report["world"]
    assert report["counts"]["nonfinite"] == report["world"]  # a NaN on one rank: the same state on all
    assert report["failures"] == 0
