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
    ptrs = tuple(0x7F00_0000_0000 + 256 * i for i in range(8))
    args = cuda_cast._Args(*ptrs, 16384, 4096, 8)
    base = ctypes.addressof(args)
    argv = cuda_cast._ARGV(*[base + off for off in cuda_cast._OFFSETS])
    got = [ctypes.c_void_p.from_address(argv[i]).value for i in range(8)]
    got += [ctypes.c_int.from_address(argv[i]).value for i in range(8, 11)]
    assert got == [*ptrs, 16384, 4096, 8]


class _FakeDriver:
    """The four driver calls ``ensure_context`` makes, recorded; ``current`` is the thread's context."""

    def __init__(self, current: int) -> None:
        self.current, self.calls = current, []

    def cuCtxGetCurrent(self, ref) -> int:  # noqa: N802 - the driver's names
        self.calls.append("get")
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_void_p))[0] = self.current or None
        return 0

    def cuDeviceGet(self, ref, ordinal) -> int:  # noqa: N802
        self.calls.append(f"device {ordinal.value}")
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int))[0] = ordinal.value
        return 0

    def cuDevicePrimaryCtxRetain(self, ref, dev) -> int:  # noqa: N802
        self.calls.append("retain")
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_void_p))[0] = 0xC0
        return 0

    def cuCtxSetCurrent(self, ctx) -> int:  # noqa: N802
        self.calls.append(f"set {ctx.value:#x}")
        self.current = ctx.value
        return 0


def test_ensure_context_sets_the_primary_context_only_where_none_is(monkeypatch) -> None:
    """A thread with no current context (the autograd engine's, before any runtime launch) gets the
    device's primary context before the driver API loads or launches the cast; a thread that has
    one is left alone."""
    import torch

    for current, expected in ((0, ["get", "device 1", "retain", "set 0xc0"]), (0xAB, ["get"])):
        fake = _FakeDriver(current)
        monkeypatch.setattr(torch.cuda._utils, "_get_gpu_runtime_library", lambda fake=fake: fake)
        cuda_cast.ensure_context(1)
        assert fake.calls == expected

