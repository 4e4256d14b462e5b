"""``scripts/probes/host_native.py``'s reading of py-spy's raw native samples: each frame's library,
own and inclusive shares per thread, the ATen ops on the stack (no py-spy needed)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "probes"))
import host_native  # noqa: E402

RAW = "\n".join([
    # the training thread: a launch in the driver under _scaled_mm, three samples
    "thread (11): MainThread;0x7f00 (libc.so.6);step (benchlib.py:101);forward (megatron_fp8/ops/lean.py:140);"
    "at::_ops::_scaled_mm::call (libtorch_cpu.so);cublasLtMatmul (libcublasLt.so.13);"
    "cuLaunchKernelEx (libcuda.so.1) 3",
    # the same thread waiting for autograd's device thread, one sample
    "thread (11): MainThread;0x7f00 (libc.so.6);backward (torch/autograd/__init__.py:395);"
    "torch::autograd::Engine::execute (libtorch_cpu.so);pthread_cond_wait (libc.so.6) 1",
    # the device thread in Triton's launcher module, two samples
    "thread (12);0x7f00 (libc.so.6);torch::autograd::Engine::thread_main (libtorch_cpu.so);"
    "_launch (__triton_launcher.cpython-312-x86_64-linux-gnu.so) 2",
])


def test_frame_kind_names_libraries_and_python() -> None:
    assert host_native.frame_kind("cuLaunchKernelEx (libcuda.so.1)") == "libcuda"
    assert host_native.frame_kind("cublasLtMatmul (libcublasLt.so.13)") == "libcublasLt"
    assert host_native.frame_kind("_launch (__triton_launcher.cpython-312-x86_64-linux-gnu.so)") == "__triton_launcher"
    assert host_native.frame_kind("forward (megatron_fp8/ops/lean.py:140)") == "python"
    assert host_native.frame_kind("0x7f0012") == "other"


def test_parse_counts_own_and_inclusive_shares_per_thread() -> None:
    threads = host_native.parse(RAW)
    main, device = threads["thread (11): MainThread"], threads["thread (12)"]
    assert (main.total, device.total) == (4, 2)
    assert main.own == {"libcuda": 3, "libc": 1}  # the waiting sample's top frame is libc's
    assert (main.busy, device.busy) == (3, 2)  # pthread_cond_wait: waiting
    assert main.inclusive["libcublasLt"] == 3 and main.inclusive["libtorch_cpu"] == 4
    assert main.inclusive["libc"] == 1  # libc's frames below the top (thread start) are not counted
    assert main.ops == {"_scaled_mm": 3}
    assert device.own == {"__triton_launcher": 2}
    text = host_native.table(threads)
    assert "| libcuda | 75.0% | 75.0% |" in text and "| _scaled_mm | 75.0% |" in text


def test_unnamed_top_frame_under_a_wait_is_waiting_and_phases_split_the_step() -> None:
    raw = "\n".join([
        # the training thread waiting in backward: an unnamed libc address on top of pthread_cond_wait
        "thread (11): MainThread;step (benchlib.py:101);THPEngine_run_backward (libtorch_python.so);"
        "torch::autograd::Engine::thread_main (libtorch_cpu.so);pthread_cond_wait (libc.so.6);"
        "0x7efd84498e51 (libc.so.6) 2",
        # the same thread busy in forward
        "thread (11): MainThread;step (benchlib.py:100);at::_ops::_scaled_mm::call (libtorch_cpu.so) 3",
        # and busy in backward (on the calling thread)
        "thread (11): MainThread;step (benchlib.py:101);THPEngine_run_backward (libtorch_python.so);"
        "cuLaunchKernelEx (libcuda.so.1) 1",
    ])
    main = host_native.parse(raw)["thread (11): MainThread"]
    assert main.busy == 4
    assert main.phases == {"backward, waiting": 2, "busy": 3, "backward, busy": 1}
    assert "backward, waiting 33.3%" in host_native.table({"m": main})
