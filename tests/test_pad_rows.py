"""Expert padding in one pass (``kernels/triton_pad.py``, ``ops.padding.Padded.pad`` on the GPU)
against torch's zeros and ``index_copy_``, bit for bit: router-like splits with empty experts,
splits already aligned, a first expert without rows, widths that are not multiples of the
kernel's column block, BF16 and FP32. CUDA, or CPU under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_fp8.ops.padding import Padded, expert_rows
from megatron_fp8.testing import bits

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("splits, align, k", [
    ([37, 0, 130, 5, 0, 128, 1], 128, 200),
    ([0, 17, 16, 33], 16, 64),
    ([256, 128], 128, 300),
    ([1], 128, 8),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pad_in_one_pass_equals_zeros_and_index_copy(splits: list[int], align: int, k: int,
                                                     dtype: torch.dtype) -> None:
    from megatron_fp8.kernels import triton_pad

    torch.manual_seed(0)
    x = torch.randn(sum(splits), k, device=DEV).to(dtype)
    rows, padded = expert_rows(splits, align, torch.device(DEV))
    assert triton_pad.serves(x, rows)
    got = triton_pad.pad_rows(x, rows, sum(padded))
    want = x.new_zeros((sum(padded), k)).index_copy_(0, rows, x)
    assert torch.equal(bits(got), bits(want))
    got_padded = Padded(rows, sum(padded)).pad(x)  # the layers' call: the kernel on this device
    assert torch.equal(bits(got_padded), bits(want))


def _index_by_torch(splits: list[int], align: int) -> torch.Tensor:
    """The padded row of each real row, built row by row on the host (the definition)."""
    out, pad_start = [], 0
    for m in splits:
        out += [pad_start + i for i in range(m)]
        pad_start += -(-m // align) * align
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("splits, align", [
    ([37, 0, 130, 5, 0, 128, 1], 128),
    ([0, 0, 3], 16),
    ([5, 0, 0], 128),
    ([0, 0], 128),
    ([1500], 128),
    (None, 128),  # 64 router-like experts, some empty
])
def test_expert_index_in_one_launch_equals_the_definition(splits: list[int] | None, align: int) -> None:
    """``expert_rows``'s index from one Triton launch (``kernels.expert_index``) == the padded row of
    every real row computed on the host, for empty experts first, last and between, no rows at
    all, one expert, and many experts; int64, on the device."""
    from megatron_fp8.quant import kernels

    if splits is None:
        g = torch.Generator().manual_seed(3)
        splits = [int(v) if v % 5 else 0 for v in torch.randint(0, 300, (64,), generator=g)]
    padded = [-(-m // align) * align for m in splits]
    got = kernels.expert_index(splits, padded, torch.device(DEV))
    assert got is not None and got.dtype == torch.int64 and got.device.type == DEV
    assert torch.equal(got.cpu(), _index_by_torch(splits, align))
    rows, padded_out = expert_rows(splits, align, torch.device(DEV))
    assert padded_out == padded and torch.equal(rows.cpu(), got.cpu())


def test_expert_rows_without_the_kernel_equals_the_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the Triton kernels are turned off (``MEGATRON_FP8_CAST_BACKEND=eager``), the index is
    torch's ``arange + repeat_interleave``: the same values."""
    from megatron_fp8.quant import kernels

    monkeypatch.setenv("MEGATRON_FP8_CAST_BACKEND", "eager")
    splits = [37, 0, 130, 5, 0, 128, 1]
    assert kernels.expert_index(splits, [128] * len(splits), torch.device(DEV)) is None
    rows, padded = expert_rows(splits, 128, torch.device(DEV))
    assert padded == [128, 0, 256, 128, 0, 128, 128]
    assert torch.equal(rows.cpu(), _index_by_torch(splits, 128))
