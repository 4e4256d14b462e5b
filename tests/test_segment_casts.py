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
from megatron_fp8.testing import bits, same_bits

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


@pytest.mark.parametrize("mode", ["1x128", "128x128"])
def test_tile_loop_equals_one_tile_per_program(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block casts as a pipelined loop over tiles (``LOOP_STAGES``, a few programs an SM)
    give the one-tile-per-program cast's bits: plain tensors of odd shapes (more tiles than
    programs, and fewer), and experts whose boundaries take several of the loop's lookups."""
    from megatron_fp8.quant import kernels, triton_cast

    splits = ALIGNED if mode == "1x128" else [128, 256] * 5
    x = _input(splits, 384)
    off = kernels.segment_offsets(splits, x.device)
    plain = [(torch.randn(m, k) * 3).to(torch.bfloat16).to(DEV) for m, k in ((300, 200), (128, 128), (1000, 640))]
    casts = [lambda t=t: triton_cast.cast_tiles(t, E4, mode, True, True) for t in plain]
    casts.append(lambda: triton_cast.cast_segments(x, off, splits, E4, mode, True, True))
    want = [cast() for cast in casts]
    for stages, per_sm in ((2, 1), (3, 2)):
        monkeypatch.setattr(triton_cast, "LOOP_STAGES", stages)
        monkeypatch.setattr(triton_cast, "LOOP_PROGRAMS_PER_SM", per_sm)
        for i, (cast, w) in enumerate(zip(casts, want, strict=True)):
            assert same_bits(_flat(cast()), _flat(w)), (mode, stages, i)


def _flat(outputs: tuple) -> list[torch.Tensor | None]:
    """A cast's outputs, ``((row, row_s), (col, col_s))`` or ``(row, row_s, col, col_s)``, flat."""
    return [t for part in outputs for t in (part if isinstance(part, tuple) else (part,))]
