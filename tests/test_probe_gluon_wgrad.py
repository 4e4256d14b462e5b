"""``scripts/probes/probe_gluon_wgrad.py`` and its Gluon kernel (``scripts/probes/gluon_wgrad.py``) without a GPU:
the buffers the probe hands the kernel hold each expert's wgrad operands and scales where the
kernel reads them (needs the one-launch casts: CUDA, or Triton's interpreter on CPU), and the
``cp.async`` kernel and the warp-specialized TMA one build for SM90 in their wrappers' default
configurations with neither spills nor ptxas's warning that it serialized the asynchronous MMAs
(what their overlap depends on). CI runs this file under ``TRITON_INTERPRET=1`` with Triton on
its path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_fp8.testing import same_bits

pytest.importorskip("triton.experimental.gluon")
SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts" / "probes")
sys.path.insert(0, SCRIPTS)
import probe_gluon_wgrad  # noqa: E402


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs CUDA or TRITON_INTERPRET=1 (the one-launch expert casts)")
@pytest.mark.parametrize("splits", [[256, 256, 256], [256, 0, 128, 384]])
def test_buffers_hold_each_experts_operands(splits: list[int]) -> None:
    k, n = 256, 384
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sets, _ = probe_gluon_wgrad.gemm_sets("blockwise", len(splits), 0, k, n, torch.device(device), splits=splits)
    pairs = sets["wgrad"]
    a_buf, b_buf, sa, sb, off = probe_gluon_wgrad._buffers(pairs, splits, n, k)
    m = sum(splits)
    assert a_buf.numel() == n * m and b_buf.numel() == k * m
    assert tuple(sa.shape) == (m // 128, n) and tuple(sb.shape) == (m // 128, k)
    assert off.tolist() == [0, *torch.tensor(splits).cumsum(0).tolist()]
    start = 0
    for (a, b, _), m_e in zip(pairs, splits):
        if m_e:
            for buf, s, op, width in ((a_buf, sa, a, n), (b_buf, sb, b, k)):
                seg = buf[width * start:width * (start + m_e)].view(width, m_e)
                assert same_bits([seg, s[start // 128:(start + m_e) // 128].t()], [op.data, op.scale_inv])
        start += m_e


@pytest.mark.parametrize("warp_specialized", [False, True])
def test_kernel_builds_for_sm90_without_spills_or_serialized_mmas(warp_specialized: bool) -> None:
    # in a process of its own: Triton's interpreter (the test above) patches the language's
    # operators in its process, which a real compile then trips over
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path if p)  # this process's Triton
    code = (f"import gluon_wgrad; ptx, report = gluon_wgrad.sm90_report({warp_specialized}); "
            "print(report); print('async waits:', ptx.count('wgmma.wait_group.sync.aligned 1;')); "
            "print('register hand-over:', 'setmaxnreg' in ptx); "
            "print('barrier before each MMA:', gluon_wgrad.barrier_before_each_mma(ptx))")
    out = subprocess.run([sys.executable, "-c", code], cwd=SCRIPTS, env=env, capture_output=True, text=True)
    text = out.stdout + out.stderr
    if out.returncode and "ptxas" in text and "No such file" in text:
        pytest.skip("no ptxas in this Triton")
    assert out.returncode == 0, text
    assert "0 bytes spill stores" in text, text
    assert "serialized" not in text and "C751" not in text, text
    assert "async waits: 0" not in text, text  # two MMAs in flight somewhere
    # the warp-specialized kernel moves registers from its copier warp to the MMA warps
    assert ("register hand-over: True" in text) == warp_specialized, text
    # the cp.async kernel's copies are only safe for the MMAs behind Triton's CTA barriers
    assert "barrier before each MMA: True" in text, text
