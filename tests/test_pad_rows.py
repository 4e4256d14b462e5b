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
