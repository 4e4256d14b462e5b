"""The CUDA C tile casts (``kernels.cuda_cast``: 1x128, 128x128, tensor with given scales, and
current scaling through it) against the Triton casts they stand in for and the CPU reference,
bit for bit: plain tensors and experts (empty ones included), E4M3 and E5M2, zeros, NaN, inf,
overflowing and subnormal inputs; and the casts it must leave to Triton (skip without CUDA; run
on the device machine)."""

from __future__ import annotations

import pytest
import torch

from megatron_fp8.kernels import cuda_cast
from megatron_fp8.quant.kernels import segment_offsets
from megatron_fp8.quant.quantizers import Block1DQuantizer
from megatron_fp8.testing import same_bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _input(m: int, k: int) -> torch.Tensor:
    x = (torch.randn(m, k) * torch.logspace(-3, 3, m).unsqueeze(1)).to(torch.bfloat16)
    x[:128, :128] = 0.0  # a zero block: scale 1
    # block amaxes are over finite values; NaN and +-inf get the reference's bytes
    x[1, 2], x[(m - 2), 5], x[7, k - 1], x[3, 9] = float("nan"), float("inf"), -3.0e4, float("-inf")
    x[m - 1, k // 2] = 1e-40  # subnormal (BF16 has FP32's exponent range)
    return x.cuda()


def _spy(monkeypatch) -> list[bool]:
    """Record whether each ``cuda_cast.cast`` call ran the kernel."""
    calls: list[bool] = []
    real = cuda_cast.cast

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out)
        return out

    monkeypatch.setattr(cuda_cast, "cast", counted)
    return calls


@pytest.mark.parametrize("dtype", [E4, E5], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(128, 128), (512, 1024), (2048, 7168)])
def test_plain_cast_equals_triton_and_reference(shape: tuple[int, int], dtype: torch.dtype, monkeypatch) -> None:
    from megatron_fp8.kernels.triton_cast import cast_tiles

    x = _input(*shape)
    calls = _spy(monkeypatch)
    got = cast_tiles(x, dtype, "1x128", True, True)
    assert calls == [True], "the CUDA kernel should have served this cast"
    monkeypatch.setenv("MEGATRON_FP8_CUDA_CAST", "0")
    want = cast_tiles(x, dtype, "1x128", True, True)
    assert calls == [True], "MEGATRON_FP8_CUDA_CAST=0 should leave the cast to Triton"
    assert same_bits([*got[0], *got[1]], [*want[0], *want[1]])
    monkeypatch.delenv("MEGATRON_FP8_CUDA_CAST")
    q = Block1DQuantizer(dtype)
    on_gpu = q.quantize(x, rowwise=True, columnwise=True)
    on_cpu = q.quantize(x.cpu(), rowwise=True, columnwise=True)
    assert same_bits(list(on_gpu.tensors()), list(on_cpu.tensors()))


@pytest.mark.parametrize("dtype", [E4, E5], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("splits", [[0, 256, 128, 0, 384, 1280], [2048] * 8, [128] * 40])
def test_segments_equal_triton(splits: list[int], dtype: torch.dtype, monkeypatch) -> None:
    from megatron_fp8.kernels.triton_cast import cast_segments

    x = _input(sum(splits), 512)
    offs = segment_offsets(splits, x.device)
    calls = _spy(monkeypatch)
    got = cast_segments(x, offs, splits, dtype, "1x128", True, True)
    monkeypatch.setenv("MEGATRON_FP8_CUDA_CAST", "0")
    want = cast_segments(x, offs, splits, dtype, "1x128", True, True)
    assert calls == [True]
    assert same_bits(got, want)


def test_leaves_other_casts_to_triton() -> None:
    x = torch.zeros(256, 256, dtype=torch.bfloat16, device="cuda")
    for mode in ("1x128", "128x128", "tensor"):
        assert cuda_cast.serves(x, E4, mode, True, True, True)
    assert not cuda_cast.serves(x, E4, "tensor", True, True, True, scale_given=False)  # fused current cast
    assert not cuda_cast.serves(x, E4, "mx", True, True, True)
    assert not cuda_cast.serves(x.float(), E4, "1x128", True, True, True)  # FP32 input
    assert not cuda_cast.serves(x[:200], E4, "1x128", True, True, True)  # rows not a multiple of 128
    assert not cuda_cast.serves(x[:, :200].contiguous(), E4, "1x128", True, True, True)  # columns likewise
    assert not cuda_cast.serves(x, E4, "1x128", True, False, True)  # one copy only
    assert not cuda_cast.serves(x, E4, "1x128", False, True, True)
    assert not cuda_cast.serves(x, E4, "tensor", True, True, False)  # segments not aligned to 128 rows
    assert not cuda_cast.serves(x.t(), E4, "1x128", True, True, True)  # not contiguous


@pytest.mark.parametrize("dtype", [E4, E5], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("splits", [None, [2048] * 4, [0, 256, 128, 0, 384, 1280]])
@pytest.mark.parametrize("mode", ["128x128", "tensor"])
def test_other_modes_equal_triton(mode: str, splits: list[int] | None, dtype: torch.dtype, monkeypatch) -> None:
    """128x128 (the experts' weights stacked) and tensor mode with given per-segment scales
    (delayed scaling) that make values overflow: CUDA == Triton, bit for bit."""
    from megatron_fp8.kernels.triton_cast import cast_segments, cast_tiles
    from megatron_fp8.quant.kernels import aligned_copy

    x = _input(sum(splits) if splits else 1024, 512)
    n = len(splits) if splits else 1
    scale = aligned_copy(torch.logspace(-2, 4, n, device="cuda")) if mode == "tensor" else None
    calls = _spy(monkeypatch)

    def run() -> list[torch.Tensor]:
        if splits is None:
            row, col = cast_tiles(x, dtype, mode, True, True, scale)
            return [t for t in (*row, *col) if t is not None]
        return [t for t in cast_segments(x, segment_offsets(splits, x.device), splits, dtype, mode, True, True, scale)
                if t is not None]

    got = run()
    monkeypatch.setenv("MEGATRON_FP8_CUDA_CAST", "0")
    want = run()
    assert calls == [True]
    assert same_bits(got, want)


@pytest.mark.parametrize("dtype", [E4, E5], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("splits", [None, [2048] * 4, [256, 128, 384, 1280]])
def test_current_scaling_through_cuda_equals_one_launch(splits: list[int] | None, dtype: torch.dtype,
                                                        monkeypatch) -> None:
    """``MEGATRON_FP8_CUDA_CURRENT=1``: amax and scale launches, then the CUDA tensor cast; the
    same data and scales as the one-launch Triton cast, and (plain) as the CPU reference."""
    from megatron_fp8.quant import kernels
    from megatron_fp8.quant.quantizers import CurrentScalingQuantizer

    x = _input(sum(splits) if splits else 1024, 512)
    x[x.isnan() | x.isinf()] = 1.0  # current scaling's amax would make the scale 1

    def run() -> list[torch.Tensor]:
        if splits is None:
            out = kernels.cast_current(x, dtype, True, True, power_2_scale=False, amax_epsilon=0.0)
        else:
            out = kernels.cast_current_segments(x, splits, dtype, True, True, power_2_scale=False, amax_epsilon=0.0)
        return list(out)

    calls = _spy(monkeypatch)
    monkeypatch.setenv("MEGATRON_FP8_CUDA_CURRENT", "1")
    got = run()
    assert calls == [True]
    monkeypatch.setenv("MEGATRON_FP8_CUDA_CURRENT", "0")
    want = run()
    assert calls == [True]
    assert same_bits(got, want)
    if splits is None:
        monkeypatch.setenv("MEGATRON_FP8_CUDA_CURRENT", "1")
        q = CurrentScalingQuantizer(dtype)
        on_gpu = q.quantize(x, rowwise=True, columnwise=True)
        on_cpu = q.quantize(x.cpu(), rowwise=True, columnwise=True)
        assert same_bits(list(on_gpu.tensors()), list(on_cpu.tensors()))


def test_current_scaling_default_takes_cuda_only_in_capture(monkeypatch) -> None:
    """``MEGATRON_FP8_CUDA_CURRENT`` unset (``capture``): an eager current-scaling cast is the
    one-launch Triton cast (less host time) that builds the CUDA kernel for the captures to
    come; the same cast captured in a CUDA graph goes through that kernel (as does
    ``capture_step``'s warm-up, run under the capture's settings), and the replay gives the eager
    cast's bits."""
    from megatron_fp8.quant import kernels
    from megatron_fp8.testing import capture_step

    monkeypatch.delenv("MEGATRON_FP8_CUDA_CURRENT", raising=False)
    x = _input(1024, 512)
    x[x.isnan() | x.isinf()] = 1.0
    splits = [256, 512, 256]
    calls = _spy(monkeypatch)

    def run() -> list[torch.Tensor]:
        return list(kernels.cast_current_segments(x, splits, E4, True, True, power_2_scale=False, amax_epsilon=0.0))

    cuda_cast._kernel.cache_clear()
    eager = run()
    assert calls == []
    assert cuda_cast._kernel.cache_info().currsize == 1, "the eager cast should have built the CUDA kernel"
    graph, captured = capture_step(run, warmup=1)
    assert calls == [True, True], "the warm-up and the captured cast should have gone through the CUDA kernel"
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(captured, eager)


def test_builds_and_launches_on_a_fresh_thread() -> None:
    """The cast built and launched first on a thread whose only CUDA work is this cast (as the
    autograd engine's backward thread when a backward starts with it): the driver API needs a
    current context there (``cuda_cast.ensure_context``). A fresh process: builds are cached."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import os, threading, warnings, torch
from megatron_fp8.kernels import cuda_cast
from megatron_fp8.kernels.triton_cast import cast_tiles
from megatron_fp8.testing import same_bits
warnings.simplefilter("error")  # a failed build warns
x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)  # the main thread's CUDA work
got = {}
def work():
    got["out"] = cast_tiles(x, torch.float8_e5m2, "1x128", True, True)
    got["built"] = cuda_cast.prebuild("1x128", torch.float8_e5m2, x.device) is not None
t = threading.Thread(target=work); t.start(); t.join()
torch.cuda.synchronize()
os.environ["MEGATRON_FP8_CUDA_CAST"] = "0"
want = cast_tiles(x, torch.float8_e5m2, "1x128", True, True)
assert got["built"] and same_bits([*got["out"][0], *got["out"][1]], [*want[0], *want[1]])
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-4000:]


@pytest.mark.parametrize("dtype", [E4, E5], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", ["1x128", "tensor"])
def test_gathered_cast_equals_the_cast_of_the_padded_tensor(mode: str, dtype: torch.dtype, monkeypatch) -> None:
    """Experts zero-padded to 128 rows, cast from their unpadded rows (``cast_segments_gathered``:
    the padding read as zeros, never written) == the cast of the padded tensor, bit for bit, with
    router-like counts (an empty expert, one of a single row, one already a multiple of 128)."""
    from megatron_fp8.kernels.triton_cast import cast_segments, cast_segments_gathered
    from megatron_fp8.ops.padding import expert_rows
    from megatron_fp8.quant.kernels import aligned_copy, pad_expert_rows

    real = [293, 0, 1, 256, 219, 127]
    x = _input(sum(real), 512)
    rows, padded = expert_rows(real, 128, x.device)
    xp = pad_expert_rows(x, rows, sum(padded))
    scale = aligned_copy(torch.logspace(-2, 4, len(real), device="cuda")) if mode == "tensor" else None
    calls = _spy(monkeypatch)
    got = cast_segments_gathered(x, segment_offsets(real, x.device), segment_offsets(padded, x.device), padded, dtype,
                                 mode, scale)
    assert got is not None and calls == [True]
    want = cast_segments(xp, segment_offsets(padded, x.device), padded, dtype, mode, True, True, scale)
    assert same_bits([t for t in got if t is not None], [t for t in want if t is not None])


@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_grouped_layer_gathered_casts_equal_padding_first(recipe: str, monkeypatch) -> None:
    """A grouped layer with router splits: its x and dy casts read the experts' unpadded rows
    (``kernels.cast_gathered``; current scaling under ``MEGATRON_FP8_CUDA_CURRENT=1``, as while a
    graph is captured) and its GEMMs write only the real rows; output and gradients equal those with
    the padded tensors written first, bit for bit, on the lean and the general path."""
    import megatron_fp8 as mf
    from megatron_fp8.modules.grouped import GroupedLinear
    from megatron_fp8.quant import kernels
    from megatron_fp8.recipe import PRESETS
    from megatron_fp8.testing import router_splits

    monkeypatch.setenv("MEGATRON_FP8_CUDA_CURRENT", "1")
    splits = router_splits(4096, 8, 2, seed=3)
    assert any(m % 128 for m in splits)
    torch.manual_seed(0)
    layer = GroupedLinear(8, 1024, 512, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(sum(splits), 1024, device="cuda").bfloat16()
    dy = torch.randn(sum(splits), 512, device="cuda").bfloat16()
    gathered = []
    real = kernels.cast_gathered

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        gathered.append(out is not None)
        return out

    runs = {}
    for lean in ("auto", "0"):
        monkeypatch.setenv("MEGATRON_FP8_LEAN", lean)
        for gather in (True, False):
            monkeypatch.setattr(kernels, "cast_gathered", spy if gather else lambda *a, **k: None)
            gathered.clear()
            xi = x.clone().requires_grad_()
            with mf.fp8_autocast(fp8_recipe=PRESETS[recipe]):
                y = layer(xi, splits)
            y.backward(dy)
            runs[lean, gather] = [y.detach(), xi.grad, *(w.grad.clone() for w in layer.weights)]
            layer.zero_grad(set_to_none=True)
            if gather:
                assert gathered == [True, True], f"x's and dy's casts should read the unpadded rows ({lean})"
        assert same_bits(runs[lean, True], runs[lean, False])
