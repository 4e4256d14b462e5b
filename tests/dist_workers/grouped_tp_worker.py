"""torchrun worker: expert-TP Column/RowParallelGroupedLinear vs the TP=1 ``GroupedLinear``.

Every rank builds the same full expert weights, inputs and splits (one expert with no tokens,
one whose count is not a multiple of 128), runs the TP=1 reference and the parallel layer on its
shard, for column/row x FP8 off/every recipe x save_original_input on/off, and checks:

* ``grouped_column`` (bitwise): fprop shard, every expert's wgrad and bias-grad shards;
* ``grouped_row`` (bitwise): dgrad shard, every expert's wgrad shard;
* ``grouped_reduced`` (within RTOL): what the dispatcher's reduction sums over TP (column dgrad
  partials, row fprop partials), all-reduced here;
* ``grouped_flag``: save_original_input on == off, bitwise;
* ``grouped_extras``: clear errors, per-expert ``sharded_state_dict`` keys and expert offsets.

Shapes: K = N = 128 * tp so every 128x128 weight block lies inside one shard.
"""

from __future__ import annotations

import sys
import zlib
from typing import Any

import torch
import torch.distributed as dist
from common import Checker, Config, init_gloo, shutdown
from conftest import RECIPES

import megatron_fp8 as mf
from megatron_fp8.modules.grouped import GroupedLinear
from megatron_fp8.parallel.grouped import ColumnParallelGroupedLinear, RowParallelGroupedLinear

RTOL = 1e-5
SPLITS = [128, 0, 160]
RECIPE_NAMES = [None, *RECIPES]


def _steps(recipe: str | None) -> int:
    return 2 if recipe == "delayed" else 1


def _run(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, recipe: str | None, tp_layer: bool) -> list[dict]:
    results = []
    for _ in range(_steps(recipe)):
        layer.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_(True)
        with mf.fp8_autocast(enabled=recipe is not None, fp8_recipe=RECIPES[recipe] if recipe else None):
            out = layer(xi, SPLITS)
        y = out[0] if tp_layer else out
        y.backward(dy)
        results.append({"out": y.detach(), "dx": xi.grad, "dw": [w.grad for w in layer.weights],
                        "db": [b.grad for b in layer.biases] if layer.biases else None})
    return results


class Case:
    def __init__(self, kind: str, recipe: str | None, rank: int, tp: int) -> None:
        self.kind, self.recipe, self.rank, self.tp = kind, recipe, rank, tp
        self.name = f"grouped {kind} recipe={recipe}"
        self.k = self.n = 128 * tp
        self.bias = kind == "column"
        g = torch.Generator().manual_seed(zlib.crc32(self.name.encode()))
        e = len(SPLITS)
        self.w = [torch.randn(self.n, self.k, generator=g) * 0.05 for _ in range(e)]
        self.b = [torch.randn(self.n, generator=g) for _ in range(e)]
        self.x = torch.randn(sum(SPLITS), self.k, generator=g)
        self.dy = torch.randn(sum(SPLITS), self.n, generator=g)

    def shard(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(self.tp, dim=dim)[self.rank].clone()

    def reference(self) -> list[dict]:
        ref = GroupedLinear(len(SPLITS), self.k, self.n, bias=self.bias)
        self._load(ref, self.w, self.b)
        return _run(ref, self.x, self.dy, self.recipe, tp_layer=False)

    def _load(self, layer: Any, ws: list[torch.Tensor], bs: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for i, w in enumerate(ws):
                getattr(layer, f"weight{i}").copy_(w)
                if self.bias:
                    getattr(layer, f"bias{i}").copy_(bs[i])

    def build(self, soi: bool) -> Any:
        kw: dict[str, Any] = dict(config=Config(), init_method=torch.nn.init.zeros_, bias=self.bias,
                                  skip_bias_add=False, is_expert=True, tp_group=dist.group.WORLD,
                                  save_original_input=soi)
        if self.kind == "column":
            layer = ColumnParallelGroupedLinear(len(SPLITS), self.k, self.n, name="fc1", **kw)
            self._load(layer, [self.shard(w, 0) for w in self.w], [self.shard(b, 0) for b in self.b])
        else:
            layer = RowParallelGroupedLinear(len(SPLITS), self.k, self.n, name="fc2", **kw)
            self._load(layer, [self.shard(w, 1) for w in self.w], self.b)
        return layer

    def check(self, ck: Checker) -> None:
        refs = self.reference()
        x = self.x if self.kind == "column" else self.shard(self.x, 1)
        dy = self.shard(self.dy, 1) if self.kind == "column" else self.dy
        runs = {soi: _run(self.build(soi), x, dy, self.recipe, tp_layer=True) for soi in (False, True)}
        for step, ref in enumerate(refs):
            tag = f"{self.name} step={step}"
            got = runs[False][step]
            for key in ("out", "dx"):
                ck.bitwise("grouped_flag", f"{tag} {key} flag on vs off", runs[True][step][key], got[key])
            for i, (a, b) in enumerate(zip(runs[True][step]["dw"], got["dw"])):
                ck.bitwise("grouped_flag", f"{tag} dw{i} flag on vs off", a, b)
            self._compare(ck, tag, got, ref)

    def _compare(self, ck: Checker, tag: str, got: dict, ref: dict) -> None:
        if self.kind == "column":
            cat = "grouped_column"
            ck.bitwise(cat, f"{tag} out shard", got["out"], self.shard(ref["out"], 1))
            dx = got["dx"].clone()
            dist.all_reduce(dx)
            ck.close("grouped_reduced", f"{tag} dx (partials summed)", dx, ref["dx"], RTOL)
            for i, (dw, want) in enumerate(zip(got["dw"], ref["dw"])):
                ck.bitwise(cat, f"{tag} dw{i} shard", dw, self.shard(want, 0))
            for i, (db, want) in enumerate(zip(got["db"], ref["db"])):
                ck.bitwise(cat, f"{tag} db{i} shard", db, self.shard(want, 0))
            return
        cat = "grouped_row"
        out = got["out"].clone()
        dist.all_reduce(out)
        ck.close("grouped_reduced", f"{tag} out (partials summed)", out, ref["out"], RTOL)
        ck.bitwise(cat, f"{tag} dx shard", got["dx"], self.shard(ref["dx"], 1))
        for i, (dw, want) in enumerate(zip(got["dw"], ref["dw"])):
            ck.bitwise(cat, f"{tag} dw{i} shard", dw, self.shard(want, 1))


def _raises(ck: Checker, what: str, fn: Any, match: str) -> None:
    try:
        fn()
    except ValueError as e:
        ck.true("grouped_extras", match in str(e), f"{what}: message {e!s} lacks {match!r}")
        return
    ck.fail("grouped_extras", f"{what}: no error raised")


def check_extras(ck: Checker, rank: int, tp: int) -> None:
    kw: dict[str, Any] = dict(config=Config(), tp_group=dist.group.WORLD, is_expert=True)
    _raises(ck, "row bias", lambda: RowParallelGroupedLinear(2, 256, 256, bias=True, skip_bias_add=False,
                                                            name="fc2", **kw), "needs skip_bias_add=True")
    _raises(ck, "indivisible", lambda: ColumnParallelGroupedLinear(2, 256, 129, bias=False, skip_bias_add=False,
                                                                  **kw), "output_size=129 is not divisible")
    _raises(ck, "not expert", lambda: ColumnParallelGroupedLinear(
        2, 256, 256, bias=False, skip_bias_add=False, config=Config(), tp_group=dist.group.WORLD,
        is_expert=False), "is_expert=True")
    layer = ColumnParallelGroupedLinear(2, 256, 128 * tp, bias=True, skip_bias_add=True, **kw)
    with mf.fp8_autocast(fp8_recipe=RECIPES["delayed"]):
        layer(torch.randn(4, 256), [1, 3])
    solo = [dist.new_group([r]) for r in range(tp)][rank]
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return
    sd = layer.sharded_state_dict(prefix="experts.fc1.", metadata={"dp_cp_group": solo})
    want = {"experts.fc1.weight0", "experts.fc1.weight1", "experts.fc1.bias0", "experts.fc1.bias1",
            "experts.fc1._extra_state", "experts.fc1._extra_state1"}
    ck.true("grouped_extras", set(sd) == want, f"sharded keys {sorted(sd)}")
    w1 = sd["experts.fc1.weight1"]
    ck.true("grouped_extras", (w1.key, w1.global_offset) == ("experts.fc1.weight", (1, rank * 128, 0)),
            f"weight1: key {w1.key}, offset {w1.global_offset}")
    # expert parallelism over both ranks (TP=1): the experts' copies are counted over the
    # expert-data-parallel group (here each rank alone), not the dense data-parallel one
    # (metadata's dp_cp_group, both ranks), or no rank but the first would save its experts
    from types import SimpleNamespace

    ep = SimpleNamespace(ep=dist.group.WORLD, expt_tp=solo, expt_dp=solo)
    experts = ColumnParallelGroupedLinear(2, 256, 128, bias=False, skip_bias_add=False, config=Config(),
                                          pg_collection=ep, is_expert=True)
    esd = experts.sharded_state_dict(prefix="e.", metadata={"dp_cp_group": dist.group.WORLD})
    ck.true("grouped_extras", {v.replica_id[2] for v in esd.values()} == {0},
            f"expert-parallel replica ids {sorted((k, v.replica_id) for k, v in esd.items())}")
    ck.true("grouped_extras", esd["e.weight1"].global_offset[0] == 2 * rank + 1,
            f"expert-parallel offset {esd['e.weight1'].global_offset}")
    plain = {k: v for k, v in layer.state_dict().items()}
    plain["_extra_state1"] = layer.expert_extra_state(1)
    plain["_extra_state"] = layer.expert_extra_state(0)
    fresh = ColumnParallelGroupedLinear(2, 256, 128 * tp, bias=True, skip_bias_add=True, **kw)
    fresh.load_state_dict(plain)
    with mf.fp8_autocast(fp8_recipe=RECIPES["delayed"]):
        x = torch.randn(4, 256)
        ck.bitwise("grouped_extras", "per-expert extra states reload", fresh(x, [1, 3])[0], layer(x, [1, 3])[0])


def main() -> int:
    rank, tp = init_gloo()
    ck = Checker(rank)
    for kind in ("column", "row"):
        for recipe in RECIPE_NAMES:
            case = Case(kind, recipe, rank, tp)
            ck.guard(f"grouped_{kind}", case.name, case.check, ck)
    ck.guard("grouped_extras", "extras", check_extras, ck, rank, tp)
    code = ck.report()
    shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
