"""The CUDA tile cast's own launch (``kernels/cuda_cast._launch``), on CPU: the argument structure
mirrors ``cast_tile``'s parameters as ``cuda_cast.cu`` declares them, and the array handed to the
driver points at each value in order (what the driver copies at launch). The launch itself and
the cast's bits are GPU tests (tests/test_cuda_cast_gpu.py)."""

from __future__ import annotations

import ctypes
import re

from megatron_fp8.kernels import cuda_cast


def _parameters() -> list[str]:
    """``cast_tile``'s parameter types, from the source: ``ptr`` or the scalar type."""
    src = cuda_cast._SRC.read_text()
    params = re.search(r"\bcast_tile\s*\(([^)]*)\)\s*\{", src)
    assert params is not None, "cast_tile's definition not found in cuda_cast.cu"
    kinds = []
    for p in params.group(1).split(","):
        kinds.append("ptr" if "*" in p else p.split()[-2])
    return kinds


def test_arguments_mirror_the_kernel() -> None:
    kinds = _parameters()
    fields = [t for _, t in cuda_cast._Args._fields_]
    assert len(fields) == len(kinds)
    for kind, t in zip(kinds, fields):
        assert t is (ctypes.c_void_p if kind == "ptr" else ctypes.c_int), (kind, t)


def test_argv_points_at_each_value() -> None:
    ptrs = tuple(0x7F00_0000_0000 + 256 * i for i in range(7))
    args = cuda_cast._Args(*ptrs, 16384, 4096, 8)
    base = ctypes.addressof(args)
    argv = cuda_cast._ARGV(*[base + off for off in cuda_cast._OFFSETS])
    got = [ctypes.c_void_p.from_address(argv[i]).value for i in range(7)]
    got += [ctypes.c_int.from_address(argv[i]).value for i in range(7, 10)]
    assert got == [*ptrs, 16384, 4096, 8]
