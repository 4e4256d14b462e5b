"""The 1x128 row + column cast of BF16 tensors as a CUDA C kernel (``cuda_cast.cu``), compiled at
first use by NVRTC through ``torch.cuda._compile_kernel``.

The Triton cast (``triton_cast``) loads each 128x128 tile twice for this cast: the column half
re-reads it transposed, because transposing inside Triton cost more. Here a block of 256
threads loads its tile once, casts the rowwise copy from registers, takes the column amaxes
from the tile parked in shared memory and writes the transposed FP8 tile out 128 bytes a warp.
Measured on an H200 (``scripts/probe_cuda_cast.py``, docs/benchmarks.md run V): x 16384x4096
113 -> 88 us, eight experts' x at K=4096 112 -> 91 us, their dy at N=7168 190 -> 153 us; same
bits.

Serves only what it was measured to win: both copies, BF16 input, rows and columns multiples of
128, segments (experts) aligned to 128 rows; the tile kernel's other modes (128x128, tensor)
gained only 2-4% over Triton's and stay with the probe. ``serves`` declines anything else, and
``cast_1x128`` returns False where the kernel cannot be built (no NVRTC): either way the Triton
cast runs. ``MEGATRON_FP8_CUDA_CAST=0`` turns it off. Outputs fill the Triton cast's raw buffers
(``triton_cast._launch``) with its bits: the GPU tests compare both with the CPU reference.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from .formats import cast_clamp

TILE = 128
_SRC = Path(__file__).with_name("cuda_cast.cu")
_BLOCKS_PER_SM = 3  # 80 registers; at 4 (64 registers, 88 bytes spilled) it ran 5-10% slower


def enabled() -> bool:
    return os.environ.get("MEGATRON_FP8_CUDA_CAST", "1") != "0"


@functools.cache
def _kernel(e5m2: bool, device: int) -> Any | None:
    """The compiled 1x128 kernel for ``device``, or None (with one warning) where it cannot be
    built: no NVRTC, or a torch without ``torch.cuda._compile_kernel``."""
    try:
        with torch.cuda.device(device):
            return torch.cuda._compile_kernel(_SRC.read_text(), "cast_tile",
                                              nvcc_options=["-DMODE=0", f"-DE5M2={int(e5m2)}",
                                                            f"-DMINB={_BLOCKS_PER_SM}",
                                                            f"-DNOCLAMP={int(not cast_clamp())}"])
    except Exception as exc:  # noqa: BLE001 - any build failure means the Triton cast runs
        warnings.warn(f"megatron_fp8: the CUDA 1x128 cast could not be built ({type(exc).__name__}: {exc}); "
                      "the Triton cast runs instead (MEGATRON_FP8_CUDA_CAST=0 silences this)", stacklevel=2)
        return None


def serves(x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool, aligned: bool) -> bool:
    """Whether ``cast_1x128`` takes this cast (then only a build failure sends it back)."""
    m, k = x.shape
    return (enabled() and x.is_cuda and x.dtype == torch.bfloat16 and rowwise and columnwise and aligned
            and m > 0 and k > 0 and m % TILE == 0 and k % TILE == 0 and x.is_contiguous()
            and fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2))


def cast_1x128(x: torch.Tensor, fp8_dtype: torch.dtype, offsets: torch.Tensor | None, n_seg: int,
               row: torch.Tensor, row_s: torch.Tensor, col: torch.Tensor, col_s: torch.Tensor) -> bool:
    """Cast ``x [M, K]`` into the Triton cast's buffers (``triton_cast._launch``): ``row [M, K]``,
    ``row_s [K/128 * M]``, ``col`` and ``col_s [M/128, K]``. False where the kernel cannot be
    built (nothing written). ``offsets``: the segments' device prefix sums (every one a multiple
    of 128), or None for one tensor. Only for casts ``serves`` accepts."""
    kernel = _kernel(fp8_dtype == torch.float8_e5m2, x.device.index if x.device.index is not None
                     else torch.cuda.current_device())
    if kernel is None:
        return False
    m, k = x.shape
    seg = offsets if offsets is not None else x  # unread when n_seg is 0
    kernel(grid=(m // TILE, k // TILE, 1), block=(256, 1, 1),
           args=[x, row, row_s, col, col_s, seg, x, m, k, n_seg if offsets is not None else 0])
    return True
