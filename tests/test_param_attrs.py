"""Parameter attributes identical to megatron-core's, on the installed version
(``dist_workers/attrs_worker.py``, 2 ranks, gloo): every attribute of every parameter of our
Column/Row and grouped expert linears over a TP / ETP / EP / SP / is_expert grid, and an MoE
layer at TP=2, ETP=1 through megatron-core's DDP with the expert gradients of megatron-core's
own layer, bitwise, and with ``gradient_accumulation_fusion`` (overlapped reduction) every
gradient of the unfused layer, bitwise. ``MEGATRON_FP8_OTHER_MCORE=DIR`` runs the worker a second time with the
megatron-core found in ``DIR`` first on the path (e.g. a Megatron-LM checkout: main's 0.20).

In process: the rule that puts expert parameters on the expert groups, as each megatron-core
version states it (0.16: EP > 1; 0.19: or ETP != TP; 0.20: or the expert GTP remat size differs).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from megatron_fp8.parallel import _mcore
from tests.dist_workers.launch import WorkerRun, run_workers

_runs: dict[str, WorkerRun] = {}


def _report(extra_path: str | None) -> dict:
    pytest.importorskip("megatron.core")
    key = extra_path or ""
    if key not in _runs:
        old = os.environ.get("PYTHONPATH")
        if extra_path:
            os.environ["PYTHONPATH"] = extra_path + (os.pathsep + old if old else "")
        try:
            _runs[key] = run_workers("attrs_worker.py", 2, timeout=300)
        finally:
            if extra_path:
                os.environ.pop("PYTHONPATH") if old is None else os.environ.__setitem__("PYTHONPATH", old)
    return _runs[key].fail_if_broken()


_VERSIONS = [None] + ([os.environ["MEGATRON_FP8_OTHER_MCORE"]] if os.environ.get("MEGATRON_FP8_OTHER_MCORE") else [])


@pytest.mark.distributed
@pytest.mark.megatron
@pytest.mark.parametrize("extra_path", _VERSIONS, ids=lambda p: "installed" if p is None else "other")
def test_parameter_attributes_match_megatron_core(extra_path: str | None) -> None:
    report = _report(extra_path)
    # 6 (TP, ETP, EP) points, SP on/off where TP > 1, expert on/off: 2 layer kinds each, and
    # per expert point the grouped linears' 2 x (2 weights + 2 biases); per rank
    assert report["counts"]["attrs"] == 108 * report["world"]
    assert report["failures"] == 0


@pytest.mark.distributed
@pytest.mark.megatron
@pytest.mark.parametrize("extra_path", _VERSIONS, ids=lambda p: "installed" if p is None else "other")
def test_moe_grads_through_megatron_ddp_bitwise_fused_or_not(extra_path: str | None) -> None:
    report = _report(extra_path)
    # 2 steps x (count + 8 expert weights against megatron-core's; the fused layer: count + every
    # parameter, the 8 expert weights among them, against ours unfused)
    assert report["counts"]["ddp"] >= 2 * (1 + 8 + 1 + 8) * report["world"]
    assert report["failures"] == 0


def _cfg(tp: int, etp: int | None, ep: int, gtp: int | None = None, egtp: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp,
                           expert_model_parallel_size=ep, gtp_weight_remat_size=gtp,
                           expert_gtp_weight_remat_size=egtp)


@pytest.mark.parametrize("terms, tp2_etp1, egtp", [
    ((), False, False),                                       # megatron-core 0.16
    (("expert_tensor_parallel_size",), True, False),          # 0.19
    (("expert_tensor_parallel_size", "expert_gtp_weight_remat_size"), True, True),  # 0.20
])
def test_expert_group_rule_per_version(monkeypatch: pytest.MonkeyPatch, terms: tuple[str, ...], tp2_etp1: bool,
                                       egtp: bool) -> None:
    monkeypatch.setattr(_mcore, "_expert_group_terms", lambda: terms)
    assert _mcore.uses_expert_groups(_cfg(2, 1, 1), is_expert=True) is tp2_etp1  # the case
    assert _mcore.uses_expert_groups(_cfg(1, 1, 2), is_expert=True)  # EP > 1: every version
    assert not _mcore.uses_expert_groups(_cfg(2, 1, 2), is_expert=False)  # dense layers never
    assert not _mcore.uses_expert_groups(_cfg(2, 2, 1), is_expert=True)
    assert not _mcore.uses_expert_groups(_cfg(2, None, 1), is_expert=True)  # ETP unset: follows TP
    assert _mcore.uses_expert_groups(_cfg(1, 1, 1, gtp=1, egtp=2), is_expert=True) is egtp


# what each version's ColumnParallelLinear says (read in 0.16.1, 0.19.2 and Megatron-LM main's 0.20.0)
_KNOWN = {(0, 16): (), (0, 19): ("expert_tensor_parallel_size",),
          (0, 20): ("expert_tensor_parallel_size", "expert_gtp_weight_remat_size")}


def test_the_installed_rule_is_read_off_megatron_core() -> None:
    pytest.importorskip("megatron.core.tensor_parallel.layers")
    from megatron.core.package_info import __version__

    version = tuple(int(p) for p in __version__.split(".")[:2])
    if version not in _KNOWN:
        pytest.skip(f"megatron-core {__version__}: its rule was not read by hand")
    _mcore._expert_group_terms.cache_clear()
    assert _mcore._expert_group_terms() == _KNOWN[version]
