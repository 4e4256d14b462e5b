"""Probe: log Python's garbage collections (duration, objects tracked) and Triton's JIT compilations to stderr.

Put this folder on PYTHONPATH with ``PROBE_GC_LOG=1``: every Python process started then (torchrun's
workers too) prints one line per collection of generation >= ``PROBE_GC_MIN_GEN`` (default 2), so a
training log shows where a slow iteration's collection fell. ``PROBE_TRITON_LOG=1``: one line per Triton compilation
(a kernel specialized anew mid-run), with its time. ``PROBE_SYNC_DEBUG=1``: torch warns at every operation that
synchronizes the host with the GPU (``torch.cuda.set_sync_debug_mode``), once per call site."""

import gc
import os
import sys
import time

if os.environ.get("PROBE_GC_LOG") == "1":
    _min_gen = int(os.environ.get("PROBE_GC_MIN_GEN", "2"))
    _start: list[float] = [0.0]

    def _log(phase: str, info: dict) -> None:
        if info["generation"] < _min_gen:
            return
        if phase == "start":
            _start[0] = time.perf_counter()
            return
        ms = (time.perf_counter() - _start[0]) * 1e3
        tracked = f", tracked {len(gc.get_objects())}" if info["generation"] == 2 else ""  # (costly: full ones only)
        print(f"[gc pid {os.getpid()}] gen {info['generation']} {ms:.1f} ms, collected {info['collected']}{tracked}",
              file=sys.stderr, flush=True)

    gc.callbacks.append(_log)

if os.environ.get("PROBE_TRITON_LOG") == "1":  # Triton's JIT compilations (a cache miss at run time), timed
    try:
        from triton import knobs
    except ImportError:
        knobs = None
    if knobs is not None:
        _compile_start: list[float] = [0.0]

        def _miss(**kw: object) -> bool:
            _compile_start[0] = time.perf_counter()
            return False

        def _compiled(**kw: object) -> bool:
            ms = (time.perf_counter() - _compile_start[0]) * 1e3
            print(f"[triton pid {os.getpid()}] compiled in {ms:.1f} ms: {str(kw.get('repr'))[:300]}",
                  file=sys.stderr, flush=True)
            return False

        knobs.runtime.jit_cache_hook = _miss
        knobs.runtime.jit_post_compile_hook = _compiled

if os.environ.get("PROBE_SYNC_DEBUG") == "1":  # every op that makes the host wait on the GPU: a warning per call site
    import torch

    torch.cuda.set_sync_debug_mode("warn")
