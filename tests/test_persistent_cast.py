"""The one-launch current-scaling cast (``quant/triton_persistent.py``: an amax barrier, then the
cast) against the two-launch cast, bit for bit. CUDA: full grids, several programs per SM, two
streams at once, CUDA graphs. CPU under ``TRITON_INTERPRET=1``: a grid of one program (the
interpreter runs programs one after another), which still walks every segment both ways."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_fp8.quant import kernels

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from megatron_fp8.quant import triton_cast, triton_persistent  # noqa: E402 - needs Triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
GPU = DEV == "cuda"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def _same(one: tuple[object, ...], two: tuple[object, ...]) -> bool:
    return all((a is None and b is None) or (a is not None and b is not None and torch.equal(_bits(a), _bits(b)))
               for a, b in zip(one, two, strict=True))


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


SPLITS = [None, [128, 1920, 384, 256, 1280], [128] * 37] + ([[2048] * 8] if GPU else [])
SHAPES_K = [512, 200] if GPU else [200]
OPTIONS = [(E4, {}), (E5, dict(power_2_scale=True)), (E4, dict(amax_epsilon=1e-3))]


@pytest.mark.parametrize("copies", [(True, True), (True, False), (False, True)], ids=["row+col", "row", "col"])
@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: "tensor" if s is None else f"{len(s)}seg")
def test_one_launch_equals_two(splits: list[int] | None, copies: tuple[bool, bool]) -> None:
    """Data and scales, every copy, both formats, power-of-two scales and an epsilon, zeros, NaN
    and inf, odd shapes; on CUDA at several grid sizes (a program's tiles may span segments),
    each launched three times (the sync words reset themselves)."""
    if splits is not None:
        shapes = [(sum(splits), k) for k in SHAPES_K]
    else:
        shapes = [(300, 640), (17, 40), (1, 7)] + ([(16384, 4096)] if GPU else [])
    grids = [None, 1, 3, 7] if GPU else [None]
    for shape in shapes:
        for dtype, kw in OPTIONS:
            x = _input(shape, splits)
            for programs in grids:
                for _ in range(3 if GPU else 1):
                    assert _same(*_both(x, dtype, *copies, splits, programs, **kw)), (shape, dtype, kw, programs)


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
        assert all(_same(o, want[i]) for o in outs[i])
    static = xs[0].clone()
    triton_cast.cast_current(static, E4, True, True, one_launch=True, **kw)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = triton_cast.cast_current(static, E4, True, True, one_launch=True, **kw)
    for x, w in zip(xs, want):
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert _same(got, w)


def test_dispatch() -> None:
    """``cast_current`` takes the one-launch path on CUDA unless switched off; never under the
    interpreter."""
    x = torch.randn(4, 4, device=DEV)
    assert triton_persistent.persistent_ok(x) == (GPU and triton_persistent.ENABLED
                                                  and os.environ.get("TRITON_INTERPRET") != "1")


def test_falls_back_to_two_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where this Triton cannot build or launch the persistent kernel, ``cast_current`` warns once
    and gives the two-launch cast (same bits) from then on; asked for explicitly, it raises."""
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no cooperative launch here")

    monkeypatch.setattr(triton_persistent, "cast_current_persistent", broken)
    monkeypatch.setattr(triton_persistent, "persistent_ok", lambda x: triton_persistent.ENABLED)
    monkeypatch.setattr(triton_persistent, "ENABLED", True)
    x = _input((256, 256), None)
    want = triton_cast.cast_current(x, E4, True, True, one_launch=False)
    with pytest.warns(RuntimeWarning, match="one-launch current-scaling cast unavailable"):
        got = triton_cast.cast_current(x, E4, True, True)
    assert _same(got, want) and not triton_persistent.ENABLED
    with pytest.raises(RuntimeError, match="no cooperative launch"):
        triton_cast.cast_current(x, E4, True, True, one_launch=True)
