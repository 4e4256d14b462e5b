"""torchrun worker: Column/RowParallelLinear vs the TP=1 ``megatron_fp8.Linear`` (gloo, CPU).

Every rank builds the same full weights and inputs, runs the TP=1 reference and the parallel
layer on its shard, and checks, for column/row x SP on/off x bias on/off x FP8 off/every recipe
x save_original_input on/off:

* ``bitwise``: column fprop and wgrad/bgrad shards, row dgrad and wgrad shards, and the row
  bias grad without SP are bitwise those of the TP=1 layer (the per-shard math is identical).
  Row dgrad: bitwise where this CPU's BLAS gives a GEMM's output columns the same bits whatever
  the output width (``_blas_width_exact``); an AVX-512 machine's did not at TP=4 (the same
  failure with the FP8 recipes off), so there the shard is checked within ``RTOL`` instead;
* ``close``: what a TP reduction reorders (column dgrad, row fprop, row bias grad with SP)
  is within ``RTOL`` of the TP=1 result;
* ``flag``: save_original_input on == off, bitwise, for out, dx, dw, db;
* ``saved``: with SP and the flag on, the input bytes saved per rank are the local shard's;
* ``errors``: bad inputs raise clear errors, emulation warns once.

Shapes are chosen so every block recipe's blocks align with the shards:
tokens per rank (s/tp * b) = 128, K = 128 * tp, N = 2 * K.
"""

from __future__ import annotations

import functools
import sys
import warnings
import zlib
from typing import Any

import torch
import torch.distributed as dist
from common import Checker, Config, init_gloo, shutdown
from conftest import RECIPES

import megatron_fp8 as mf
from megatron_fp8.memory import track_saved_tensors
from megatron_fp8.parallel import ColumnParallelLinear, RowParallelLinear, checks

RTOL = 1e-5  # FP32 sums reordered by a TP reduction (measured worst ~1e-6, see the report)
RECIPE_NAMES = [None, *RECIPES]  # None: FP8 off


def _steps(recipe_name: str | None) -> int:
    return 2 if recipe_name == "delayed" else 1  # delayed: the second step uses the history


def _run(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, recipe_name: str | None,
         steps: int, tp_layer: bool) -> list[dict[str, torch.Tensor | None]]:
    """``steps`` forward/backward steps; per step: out, dx, dw, db."""
    results = []
    for _ in range(steps):
        layer.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_(True)
        with mf.fp8_autocast(enabled=recipe_name is not None,
                             fp8_recipe=RECIPES[recipe_name] if recipe_name else None):
            out = layer(xi)
        y = out[0] if tp_layer else out
        y.backward(dy)
        results.append({"out": y.detach(), "dx": xi.grad, "dw": layer.weight.grad,
                        "db": layer.bias.grad if layer.bias is not None else None})
    return results


@functools.cache
def _blas_width_exact(m: int, contraction: int, width: int, tp: int) -> bool:
    """Whether ``a @ b`` and ``a @ b.T`` (FP32, this CPU's BLAS) give each output column the same
    bits when only a 1/tp slice of the columns is computed: the row dgrad's bitwise premise (the
    TP=1 reference computes every column, a rank only its shard)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, contraction, generator=g), torch.randn(contraction, width, generator=g)
    bt = b.t().contiguous()
    return all(torch.equal((a @ b).chunk(tp, 1)[r], a @ b.chunk(tp, 1)[r].clone())
               and torch.equal((a @ bt.t()).chunk(tp, 1)[r], a @ bt.chunk(tp, 0)[r].clone().t()) for r in range(tp))


class Case:
    def __init__(self, kind: str, sp: bool, bias: bool, recipe: str | None, rank: int, tp: int) -> None:
        self.kind, self.sp, self.bias, self.recipe, self.rank, self.tp = kind, sp, bias, recipe, rank, tp
        self.name = f"{kind} sp={sp} bias={bias} recipe={recipe}"
        self.s, self.b, self.k = 64 * tp, 2, 128 * tp
        self.n = 2 * self.k
        g = torch.Generator().manual_seed(zlib.crc32(self.name.encode()))  # same on every rank
        self.w = torch.randn(self.n, self.k, generator=g) * 0.05
        self.bvec = torch.randn(self.n, generator=g) if bias else None
        self.x = torch.randn(self.s, self.b, self.k, generator=g)
        self.dy = torch.randn(self.s, self.b, self.n, generator=g)

    def reference(self) -> list[dict[str, torch.Tensor | None]]:
        ref = mf.Linear(self.k, self.n, bias=self.bias)
        with torch.no_grad():
            ref.weight.copy_(self.w)
            if self.bias:
                ref.bias.copy_(self.bvec)
        return _run(ref, self.x, self.dy, self.recipe, _steps(self.recipe), tp_layer=False)

    def shard(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(self.tp, dim=dim)[self.rank].clone()

    def build(self, soi: bool) -> torch.nn.Module:
        cfg = Config(tensor_model_parallel_size=self.tp, sequence_parallel=self.sp)
        if self.kind == "column":
            layer: Any = ColumnParallelLinear(self.k, self.n, config=cfg, init_method=torch.nn.init.zeros_,
                                              bias=self.bias, gather_output=False, name="fc1",
                                              save_original_input=soi)
            w, bvec = self.shard(self.w, 0), (self.shard(self.bvec, 0) if self.bias else None)
        else:
            layer = RowParallelLinear(self.k, self.n, config=cfg, init_method=torch.nn.init.zeros_,
                                      bias=self.bias, input_is_parallel=True, skip_bias_add=False,
                                      name="fc2", save_original_input=soi)
            w, bvec = self.shard(self.w, 1), self.bvec
        with torch.no_grad():
            layer.weight.copy_(w)
            if self.bias:
                layer.bias.copy_(bvec)
        return layer

    def local_input(self) -> torch.Tensor:
        if self.kind == "column":
            return self.shard(self.x, 0) if self.sp else self.x.clone()
        return self.shard(self.x, 2)  # row: input_is_parallel, full sequence (SP splits the output)

    def local_grad(self) -> torch.Tensor:
        if self.kind == "column":
            return self.shard(self.dy, 2)
        return self.shard(self.dy, 0) if self.sp else self.dy.clone()

    def check(self, ck: Checker) -> None:
        refs = self.reference()
        runs = {}
        for soi in (False, True):
            layer = self.build(soi)
            runs[soi] = _run(layer, self.local_input(), self.local_grad(), self.recipe,
                             _steps(self.recipe), tp_layer=True)
        for step, ref in enumerate(refs):
            tag = f"{self.name} step={step}"
            got = runs[False][step]
            for key in ("out", "dx", "dw", "db"):
                ck.bitwise("flag", f"{tag} {key} flag on vs off", runs[True][step][key], got[key])
            self._compare(ck, tag, got, ref)

    def _compare(self, ck: Checker, tag: str, got: dict[str, Any], ref: dict[str, Any]) -> None:
        cat = self.kind
        if self.kind == "column":
            ck.bitwise(cat, f"{tag} out (fprop shard)", got["out"], self.shard(ref["out"], 2))
            want_dx = self.shard(ref["dx"], 0) if self.sp else ref["dx"]
            ck.close(f"{cat}_dgrad_reduced", f"{tag} dx", got["dx"], want_dx, RTOL)
            ck.bitwise(cat, f"{tag} dw (wgrad shard)", got["dw"], self.shard(ref["dw"], 0))
            if self.bias:
                ck.bitwise(cat, f"{tag} db shard", got["db"], self.shard(ref["db"], 0))
            return
        want_out = self.shard(ref["out"], 0) if self.sp else ref["out"]
        ck.close(f"{cat}_fprop_reduced", f"{tag} out", got["out"], want_out, RTOL)
        want_dx = self.shard(ref["dx"], 2)
        if _blas_width_exact(self.s * self.b, self.n, self.k, self.tp):
            ck.bitwise(cat, f"{tag} dx (dgrad shard)", got["dx"], want_dx)
        else:  # the BLAS's bits depend on the output width here: see the module docstring
            ck.close(cat, f"{tag} dx (dgrad shard, BLAS not width-exact)", got["dx"], want_dx, RTOL)
        ck.bitwise(cat, f"{tag} dw (wgrad shard)", got["dw"], self.shard(ref["dw"], 1))
        if self.bias and not self.sp:
            ck.bitwise(cat, f"{tag} db", got["db"], ref["db"])
        elif self.bias:  # SP: local tokens' part; Megatron all-reduces params marked sequence_parallel
            db = got["db"].clone()
            dist.all_reduce(db)
            ck.close(f"{cat}_bias_sp_reduced", f"{tag} db (all-reduced)", db, ref["db"], RTOL)


def check_saved_bytes(ck: Checker, rank: int, tp: int) -> None:
    """Column-parallel with SP: what is saved of the input is the local shard, never the gathered
    tensor, with the flag on (the original shard) and off (its local columnwise FP8 copy)."""
    for recipe in RECIPE_NAMES:
        for soi in (False, True):
            case = Case("column", True, False, recipe, rank, tp)
            layer = case.build(soi)
            x_local = case.local_input().requires_grad_(True)
            with track_saved_tensors(layer) as saved, mf.fp8_autocast(
                    enabled=recipe is not None, fp8_recipe=RECIPES[recipe] if recipe else None):
                y, _ = layer(x_local)
            acts = sorted((r.nbytes for r in saved.records if not r.is_parameter), reverse=True)
            m_local, k = x_local.shape[0] * x_local.shape[1], x_local.shape[2]
            gathered = m_local * tp * k * (1 if (recipe and not soi) else x_local.element_size())
            name = f"saved bytes recipe={recipe} flag={soi}"
            if soi or recipe is None:  # the original local shard itself
                want = x_local.untyped_storage().nbytes()
                ck.true("saved", acts[0] == want, f"{name}: largest activation {acts[0]} B, local shard {want} B")
            else:  # the local columnwise FP8 copy: M_local * K bytes
                ck.true("saved", acts[0] == m_local * k, f"{name}: {acts[0]} B saved, want {m_local * k} B")
            scales = sum(acts[1:])
            ck.true("saved", scales <= m_local * k // 8,
                    f"{name}: {scales} B of other activations (scales only expected)")
            ck.true("saved", max(acts) < gathered, f"{name}: a gathered-size tensor was saved")
            y.sum().backward()


def _raises(ck: Checker, name: str, exc: type[BaseException], match: str, fn: Any) -> None:
    try:
        fn()
    except exc as e:
        ck.true("errors", match in str(e), f"{name}: message {str(e)!r} lacks {match!r}")
        return
    except Exception as e:  # noqa: BLE001
        ck.fail("errors", f"{name}: raised {type(e).__name__}: {e}, expected {exc.__name__}")
        return
    ck.fail("errors", f"{name}: did not raise {exc.__name__}")


def check_errors(ck: Checker, rank: int, tp: int) -> None:
    cfg = Config(tensor_model_parallel_size=tp)
    sp = Config(tensor_model_parallel_size=tp, sequence_parallel=True)
    _raises(ck, "column output not divisible", ValueError, "not divisible by the tensor-parallel size",
            lambda: ColumnParallelLinear(64, 64 * tp + 1, config=cfg, name="qkv"))
    _raises(ck, "row input not divisible", ValueError, "input_size=",
            lambda: RowParallelLinear(64 * tp + 1, 64, config=cfg, input_is_parallel=True))
    _raises(ck, "gather_output with stride", ValueError, "strided",
            lambda: ColumnParallelLinear(64, 64 * tp, config=cfg, gather_output=True, stride=2))
    _raises(ck, "gather_output on an expert", ValueError, "expert",
            lambda: ColumnParallelLinear(64, 64 * tp, config=cfg, gather_output=True, is_expert=True))
    _raises(ck, "row SP without input_is_parallel", ValueError, "input_is_parallel=True",
            lambda: RowParallelLinear(64 * tp, 64, config=sp, input_is_parallel=False))
    _raises(ck, "config TP size mismatch", ValueError, "tensor_model_parallel_size",
            lambda: ColumnParallelLinear(64, 64 * tp, config=Config(tensor_model_parallel_size=tp * 2)))
    row = RowParallelLinear(64 * tp, 64, config=sp, input_is_parallel=True, name="proj")
    _raises(ck, "row SP sequence not divisible", ValueError, "must be divisible by the tensor-parallel",
            lambda: row(torch.randn(tp + 1, 2, 64)))
    col = ColumnParallelLinear(64, 64 * tp, config=cfg, name="fc1")
    _raises(ck, "column wrong input features", ValueError, "ColumnParallelLinear(fc1)",
            lambda: col(torch.randn(4, 2, 32)))
    _raises(ck, "row input not the local slice", ValueError, "input_is_parallel=True",
            lambda: row(torch.randn(tp, 2, 64 * tp)))
    # emulation warning: exactly once for many layers and steps of a recipe CPU cannot run natively
    checks._warned.clear()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for _ in range(3):
            layer = ColumnParallelLinear(128, 128 * tp, config=cfg)
            with mf.fp8_autocast(fp8_recipe=RECIPES["block"]):
                layer(torch.randn(128, 128))[0].sum().backward()
    emulated = [w for w in got if "emulated" in str(w.message)]
    ck.true("errors", len(emulated) == 1, f"emulation warning shown {len(emulated)} times, want 1")


def check_extras(ck: Checker, rank: int, tp: int) -> None:
    """gather_output, input_is_parallel=False, skip_bias_add and Megatron's param attributes."""
    cfg = Config(tensor_model_parallel_size=tp)
    case = Case("column", False, True, "current", rank, tp)
    ref = case.reference()[0]
    col = ColumnParallelLinear(case.k, case.n, config=cfg, bias=True, gather_output=True)
    with torch.no_grad():
        col.weight.copy_(case.shard(case.w, 0))
        col.bias.copy_(case.shard(case.bvec, 0))
    x = case.x.clone().requires_grad_(True)
    with mf.fp8_autocast(fp8_recipe=RECIPES["current"]):
        y, b = col(x)
    y.backward(case.dy)
    ck.bitwise("extras", "gather_output out", y.detach(), ref["out"])
    ck.close("extras_reduced", "gather_output dx", x.grad, ref["dx"], RTOL)
    ck.true("extras", b is None, "gather_output: bias returned although skip_bias_add=False")

    rcase = Case("row", False, True, None, rank, tp)
    rref = rcase.reference()[0]
    row = RowParallelLinear(rcase.k, rcase.n, config=cfg, bias=True, input_is_parallel=False,
                            skip_bias_add=True)
    with torch.no_grad():
        row.weight.copy_(rcase.shard(rcase.w, 1))
        row.bias.copy_(rcase.bvec)
    x = rcase.x.clone().requires_grad_(True)
    y, b = row(x)
    ck.true("extras", b is row.bias, "skip_bias_add: the bias parameter is not returned")
    (y + b).backward(rcase.dy)
    ck.close("extras_reduced", "input_is_parallel=False out", (y + b).detach(), rref["out"], RTOL)
    if _blas_width_exact(rcase.s * rcase.b, rcase.n, rcase.k, tp):  # the gathered row dgrad shards
        ck.bitwise("extras", "input_is_parallel=False dx (gathered)", x.grad, rref["dx"])
    else:
        ck.close("extras", "input_is_parallel=False dx (gathered, BLAS not width-exact)", x.grad, rref["dx"], RTOL)
    w = col.weight
    ck.true("extras", (w.tensor_model_parallel, w.partition_dim, w.partition_stride) == (True, 0, 1),
            "column weight TP attributes")
    ck.true("extras", (row.weight.partition_dim, row.bias.sequence_parallel) == (1, False),
            "row weight/bias attributes")


def main() -> int:
    rank, tp = init_gloo()
    ck = Checker(rank)
    for kind in ("column", "row"):
        for sp in (False, True):
            for bias in (False, True):
                for recipe in RECIPE_NAMES:
                    case = Case(kind, sp, bias, recipe, rank, tp)
                    ck.guard(kind, case.name, case.check, ck)
    ck.guard("saved", "saved bytes", check_saved_bytes, ck, rank, tp)
    ck.guard("errors", "errors", check_errors, ck, rank, tp)
    ck.guard("extras", "extras", check_extras, ck, rank, tp)
    code = ck.report()
    shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
