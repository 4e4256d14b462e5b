"""``kernels/cuda_cast.cu`` builds for SM90 in every configuration the package and the probe use
(mode, FP8 format, blocks an SM, the probe's KFAST, STREAM and NOCLAMP switches), on a machine without a
GPU: NVRTC compiles it to an sm_90 CUBIN (its ptxas included), as ``torch.cuda._compile_kernel``
will on the device. Catches a kernel that would not build before device time is spent on it.

Needs NVRTC: ``MEGATRON_FP8_NVRTC`` names ``libnvrtc.so.*`` (CI installs the
``nvidia-cuda-nvrtc`` wheel of the device's CUDA, 13.0, apart from the environment); skipped
otherwise."""

from __future__ import annotations

import ctypes
import itertools
import os
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "megatron_fp8" / "kernels" / "cuda_cast.cu"
LIB = os.environ.get("MEGATRON_FP8_NVRTC", "")
pytestmark = pytest.mark.skipif(not LIB or not Path(LIB).is_file(),
                                reason="set MEGATRON_FP8_NVRTC to a libnvrtc.so (see .ci/run)")


def _nvrtc() -> ctypes.CDLL:
    for builtins in sorted(Path(LIB).parent.glob("libnvrtc-builtins.so.*")):  # loaded by name at compile time
        if ".alt." not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(LIB)


def _build(options: list[str]) -> tuple[int, str]:
    """NVRTC's return code and log for an sm_90 CUBIN of the source under ``options``."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), SRC.read_bytes(), b"cuda_cast.cu", 0, None, None) == 0
    opts = [o.encode() for o in ["-arch=sm_90", "--ptxas-options=-v", *options]]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


# (blocks an SM, KFAST, STREAM, NOCLAMP): the package's builds (3, KFAST, STREAM, with and without
# the clamp) and every variant scripts/probes/probe_cuda_cast.py times, in every mode and format
VARIANTS = [(3, 1, 1, 1), (3, 1, 1, 0), (3, 0, 0, 0), (4, 0, 0, 0), (3, 1, 0, 0), (3, 0, 1, 0), (3, 0, 0, 1),
            (4, 0, 0, 1)]
CONFIGS = [(mode, e5m2, *v, 0) for mode, e5m2, v in itertools.product((0, 1, 2), (0, 1), VARIANTS)]
# the gathered casts (padded experts read from their unpadded rows) in the package's builds
CONFIGS += [(mode, e5m2, *v, 1) for mode, e5m2, v in itertools.product((0, 1, 2), (0, 1), VARIANTS[:2])]


@pytest.mark.parametrize("mode,e5m2,minb,kfast,stream,noclamp,gather", CONFIGS)
def test_builds_without_warnings(mode: int, e5m2: int, minb: int, kfast: int, stream: int, noclamp: int,
                                 gather: int) -> None:
    rc, log = _build([f"-DMODE={mode}", f"-DE5M2={e5m2}", f"-DMINB={minb}", f"-DKFAST={kfast}",
                      f"-DSTREAM={stream}", f"-DNOCLAMP={noclamp}", f"-DGATHER={gather}"])
    assert rc == 0, log
    assert "warning" not in log.lower(), log
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    assert regs <= 65536 // (256 * minb)  # __launch_bounds__(256, MINB) held: MINB blocks fit an SM

