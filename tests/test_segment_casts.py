"""The experts' casts in one pass over all experts (``Quantizer.quantize_segments``: one Triton
cast launch for every expert, after one amax launch where current scaling needs it, or the
one-launch current cast on CUDA where every expert has a positive multiple of 128 tokens)
against each expert's own cast, bit for bit, where the segment lookup has the most to get
wrong: more experts than one vector load of boundaries (32), empty experts anywhere, and token
counts that are not multiples of 128 (current scaling, whose per-row lookup then runs). CUDA,
or CPU under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_fp8.quant.quantizers import Block1DQuantizer, Block2DQuantizer, CurrentScalingQuantizer
from megatron_fp8.testing import bits

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E4 = torch.float8_e4m3fn


def _equal_per_expert(q: object, x: torch.Tensor, splits: list[int]) -> None:
    fused = q.quantize_segments(x, splits, peers=[q] * len(splits), rowwise=True, columnwise=True)
    assert fused is not None, "the one-launch cast should serve these experts"
    for e, (part, got) in enumerate(zip(x.split(splits), fused, strict=True)):
        want = q.quantize(part, rowwise=True, columnwise=True)
        if want.scale is not None:  # per-tensor recipes: the expert's scale itself
            assert torch.equal(bits(got.scale), bits(want.scale)), e
        for usage in ("rowwise", "columnwise"):
            g, w = got.operand(usage), want.operand(usage)
            assert g.data.shape == w.data.shape and torch.equal(bits(g.data), bits(w.data)), (e, usage)
            assert g.scale_inv.shape == w.scale_inv.shape, (e, usage)
            assert torch.equal(bits(g.scale_inv), bits(w.scale_inv)), (e, usage)


def _input(splits: list[int], k: int) -> torch.Tensor:
    m = sum(splits)
    ramp = torch.linspace(0.05, 20, m).unsqueeze(1)  # every expert a different amax
    return (torch.randn(m, k) * ramp).to(torch.bfloat16).to(DEV)


# 43 and 42 experts: the lookup reads their boundaries in two vector loads; empty experts first
# and inside. Empty experts send current scaling to its amax-then-cast launches; FULL (34
# experts, none empty) takes the one-launch current cast on CUDA.
ALIGNED = [0, *([128, 0, 256] * 13), 128, 0, 384]
RAGGED = [0, *([37, 0, 128, 201] * 10), 5]
FULL = [128, 256] * 17


@pytest.mark.parametrize("quantizer", [Block1DQuantizer, CurrentScalingQuantizer])
def test_many_aligned_experts(quantizer: type) -> None:
    _equal_per_expert(quantizer(E4), _input(ALIGNED, 128), ALIGNED)


@pytest.mark.parametrize("splits", [RAGGED, FULL], ids=["ragged", "full"])
def test_many_experts_current(splits: list[int]) -> None:
    _equal_per_expert(CurrentScalingQuantizer(E4), _input(splits, 128), splits)


def test_many_stacked_expert_weights() -> None:
    """Stacked experts' weights in 128x128 blocks (equal splits, as a GroupedLinear's)."""
    splits = [128] * 40
    _equal_per_expert(Block2DQuantizer(E4), _input(splits, 256), splits)


@pytest.mark.parametrize("copies", [(True, True), (True, False), (False, True)], ids=["both", "row", "col"])
@pytest.mark.parametrize("dtype", [E4, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", ["1x128", "tensor"])
def test_gathered_cast_equals_the_padded_tensors(mode: str, dtype: torch.dtype, copies: tuple[bool, bool]) -> None:
    """``triton_cast.cast_segments_gathered``: experts padded to 128 rows, read from their unpadded
    rows (the padding as zeros, never written), == ``cast_segments`` of the padded tensor, bit for
    bit, for every copy asked for; 43 experts (two boundary loads), empty ones and one-row ones,
    NaN and inf inputs."""
    from megatron_fp8.kernels.triton_cast import cast_segments, cast_segments_gathered
    from megatron_fp8.ops.padding import expert_rows
    from megatron_fp8.quant.kernels import aligned_copy, pad_expert_rows, segment_offsets

    real = [0, *([37, 0, 1, 201] * 10), 128, 5]
    x = _input(real, 256)
    x[3, 7], x[40, 100], x[41, 9] = float("nan"), float("inf"), float("-inf")
    rows, padded = expert_rows(real, 128, x.device)
    scale = aligned_copy(torch.logspace(-2, 3, len(real), device=x.device)) if mode == "tensor" else None
    off = segment_offsets(padded, x.device)
    got = cast_segments_gathered(x, segment_offsets(real, x.device), off, padded, dtype, mode, scale, *copies)
    assert got is not None
    want = cast_segments(pad_expert_rows(x, rows, sum(padded)), off, padded, dtype, mode, *copies, scale)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            assert g.shape == w.shape and torch.equal(bits(g), bits(w))
