"""Shared helpers of the torchrun workers: process-group setup, a Megatron-like config, and a
``Checker`` that records every comparison (bitwise or within tolerance) and reports failures
and the largest measured error as one JSON line for the launching pytest test."""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_fp8.parallel import ParallelConfig

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(TESTS_DIR))  # the repo root: import megatron_fp8
sys.path.insert(0, TESTS_DIR)  # conftest.RECIPES

REPORT_TAG = "TP_WORKER_REPORT "


def shutdown() -> None:
    """Leave the process group together: a barrier first, so no rank tears down gloo while a
    peer still talks to it (that race aborted a rank about 1 run in 6), and no autograd graph
    left holding a collective's work object (examples/train_tp.py still aborted now and then at
    exit, "terminate called without an active exception", until it collected them first)."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def init_gloo() -> tuple[int, int]:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    return dist.get_rank(), dist.get_world_size()


@dataclass
class Config(ParallelConfig):
    """The package's ParallelConfig, allocating on CPU (the workers run on gloo)."""

    use_cpu_initialization: bool = True


@dataclass
class Checker:
    """Records comparisons per category; ``max_rel`` keeps the largest relative error seen in
    each tolerance category."""

    rank: int
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    max_rel: dict[str, float] = field(default_factory=dict)

    def _count(self, cat: str) -> None:
        self.counts[cat] = self.counts.get(cat, 0) + 1

    def fail(self, cat: str, msg: str) -> None:
        self._count(cat)
        self.failures.append(f"[rank {self.rank}] {cat}: {msg}")

    def true(self, cat: str, ok: bool, msg: str) -> None:
        self._count(cat)
        if not ok:
            self.failures.append(f"[rank {self.rank}] {cat}: {msg}")

    def bitwise(self, cat: str, name: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
        self._count(cat)
        if got is None or want is None:
            if got is not want:
                self.failures.append(f"[rank {self.rank}] {cat}: {name}: one of the tensors is None")
            return
        if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
            diff = _rel(got, want) if got.shape == want.shape else float("nan")
            self.failures.append(f"[rank {self.rank}] {cat}: {name}: not bitwise equal "
                                 f"(shapes {tuple(got.shape)} vs {tuple(want.shape)}, rel diff {diff:.3e})")

    def close(self, cat: str, name: str, got: torch.Tensor | None, want: torch.Tensor | None,
              rtol: float, norm: bool = False) -> None:
        """``max|got - want| <= rtol * max|want|`` (a scale-aware bound for sums reordered); with
        ``norm``, ``|got - want| <= rtol * |want|`` in Frobenius norm (for differences that a few
        elements carry: FP8 rounding steps)."""
        self._count(cat)
        if got is None or want is None or got.shape != want.shape:
            self.failures.append(f"[rank {self.rank}] {cat}: {name}: missing or shape mismatch")
            return
        rel = _rel_norm(got, want) if norm else _rel(got, want)
        key = f"{cat} (norm)" if norm else cat
        self.max_rel[key] = max(self.max_rel.get(key, 0.0), rel)
        if not rel <= rtol:
            self.failures.append(f"[rank {self.rank}] {cat}: {name}: rel diff{' in norm' if norm else ''} "
                                 f"{rel:.3e} > {rtol:.1e}")

    def guard(self, cat: str, name: str, fn: Any, *args: Any) -> None:
        """Run one case; an exception is a failure of the case, not a crash of the worker."""
        try:
            fn(*args)
        except Exception:
            self.fail(cat, f"{name} raised:\n{traceback.format_exc()}")

    def report(self) -> int:
        """Gather every rank's results on rank 0, print the JSON report; return the exit code."""
        mine = {"counts": self.counts, "failures": self.failures, "max_rel": self.max_rel}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        failures = [f for r in everyone for f in r["failures"]]
        if self.rank == 0:
            counts: dict[str, int] = {}
            max_rel: dict[str, float] = {}
            for r in everyone:
                for k, v in r["counts"].items():
                    counts[k] = counts.get(k, 0) + v
                for k, v in r["max_rel"].items():
                    max_rel[k] = max(max_rel.get(k, 0.0), v)
            for f in failures[:50]:
                print(f, flush=True)
            print(REPORT_TAG + json.dumps({"world": dist.get_world_size(), "counts": counts,
                                           "failures": len(failures), "max_rel": max_rel}), flush=True)
        return 1 if failures else 0


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item() or 1.0
    return (got.float() - want.float()).abs().max().item() / scale


def _rel_norm(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.float().norm().item() or 1.0
    return (got.float() - want.float()).norm().item() / scale
