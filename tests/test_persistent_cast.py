"""The one-launch current-scaling cast (``quant/triton_persistent.py``: an amax barrier, then the
cast) against the two-launch cast, bit for bit. CUDA: full and small grids, one or two programs
per SM, two streams at once, CUDA graphs. CPU under ``TRITON_INTERPRET=1`` (which runs programs
one after another, so no barrier can work): one program with the barrier, and grids of several
programs as two launches of the same kernel (amax, then cast), so the tile partition and the
segment walks of a multi-program grid are checked here too."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_fp8.quant import kernels
from megatron_fp8.testing import same_bits

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from megatron_fp8.kernels import triton_cast, triton_persistent  # noqa: E402 - needs Triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
GPU = DEV == "cuda"


def _both(x: torch.Tensor, dtype: torch.dtype, row: bool, col: bool, splits: list[int] | None,
          programs: int | None = None, **kw: object) -> tuple[tuple[object, ...], tuple[object, ...]]:
    off = kernels.segment_offsets(splits, x.device) if splits is not None else None
    one = triton_persistent.cast_current_persistent(x, dtype, row, col, splits=splits, offsets=off,
                                                    programs=programs, **kw)
    two = triton_cast.cast_current(x, dtype, row, col, splits=splits, offsets=off, one_launch=False, **kw)
    return one, two


def _input(shape: tuple[int, int], splits: list[int] | None) -> torch.Tensor:
    x = (torch.randn(shape, device=DEV) * 7).bfloat16()
    if splits is not None:
        if len(splits) > 1:
            x[splits[0]: splits[0] + splits[1]] = 0  # a zero expert
        x[-1, 3] = float("inf")  # an infinite amax in the last
    else:
        x[shape[0] // 2, shape[1] // 3] = float("nan")
    return x


SPLITS = ([None, [128, 1920, 384, 256, 1280], [128] * 37, [2048] * 8] if GPU
          else [None, [128, 384, 256, 640], [128] * 11])  # smaller where the interpreter runs them
SHAPES_K = [512, 200] if GPU else [200]
OPTIONS = [(E4, {}), (E5, dict(power_2_scale=True)), (E4, dict(amax_epsilon=1e-3))]


@pytest.mark.parametrize("copies", [(True, True), (True, False), (False, True)], ids=["row+col", "row", "col"])
@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: "tensor" if s is None else f"{len(s)}seg")
def test_one_launch_equals_two(splits: list[int] | None, copies: tuple[bool, bool]) -> None:
    """Data and scales, every copy, both formats, power-of-two scales and an epsilon, zeros, NaN
    and inf, odd shapes, at several grid sizes (a program's tiles may span segments); on CUDA each
    launched three times (the sync words reset themselves)."""
    if splits is not None:
        shapes = [(sum(splits), k) for k in SHAPES_K]
    else:
        shapes = [(300, 640), (17, 40), (1, 7)] + ([(16384, 4096)] if GPU else [])
    for shape in shapes:
        for i, (dtype, kw) in enumerate(OPTIONS):
            x = _input(shape, splits)
            # CUDA: every grid, three launches each; the interpreter (slow): one grid per option
            for programs in [None, 1, 3, 7] if GPU else [[1, 2, 7][i]]:
                for _ in range(3 if GPU else 1):
                    assert same_bits(*_both(x, dtype, *copies, splits, programs, **kw)), (shape, dtype, kw, programs)


@pytest.mark.skipif(not GPU, reason="streams and graphs need CUDA")
@pytest.mark.parametrize("per_sm", [1, 2])
def test_one_launch_on_streams_and_in_graphs(per_sm: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two streams at once each use their own sync words; a captured graph replays the launch."""
    monkeypatch.setattr(triton_persistent, "PROGRAMS_PER_SM", per_sm)
    splits = [256, 512, 1024, 256]
    off = kernels.segment_offsets(splits, torch.device("cuda"))
    xs = [(torch.randn(sum(splits), 1024, device="cuda") * s).bfloat16() for s in (1.0, 100.0)]
    kw = dict(splits=splits, offsets=off)
    want = [triton_cast.cast_current(x, E4, True, True, one_launch=False, **kw) for x in xs]
    streams = [torch.cuda.Stream() for _ in xs]
    torch.cuda.synchronize()
    outs: list[list[object]] = [[], []]
    for _ in range(20):
        for i, (x, st) in enumerate(zip(xs, streams)):
            with torch.cuda.stream(st):
                outs[i].append(triton_cast.cast_current(x, E4, True, True, one_launch=True, **kw))
    torch.cuda.synchronize()
    for i in range(2):
        assert all(same_bits(o, want[i]) for o in outs[i])
    # two graphs captured on one stream (each launch gets its own sync words), an eager cast on
    # that stream between the captures, replays in any order and on two streams at once
    statics = [x.clone() for x in xs]
    triton_cast.cast_current(statics[0], E4, True, True, one_launch=True, **kw)  # compiled outside the capture
    capture = torch.cuda.Stream()
    graphs, got = [torch.cuda.CUDAGraph() for _ in xs], []
    for i, (graph, static) in enumerate(zip(graphs, statics)):
        with torch.cuda.graph(graph, stream=capture):
            got.append(triton_cast.cast_current(static, E4, True, True, one_launch=True, **kw))
        if i == 0:
            with torch.cuda.stream(capture):
                eager = triton_cast.cast_current(xs[1], E4, True, True, one_launch=True, **kw)
            torch.cuda.synchronize()
            assert same_bits(eager, want[1])
    for order in ((0, 1), (1, 0)):
        for i in order:
            graphs[i].replay()
        torch.cuda.synchronize()
        assert all(same_bits(got[i], want[i]) for i in range(2))
    for _ in range(10):
        for graph, st in zip(graphs, streams):
            with torch.cuda.stream(st):
                graph.replay()
    torch.cuda.synchronize()
    assert all(same_bits(got[i], want[i]) for i in range(2))


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The package's current-scaling cast (``kernels.cast_current``), the CUDA tile cast aside
    (``MEGATRON_FP8_CUDA_CURRENT=0``; ``test_cuda_cast_gpu.py`` checks that dispatch), takes the
    one-launch path on CUDA when it is on (not under the interpreter, not for an empty tensor),
    and the two-launch path when it is off."""
    calls: list[int] = []
    real = triton_persistent.cast_current_persistent

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_persistent, "cast_current_persistent", spy)
    monkeypatch.setattr(triton_persistent, "ENABLED", True)
    monkeypatch.setenv("MEGATRON_FP8_CUDA_CURRENT", "0")  # else the CUDA tile cast takes BF16 tensors on CUDA
    x = _input((256, 256), None)
    kw = dict(power_2_scale=False, amax_epsilon=0.0)
    assert kernels.cast_current(x, E4, True, True, **kw) is not None
    assert len(calls) == (1 if GPU else 0)
    assert kernels.cast_current(x[:0], E4, True, False, **kw) is None
    assert len(calls) == (1 if GPU else 0)
    monkeypatch.setattr(triton_persistent, "ENABLED", False)
    assert kernels.cast_current(x, E4, True, True, **kw) is not None
    assert len(calls) == (1 if GPU else 0)


def test_bad_splits_are_refused() -> None:
    x = _input((256, 64), None)
    off = kernels.segment_offsets([128, 128], x.device)
    for splits in ([128, 64, 64], [256, 0], [128]):
        with pytest.raises(ValueError, match="positive multiples of 128"):
            triton_persistent.cast_current_persistent(x, E4, True, True, splits=splits, offsets=off)
    with pytest.raises(ValueError, match="empty"):
        triton_persistent.cast_current_persistent(x[:0], E4, True, True)


@pytest.mark.parametrize("error, falls_back", [
    (RuntimeError("Triton Error [CUDA]: too many blocks in cooperative launch"), True),
    (RuntimeError("PassManager::run failed"), True),
    (KeyError("maxnreg"), True),
    (ValueError("a caller's mistake"), False),
    (torch.OutOfMemoryError("out of memory"), False),
], ids=["launch", "build", "option", "value", "oom"])
def test_falls_back_to_two_launches(error: Exception, falls_back: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where this Triton cannot build or launch the persistent kernel, the casts (``kernels``) warn
    once and give the two-launch cast (same bits) from then on; an out-of-memory error or the
    caller's ``ValueError`` reaches the caller and leaves the one-launch path on; asked for
    explicitly, it always raises."""
    def broken(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(triton_persistent, "cast_current_persistent", broken)
    monkeypatch.setattr(triton_persistent, "persistent_ok", lambda x: True)
    monkeypatch.setattr(kernels._one_launch, "ok", True)
    monkeypatch.setenv("MEGATRON_FP8_CUDA_CURRENT", "0")
    x = _input((256, 256), None)
    row, col, scale, inv = triton_cast.cast_current(x, E4, True, True, one_launch=False)
    want = (row, col, scale.view(()), inv.view(()))  # kernels.cast_current's scales are 0-dim

    def cast() -> object:
        return kernels.cast_current(x, E4, True, True, power_2_scale=False, amax_epsilon=0.0)

    if falls_back:
        with pytest.warns(RuntimeWarning, match="one-launch current-scaling cast unavailable"):
            got = cast()
        assert same_bits(got, want) and not kernels._one_launch.ok
    else:
        with pytest.raises(type(error)):
            cast()
        assert kernels._one_launch.ok
    with pytest.raises(type(error)):
        triton_cast.cast_current(x, E4, True, True, one_launch=True)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("out of memory"), ValueError("bad input")],
                         ids=["oom", "value"])
def test_fused_guard_passes_caller_errors_on(error: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kernels``' guard around the fused current-scaling cast re-raises an out-of-memory error
    or a ``ValueError`` and keeps the fused cast on (any other error turns it off, with a warning)."""
    def broken(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(triton_cast, "cast_current", broken)
    monkeypatch.setattr(kernels._fused_current, "ok", True)
    with pytest.raises(type(error)):
        kernels.cast_current(_input((128, 128), None), E4, True, True, power_2_scale=False, amax_epsilon=0.0)
    assert kernels._fused_current.ok


def test_successive_launches_and_many_segments() -> None:
    """Launches one after another with falling amaxes (a sync word left set by the one before
    would raise this one's amax, and change its bits), and more segments than one 128-wide
    block of the publish and reset loops (and, on CUDA, than the stream's first sync buffer)."""
    for splits, k in (([128] * 130, 64), ([128] * 300, 64), (None, 640)) if GPU else (([128] * 130, 64),):
        m = sum(splits) if splits is not None else 512
        base = torch.randn(m, k, device=DEV).bfloat16()
        for factor in (64.0, 8.0, 1.0, 0.125) if GPU else (1.0,):  # the interpreter: slow, and fresh words each time
            assert same_bits(*_both(base * factor, E4, True, True, splits)), (splits, factor)
    if GPU:  # no launch of this module's tests was refused (two programs per SM fit); the repeated
        assert not triton_persistent._per_sm  # signatures took their prepared launches
        assert triton_persistent._prepared


@pytest.mark.skipif(not GPU, reason="prepared launches are CUDA's")
def test_prepared_launch_refused_later_takes_the_keyed_launch() -> None:
    """A prepared launch whose cooperative grid the driver refuses on a later call (its answer can
    change, e.g. under MPS) is dropped, and the cast launches again the keyed way: same bits."""
    splits = [128, 256]
    x = _input((384, 256), splits)
    _both(x, E4, True, True, splits)  # prepares this signature
    refused: list[int] = []

    def refuse(*args: object) -> None:
        refused.append(1)
        raise RuntimeError("too many blocks in cooperative launch")

    mine = [k for k in triton_persistent._prepared if k[2:5] == (384, 256, 2)]  # (m, k, segments)
    assert mine
    for k in mine:
        triton_persistent._prepared[k] = refuse  # type: ignore[assignment]
    assert same_bits(*_both(x, E4, True, True, splits)) and refused
    assert all(triton_persistent._prepared[k] is not refuse for k in mine if k in triton_persistent._prepared)


@pytest.mark.parametrize("value, enabled", [(None, True), ("1", True), ("0", False), (" 0 ", False),
                                            ("false", None), ("on", None)])
def test_env_switch(value: str | None, enabled: bool | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``MEGATRON_FP8_ONE_LAUNCH_CAST``: on by default, ``0`` turns it off; a value that is neither
    is an error naming the variable and what it takes, not a silent guess."""
    if value is None:
        monkeypatch.delenv("MEGATRON_FP8_ONE_LAUNCH_CAST", raising=False)
    else:
        monkeypatch.setenv("MEGATRON_FP8_ONE_LAUNCH_CAST", value)
    if enabled is None:
        with pytest.raises(ValueError, match=r"MEGATRON_FP8_ONE_LAUNCH_CAST=.*allowed: '1'.*'0'"):
            triton_persistent.enabled_from_env()
    else:
        assert triton_persistent.enabled_from_env() is enabled
