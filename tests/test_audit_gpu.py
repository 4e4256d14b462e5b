"""GPU: the memory audit's predicted saving is what ``torch.cuda.max_memory_allocated`` measures.

megatron-core GPTModels from our spec with the SDPA core (dense; MoE with grouped and shared
experts; MLA), BF16 in Megatron's Float16Module, one step each: the audit's recommendation is
written as YAML and applied as a user would, and the step's peak drops by
``activation_bytes - with_recommendation`` within 1%. A vocabulary of 32768 puts the step's peak
at the loss (every layer's saved activations live), as in a deep model. Needs CUDA and
megatron-core (on the device: the Megatron-LM checkout's, on PYTHONPATH).
"""

from __future__ import annotations

import os

import pytest
import torch

import megatron_fp8 as mf
from megatron_fp8.audit import GPTShape, example_gpt
from megatron_fp8.config import apply_layer_flags, load_config
from megatron_fp8.recipe import Float8BlockScaling, Float8CurrentScaling

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
megatron_core = pytest.importorskip("megatron.core")

# 8 layers of [8192 tokens, 2048] inputs: 16 MiB per flagged FP8 copy (dense and MoE: >= 128 MiB
# predicted; MLA under block scaling: its down-projections' scales, 1 MiB a layer)
SHAPE = GPTShape(layers=8, hidden=2048, heads=16, ffn=8192, seq=4096, batch=2, vocab=32768)
RECIPES = {"current": Float8CurrentScaling(), "block": Float8BlockScaling()}
# the mission's placements, per model (every layer's)
PLACED = {"gpt": ("self_attention.linear_proj",),
          "moe": ("self_attention.linear_proj", "mlp.shared_experts.linear_fc1"),
          "mla": ("self_attention.linear_q_down_proj", "self_attention.linear_kv_down_proj")}


def _peak(model: torch.nn.Module, step: object) -> int:
    """Bytes allocated at the step's peak above what was allocated before it (grads freed)."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()  # type: ignore[operator]
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


# MLA under current scaling: the q/kv down-projections' two FP8 copies weigh what their BF16 input
# does, so nothing is recommended there; under block scaling their scales tip it (1/16 of the input)
CASES = [("gpt", "current"), ("gpt", "block"), ("moe", "current"), ("moe", "block"), ("mla", "block")]


@pytest.mark.parametrize(("kind", "recipe"), CASES)
def test_peak_drops_by_the_predicted_bytes(kind: str, recipe: str, tmp_path: str) -> None:
    model, step = example_gpt(kind, "sdpa", SHAPE, device="cuda")

    def fp8_step() -> None:
        with mf.fp8_autocast(fp8_recipe=RECIPES[recipe]):
            step()

    fp8_step()  # kernels compiled, quantizers built
    report = mf.memory.audit(model, fp8_step)
    flagged = set(report.recommend())
    for i in range(SHAPE.layers):
        for where in PLACED[kind]:
            assert f"decoder.layers.{i}.{where}" in flagged, (where, sorted(flagged))
    predicted = report.activation_bytes - report.with_recommendation
    assert predicted > 0
    off = _peak(model, fp8_step)
    path = os.path.join(tmp_path, "flags.yaml")
    report.to_yaml(path)
    apply_layer_flags(model.module, load_config(path))
    on = _peak(model, fp8_step)
    print(f"{kind} {recipe}: peak off {off / 2**20:.1f} MiB, on {on / 2**20:.1f} MiB, drop "
          f"{(off - on) / 2**20:.2f} MiB, predicted {predicted / 2**20:.2f} MiB")
    assert abs((off - on) - predicted) <= 0.01 * predicted
