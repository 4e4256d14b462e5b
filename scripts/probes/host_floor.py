"""Probe: the host-time floor of an eager FP8 ``Linear`` step, on a GPU (run AL in
docs/benchmarks.md). Prints host us per call of the raw ops a current-scaling step issues
(``torch.empty``, ``torch._scaled_mm``, ``torch.mm``) from Python and from C++ (a ``load_inline``
loop), our ``Linear`` steps (weight cast every step; reused; every route stubbed: the glue
alone), each route of a lean plan alone, and BF16 ``nn.Linear``; then the minimal step (only a
reused current step's two casts and three GEMMs) as a Python ``autograd.Function`` and as a C++
``torch::autograd::Function``, with the casts' Python routes and with the casts skipped. Host
time: back-to-back calls, no synchronisation (the GPU idles at T=256, K=N=2048). Found on H100s
(2026-12-06): the Python minimal step ~2x ``nn.Linear``, the C++ one slower than the Python one.

    python scripts/probes/host_floor.py [--calls 2000] [--no-cpp] [--minimal-only]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: benchlib

import torch  # noqa: E402
from benchlib import train_step, wall_us  # noqa: E402

import megatron_fp8 as mf  # noqa: E402
from megatron_fp8.recipe import PRESETS  # noqa: E402

_CPP = r"""
#include <torch/extension.h>
#include <chrono>
using clk = std::chrono::steady_clock;
static double us(clk::time_point a) { return std::chrono::duration<double, std::micro>(clk::now() - a).count(); }
// host us per call of each op, n calls back to back
std::vector<double> floor_ops(at::Tensor a, at::Tensor b, at::Tensor s, at::Tensor xb, at::Tensor wb, int64_t n) {
  std::vector<double> r;
  auto t = clk::now();
  for (int64_t i = 0; i < n; ++i) at::empty({a.size(0), a.size(1)}, a.options());
  r.push_back(us(t) / n);
  t = clk::now();
  for (int64_t i = 0; i < n; ++i) at::_scaled_mm(a, b.t(), s, s, c10::nullopt, c10::nullopt, at::kBFloat16, false);
  r.push_back(us(t) / n);
  t = clk::now();
  for (int64_t i = 0; i < n; ++i) at::mm(xb, wb.t());
  r.push_back(us(t) / n);
  t = clk::now();
  for (int64_t i = 0; i < n; ++i) { auto v = a.view({-1, a.size(1)}); (void)v; }
  r.push_back(us(t) / n);
  return r;
}
"""


def planned_linear(recipe: str, x: torch.Tensor, dy: torch.Tensor) -> tuple[Any, Any, Any]:
    """``(layer, plan, w_fp8)``: a new ``Linear`` after one real step, the lean plan that step
    made (``plan.q``: its quantizers) and the weight's FP8 cast."""
    from megatron_fp8.ops.lean import lean_cast

    layer = mf.Linear(x.shape[-1], dy.shape[-1], bias=False, params_dtype=torch.bfloat16, device=x.device)
    train_step(layer, x, dy, PRESETS[recipe])()
    q = next(iter(layer._quantizers.values()))
    plan = next(p for p in q._plans.values() if p is not None)
    return layer, plan, lean_cast(q.weight, layer.weight.detach())


def _route_costs(recipe: str, x: torch.Tensor, dy: torch.Tensor, calls: int, profiles: list[str]
                 ) -> list[tuple[str, float]]:
    """Host us per call of each route of a lean ``Linear`` step (its plan made by one real step),
    and a cProfile of the x and weight casts."""
    from benchlib import own_time_profile

    from megatron_fp8.ops.lean import lean_cast

    layer, plan, wq = planned_linear(recipe, x, dy)
    q, w = plan.q, layer.weight.detach()
    x2d = x.detach().reshape(-1, x.shape[-1])
    xr, xrs, xc, xcs, _ = plan.cast_x(x2d)
    dyr, dyrs, dyc, dycs, _ = plan.dy_route(dy)
    wr, wc = wq.rowwise, wq.columnwise
    out = [(f"{recipe}: weight cast (both copies)", wall_us(lambda: lean_cast(q.weight, w), calls, 20)),
           (f"{recipe}: x cast", wall_us(lambda: plan.cast_x(x2d), calls, 20)),
           (f"{recipe}: dy cast", wall_us(lambda: plan.dy_route(dy), calls, 20)),
           (f"{recipe}: fprop", wall_us(lambda: plan.fprop(xr, xrs, wr.data, wr.scale_inv), calls, 20)),
           (f"{recipe}: dgrad", wall_us(lambda: plan.dgrad(dyr, dyrs, wc.data, wc.scale_inv), calls, 20)),
           (f"{recipe}: wgrad", wall_us(lambda: plan.wgrad_gemm(dyc, dycs, xc, xcs), calls, 20))]
    profiles.append(f"--- {recipe}: x cast, cProfile ---\n" + own_time_profile(lambda: plan.cast_x(x2d), 300, 14))
    profiles.append(f"--- {recipe}: fprop, cProfile ---\n"
                    + own_time_profile(lambda: plan.fprop(xr, xrs, wr.data, wr.scale_inv), 300, 10))
    torch.cuda.synchronize()
    return out


_CPP_FN = r"""
#include <torch/extension.h>
#include <torch/csrc/autograd/custom_function.h>
namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
static std::vector<py::object>* casts = nullptr;
static std::vector<at::Tensor>* fixed = nullptr;  // set: the casts skipped (these outputs)
struct MinFn : public torch::autograd::Function<MinFn> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, at::Tensor w, at::Tensor wr, at::Tensor wrs,
                            at::Tensor wc, at::Tensor wcs) {
    auto x2d = x.reshape({-1, x.size(-1)});
    at::Tensor xr, xrs, xc, xcs;
    if (fixed) {
      xr = (*fixed)[0]; xrs = (*fixed)[1]; xc = (*fixed)[2]; xcs = (*fixed)[3];
    } else {
      py::tuple got = (*casts)[0](x2d);
      xr = got[0].cast<at::Tensor>(); xrs = got[1].cast<at::Tensor>();
      xc = got[2].cast<at::Tensor>(); xcs = got[3].cast<at::Tensor>();
    }
    auto y = at::_scaled_mm(xr, wr.t(), xrs, wrs, c10::nullopt, c10::nullopt, x.scalar_type(), true);
    ctx->save_for_backward({xc, xcs, wc, wcs});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    auto dy = grads[0].reshape({-1, grads[0].size(-1)}).contiguous();
    at::Tensor dyr, dyrs, dyc, dycs;
    if (fixed) {
      dyr = (*fixed)[4]; dyrs = (*fixed)[5]; dyc = (*fixed)[6]; dycs = (*fixed)[7];
    } else {
      // the engine's device thread keeps a Python thread state (PyGILState): no new one per call,
      // as pybind11's gil_scoped_acquire makes where its own record of the thread is missing
      PyGILState_STATE st = PyGILState_Ensure();
      {
        py::tuple got = (*casts)[1](dy);
        dyr = got[0].cast<at::Tensor>(); dyrs = got[1].cast<at::Tensor>();
        dyc = got[2].cast<at::Tensor>(); dycs = got[3].cast<at::Tensor>();
      }
      PyGILState_Release(st);
    }
    auto dx = at::_scaled_mm(dyr, s[2].t(), dyrs, s[3], c10::nullopt, c10::nullopt, dy.scalar_type(), false);
    auto dw = at::_scaled_mm(dyc, s[0].t(), dycs, s[1], c10::nullopt, c10::nullopt, dy.scalar_type(), false);
    return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
void set_casts(py::object a, py::object b) { casts = new std::vector<py::object>{a, b}; }
void set_fixed(std::vector<at::Tensor> t) { fixed = t.empty() ? nullptr : new std::vector<at::Tensor>(t); }
at::Tensor min_linear(at::Tensor x, at::Tensor w, at::Tensor wr, at::Tensor wrs, at::Tensor wc, at::Tensor wcs) {
  return MinFn::apply(x, w, wr, wrs, wc, wcs);
}
"""


class _MinLinear(torch.autograd.Function):
    """The fewest Python ops a lean current-scaling step can issue: the plan's two cast routes, three
    ``_scaled_mm``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, wq: Any, cast_x: Any, cast_dy: Any) -> torch.Tensor:
        xr, xrs, xc, xcs, _ = cast_x(x.reshape(-1, x.shape[-1]))
        ctx.save_for_backward(xc, xcs, wq.columnwise.data, wq.columnwise.scale_inv)
        ctx.cast_dy = cast_dy
        return torch._scaled_mm(xr, wq.rowwise.data.t(), scale_a=xrs, scale_b=wq.rowwise.scale_inv,
                                out_dtype=x.dtype, use_fast_accum=True)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        xc, xcs, wc, wcs = ctx.saved_tensors
        dyr, dyrs, dyc, dycs, _ = ctx.cast_dy(dy.contiguous())
        dx = torch._scaled_mm(dyr, wc.t(), scale_a=dyrs, scale_b=wcs, out_dtype=dy.dtype)
        dw = torch._scaled_mm(dyc, xc.t(), scale_a=dycs, scale_b=xcs, out_dtype=dy.dtype)
        return dx, dw, None, None, None


def _minimal(x: torch.Tensor, dy: torch.Tensor, calls: int, use_cpp: bool) -> list[tuple[str, float]]:
    """Host us of the minimal current-scaling step: Python ``autograd.Function`` and, with
    ``use_cpp``, a C++ one calling the same cast routes (weight cast once, as when reused)."""
    k = x.shape[-1]
    layer, plan, wq = planned_linear("current", x, dy)
    w = layer.weight
    cast_x, cast_dy = plan.cast_x, plan.dy_route

    def py_step() -> None:
        x.grad = None
        w.grad = None
        _MinLinear.apply(x, w, wq, cast_x, cast_dy).backward(dy)
    out = [("minimal Python autograd.Function step (weight reused)", wall_us(py_step, calls, 30))]
    if use_cpp:
        from torch.utils.cpp_extension import load_inline

        ext = load_inline("mf_host_floor_fn3", _CPP_FN, functions=["set_casts", "set_fixed", "min_linear"])
        ext.set_casts(cast_x, lambda d: cast_dy(d))
        wr, wc = wq.rowwise, wq.columnwise

        def cpp_step() -> None:
            x.grad = None
            w.grad = None
            ext.min_linear(x, w, wr.data, wr.scale_inv, wc.data, wc.scale_inv).backward(dy)
        out.append(("minimal C++ autograd Function, Python casts (weight reused)", wall_us(cpp_step, calls, 30)))
        out.append(("minimal Python step again", wall_us(py_step, calls, 30)))
        fx = cast_x(x.detach().reshape(-1, k))[:4]
        fdy = cast_dy(dy)[:4]
        ext.set_fixed([*fx, *fdy])
        out.append(("minimal C++ autograd Function, casts skipped (no Python)", wall_us(cpp_step, calls, 30)))
        ext.set_fixed([])

        def py_fixed_step() -> None:
            x.grad = None
            w.grad = None
            _MinLinear.apply(x, w, wq, lambda _x: (*fx, None), lambda _d: (*fdy, None)).backward(dy)
        out.append(("minimal Python autograd.Function, casts skipped", wall_us(py_fixed_step, calls, 30)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--no-cpp", action="store_true")
    ap.add_argument("--minimal-only", action="store_true", help="only the minimal Python / C++ steps, twice")
    args = ap.parse_args()
    n = args.calls
    t, k, nn_ = 256, 2048, 2048
    dev = "cuda"
    fp8 = torch.float8_e4m3fn
    a = torch.randn(t, k, device=dev).to(fp8)
    b = torch.randn(nn_, k, device=dev).to(fp8)
    s = torch.ones((), device=dev)
    xb = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
    wb = torch.randn(nn_, k, device=dev, dtype=torch.bfloat16)
    rows: list[tuple[str, float]] = []
    if args.minimal_only:
        x = torch.randn(t, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(t, nn_, device=dev, dtype=torch.bfloat16)
        ref = torch.nn.Linear(k, nn_, bias=False, dtype=torch.bfloat16, device=dev)
        for _ in range(2):
            rows += _minimal(x, dy, n // 4, True)
            rows.append(("nn.Linear bf16", wall_us(train_step(ref, x, dy), n // 4, 30)))
        for name, v in rows:
            print(f"| {name} | {v:.1f} |")
        return
    rows.append(("py torch.empty fp8 [256,2048]", wall_us(lambda: torch.empty((t, k), dtype=fp8, device=dev), n, 50)))
    rows.append(("py torch._scaled_mm tensorwise", wall_us(
        lambda: torch._scaled_mm(a, b.t(), scale_a=s, scale_b=s, out_dtype=torch.bfloat16), n, 50)))
    rows.append(("py torch.mm bf16", wall_us(lambda: torch.mm(xb, wb.t()), n, 50)))
    rows.append(("py tensor.view", wall_us(lambda: a.view(-1, k), n, 50)))
    torch.cuda.synchronize()
    if not args.no_cpp:
        from torch.utils.cpp_extension import load_inline

        t0 = time.perf_counter()
        ext = load_inline("mf_host_floor", _CPP, functions=["floor_ops"], verbose=False,
                          build_directory=os.environ.get("FLOOR_BUILD") or None)
        rows.append(("C++ build (s, not us)", time.perf_counter() - t0))
        ext.floor_ops(a, b, s, xb, wb, 50)
        torch.cuda.synchronize()
        e, sm, mm, v = ext.floor_ops(a, b, s, xb, wb, n)
        torch.cuda.synchronize()
        rows += [("C++ at::empty", e), ("C++ at::_scaled_mm", sm), ("C++ at::mm", mm), ("C++ view", v)]
    x = torch.randn(t, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, nn_, device=dev, dtype=torch.bfloat16)
    ref = torch.nn.Linear(k, nn_, bias=False, dtype=torch.bfloat16, device=dev)
    for recipe in ("current",):
        layer = mf.Linear(k, nn_, bias=False, params_dtype=torch.bfloat16, device=dev)
        rows.append((f"our Linear {recipe} full", wall_us(train_step(layer, x, dy, PRESETS[recipe]), n // 4, 30)))
        layer.is_first_microbatch = True
        rows.append((f"our Linear {recipe} weight reused", wall_us(train_step(layer, x, dy, PRESETS[recipe]), n // 4,
                                                                   30)))
    rows.append(("nn.Linear bf16", wall_us(train_step(ref, x, dy), n // 4, 30)))
    from benchlib import own_time_profile

    for recipe in ("current", "delayed"):
        layer = mf.Linear(k, nn_, bias=False, params_dtype=torch.bfloat16, device=dev)
        full = own_time_profile(train_step(layer, x, dy, PRESETS[recipe]), 300, 30)
        print(f"--- our Linear {recipe} full step, cProfile ---\n{full}")
    torch.cuda.synchronize()
    profiles = []
    rows += _minimal(x, dy, n // 4, not args.no_cpp)
    for recipe in ("current",):
        rows += _route_costs(recipe, x, dy, n // 4, profiles)
    from lean_overhead import stub_routes  # (this folder)

    stub_routes()
    for recipe in ("current",):
        layer = mf.Linear(k, nn_, bias=False, params_dtype=torch.bfloat16, device=dev)
        rows.append((f"our Linear {recipe} routes stubbed", wall_us(train_step(layer, x, dy, PRESETS[recipe]),
                                                                    n // 4, 30)))
        layer.is_first_microbatch = True
        rows.append((f"our Linear {recipe} stubbed, weight reused",
                     wall_us(train_step(layer, x, dy, PRESETS[recipe]), n // 4, 30)))
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| what | host us per call |\n|---|---|")
    for name, v in rows:
        print(f"| {name} | {v:.1f} |")
    for text in profiles:
        print(text)


if __name__ == "__main__":
    main()
