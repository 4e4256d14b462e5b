"""The Megatron-LM plug-in (``megatron_fp8.megatron.plugin``) and what it relies on.

One torchrun launch (2 ranks, gloo, CPU; ``dist_workers/plugin_worker.py``) builds GPT models
through ``layer_spec`` as Megatron-LM's builders do and trains them with ``config.fp8`` set and
no FP8 region opened by the test (its docstring lists the checks). In process: a layer of ours
under ``config.fp8`` with no region raises; ``is_first_microbatch`` as Megatron's attribute; the
experts' padding; the launcher's usage error. The plug-in itself is only imported in the worker:
it patches megatron-core process-wide.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_fp8 import fp8_autocast
from megatron_fp8.parallel import ColumnParallelLinear
from megatron_fp8.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from tests.dist_workers.launch import worker_report


@pytest.fixture(scope="module")
def report() -> dict:
    pytest.importorskip("megatron.core")
    return worker_report("plugin_worker.py", timeout=400)


@pytest.mark.distributed
@pytest.mark.megatron
def test_both_builder_paths_build_the_same_model(report: dict) -> None:
    # per rank: names, linear count, loss bitwise; the baseline spec
    assert report["counts"]["build"] == 4 * report["world"]
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_our_layers_take_their_module_paths_at_the_first_forward(report: dict) -> None:
    # per rank: every layer of ours is named after its module path (warnings and errors say which layer)
    assert report["counts"]["names"] == report["world"]
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_sequence_parallelism_through_the_plugin(report: dict) -> None:
    # per rank: BF16 and tensorwise dense GPTs at TP=2 with sequence parallelism (norms marked,
    # loss, every gradient against the same model without it; the GEMM count under FP8) and an
    # MoE GPT at TP=2, which megatron-core builds only with sequence parallelism
    per_rank = report["counts"]["sp"] / report["world"]
    assert per_rank >= 2 * (1 + 1 + 5) + 1 + 1
    assert report["max_rel"]["sp"] <= 2e-2
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_megatrons_own_linears_under_fp8_are_named(report: dict) -> None:
    # per rank: the baseline spec's linears named once on rank 0 (none elsewhere), ours never
    assert report["counts"]["warn"] == 5 * report["world"]  # and the hook with two pipeline chunks
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_fp8_gemms_run_under_config_fp8_without_our_region(report: dict) -> None:
    # per rank and recipe (4): the GEMM count and the loss check
    assert report["counts"]["gemms"] == 2 * 4 * report["world"]
    for name in ("delayed/hybrid", "tensorwise/hybrid", "blockwise/hybrid", "mxfp8/e4m3"):
        assert report["max_rel"][f"loss {name}"] <= 2e-3
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_yaml_flags_applied_and_logged_at_the_first_forward(report: dict) -> None:
    # per recipe: the flags on every rank, the printed summary and the flag's cost on rank 0
    assert report["counts"]["yaml"] == 4 * report["world"] + 8
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_layernorm_and_moe_act_recompute_match(report: dict) -> None:
    # the loss and the last layer's MLP side bitwise; the rest within FP8 rounding steps in norm
    # (tests/dist_workers/plugin_worker.py's docstring says why)
    assert report["counts"]["recompute"] > 4 * 2 * 20 * report["world"]
    assert report["max_rel"]["recompute (norm)"] <= 2e-2
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_moe_experts_pad_and_run_fp8(report: dict) -> None:
    # per rank and recipe: container, GEMM count, fc2 flag
    assert report["counts"]["moe"] == 3 * 4 * report["world"]
    assert report["counts"]["errors"] == 3 * report["world"]
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_full_and_module_recompute_under_fp8_without_te(report: dict) -> None:
    # per rank, 3 recipes x (full, mlp: 15 gradients; moe + shared_experts: 33) x (GEMM count, loss,
    # same parameters, every gradient bitwise, amax histories); then full recompute at TP=2 with
    # distributed saved activations, 2 recipes x (loss, parameters and GEMM count, 15 gradients), and a
    # caller's input shrunk in place or kept whole (a view, or handed back): 3 x (elements kept, shape, gradient)
    assert report["counts"]["layers"] == (3 * (2 * (4 + 15) + (4 + 33)) + 2 * (2 + 15) + 3 * 3) * report["world"]
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_gradient_accumulation_fusion_trains_without_apex(report: dict) -> None:
    # per rank and model (tensorwise, FP8 off): built, the output layer unfused on a config copy,
    # the note, our linears fuse, each added into main_grad, the output layer not; then every
    # parameter's main_grad bitwise the unfused model's grad
    assert report["counts"]["fusion"] >= 2 * 2 * 6 * report["world"]  # dense and MoE
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
def test_router_padding_for_quantization_builds_and_trains(report: dict) -> None:
    # per rank: three recipes x (config, splits aligned, FP8 GEMMs and loss), and the refused dispatcher
    assert report["counts"]["padding"] == (3 * 3 + 1) * report["world"]
    assert report["failures"] == 0


# ---- in process ----
def _config(fp8: str | None) -> SimpleNamespace:
    return SimpleNamespace(tensor_model_parallel_size=1, sequence_parallel=False, params_dtype=torch.float32,
                           use_cpu_initialization=True, fp8=fp8)


def test_config_fp8_without_a_region_raises_naming_the_fix() -> None:
    layer = ColumnParallelLinear(64, 64, config=_config("hybrid"), name="decoder.layers.0.mlp.linear_fc1")
    x = torch.randn(16, 64)
    with pytest.raises(RuntimeError, match=r"linear_fc1.*config.fp8='hybrid'.*megatron_fp8.megatron.plugin"):
        layer(x)
    with fp8_autocast(enabled=False):  # an explicit high-precision region is a choice, not an accident
        layer(x)
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        layer(x)
    ColumnParallelLinear(64, 64, config=_config(None))(x)  # FP8 not asked for: high precision


def test_is_first_microbatch_attribute_follows_megatrons_convention() -> None:
    layer = ColumnParallelLinear(64, 64, config=_config(None), bias=False)
    assert layer.is_first_microbatch is None  # Megatron's set_is_first_microbatch finds it by hasattr
    x = torch.randn(16, 64)
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        layer(x)
        assert layer.is_first_microbatch is None and not layer._w_cache  # no reuse unless asked
        layer.is_first_microbatch = True  # what Megatron does at a step's first micro-batch
        y1, _ = layer(x)
        assert layer.is_first_microbatch is False and layer._w_cache
        with torch.no_grad():
            layer.weight.mul_(2.0)
        y2, _ = layer(x)  # a later micro-batch of the same step: the cached FP8 weight
        assert torch.equal(y1, y2)
        layer.is_first_microbatch = True  # the next step casts the updated weight
        y3, _ = layer(x)
        assert not torch.equal(y1, y3)
        y4, _ = layer(x, is_first_microbatch=True)  # an argument wins over the attribute
        assert torch.equal(y3, y4) and layer.is_first_microbatch is False


@pytest.mark.parametrize("recipe, align", [(None, 1), (Float8CurrentScaling(), 16), (DelayedScaling(), 16),
                                           (Float8BlockScaling(), 128), (MXFP8BlockScaling(), 32)])
def test_expert_padding_round_trip(recipe: object, align: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``MEGATRON_FP8_EXPERT_PADDING=outside``: the recipe's alignment, zero rows after each
    expert's, dropped again; the default (``inside``) passes the tokens through (the grouped linears pad)."""
    pytest.importorskip("megatron.core")
    from megatron_fp8.megatron.experts import ExpertPadding, ExpertUnpadding, alignment

    assert alignment(recipe) == align  # type: ignore[arg-type]
    splits = [0, 1, 17, 128, 200]
    x = torch.randn(sum(splits), 8, requires_grad=True)
    def ctx() -> contextlib.AbstractContextManager:
        return fp8_autocast(fp8_recipe=recipe) if recipe is not None else fp8_autocast(enabled=False)

    with ctx():
        same, same_splits = ExpertPadding()(x, splits)
        assert same is x and same_splits == splits and ExpertUnpadding()(x, splits) is x
    monkeypatch.setenv("MEGATRON_FP8_EXPERT_PADDING", "outside")
    with ctx():
        padded, padded_splits = ExpertPadding()(x, splits)
        assert padded_splits == [-(-m // align) * align for m in splits]
        assert padded.shape[0] == sum(padded_splits)
        start = 0
        for m, p in zip(splits, padded_splits):  # each expert's rows first, then zero rows
            seg = padded[start:start + p]
            assert torch.equal(seg[:m], x[sum(splits[:splits.index(m)]):][:m]) and not seg[m:].any()
            start += p
        back = ExpertUnpadding()(padded, splits)
    assert torch.equal(back, x)
    back.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_launcher_needs_a_script() -> None:
    from megatron_fp8.megatron.launch import main

    with pytest.raises(SystemExit, match="usage"):
        main([])
    with pytest.raises(SystemExit, match="does not exist"):
        main(["no_such_pretrain_gpt.py"])


def test_count_gemms_reports_counts_per_kernel_at_exit(tmp_path: Path) -> None:
    """``launch --count-gemms SCRIPT``: at exit, the FP8 GEMMs of the run per kernel and the FP8
    forwards per path; it keeps counts, not one record per GEMM (a long run would pile them up)."""
    pytest.importorskip("megatron.core")
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, megatron_fp8 as mf\n"
        "from megatron_fp8 import gemm\n"
        "from megatron_fp8.recipe import Float8CurrentScaling\n"
        "layer = mf.Linear(64, 32, bias=False)\n"
        "for _ in range(2):\n"
        "    with mf.fp8_autocast(fp8_recipe=Float8CurrentScaling()):\n"
        "        layer(torch.randn(16, 64, requires_grad=True)).sum().backward()\n"
        "print('kept', sum(len(r) for r in gemm._state.records if isinstance(r, list)))\n")
    proc = subprocess.run([sys.executable, "-m", "megatron_fp8.megatron.launch", "--count-gemms", str(script)],
                          capture_output=True, text=True, cwd=str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "kept 0" in proc.stdout
    assert re.search(r"megatron_fp8 \[rank 0\]: 6 FP8 GEMMs \((emulate|native) 6\)", proc.stdout), proc.stdout
    assert "megatron_fp8 [rank 0]: 2 FP8 layer forwards (general linear 2)" in proc.stdout
