"""torchrun worker (2 ranks, gloo, CPU): the parameter attributes of our parallel linears equal
megatron-core's for the same config, on the installed megatron-core, across a grid of TP / ETP /
EP / SP / is_expert; and an MoE layer at TP=2, ETP=1 trained two steps through megatron-core's
DDP gets the expert gradients of megatron-core's own local-spec layer (FP8 off, bitwise).

Categories of the JSON report:

* ``attrs``: for every grid point and layer kind (column, row, and our grouped expert linears
  against megatron-core's expert Column/RowParallelLinear, expert by expert), every public
  attribute of every parameter (``tensor_model_parallel``, ``partition_dim``,
  ``partition_stride``, ``allreduce``, ``sequence_parallel``, ...), names and values.
* ``ddp``: two training steps of an MoE ``TransformerLayer`` (4 experts, top-2, grouped GEMM vs
  megatron-core's SequentialMLP) wrapped in megatron-core's ``DistributedDataParallel``: the
  experts' gradients after the reduction (``main_grad``) bitwise equal, every step; and ours
  with ``gradient_accumulation_fusion`` (our wgrads added into ``main_grad`` by the layers, the
  reduction overlapped with backward): every parameter's ``main_grad`` bitwise the unfused one's.
"""

from __future__ import annotations

import re
import sys
import warnings
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from common import Checker
from spec_worker import run_checks

warnings.filterwarnings("ignore")
from megatron.core import parallel_state  # noqa: E402
from megatron.core import tensor_parallel as mtp  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from megatron_fp8.parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron_fp8.parallel.grouped import ColumnParallelGroupedLinear, RowParallelGroupedLinear  # noqa: E402

K, N, GEMMS = 128, 256, 2
# (TP, ETP, EP) on 2 ranks
GRID = ((1, 1, 1), (2, 2, 1), (2, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 2))


def _attrs(p: torch.nn.Parameter) -> dict[str, Any]:
    return {k: v for k, v in vars(p).items() if not k.startswith("_")}


def _config(tp: int, etp: int, ep: int, sp: bool) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=K, num_attention_heads=4, tensor_model_parallel_size=tp,
                             expert_tensor_parallel_size=etp, expert_model_parallel_size=ep, sequence_parallel=sp,
                             use_cpu_initialization=True, params_dtype=torch.float32, num_moe_experts=4,
                             add_bias_linear=False)  # the layers get bias=True (the config refuses MoE biases at ETP>1)


def compare_grid(ck: Checker) -> None:
    for tp, etp, ep in GRID:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp,
                                                 expert_model_parallel_size=ep)
        for sp in (False, True) if tp > 1 else (False,):
            cfg = _config(tp, etp, ep, sp)
            for is_expert in (False, True):
                where = f"TP={tp} ETP={etp} EP={ep} SP={sp} expert={is_expert}"
                kw: dict[str, Any] = dict(config=cfg, init_method=torch.nn.init.xavier_normal_, bias=True,
                                          is_expert=is_expert)
                col_kw = dict(kw, gather_output=False, skip_bias_add=is_expert)
                row_kw = dict(kw, input_is_parallel=True, skip_bias_add=is_expert)
                pairs = [("column", mtp.ColumnParallelLinear(K, N, **col_kw), ColumnParallelLinear(K, N, **col_kw)),
                         ("row", mtp.RowParallelLinear(N, K, **row_kw), RowParallelLinear(N, K, **row_kw))]
                for kind, theirs, ours in pairs:
                    a = {n: _attrs(p) for n, p in theirs.named_parameters()}
                    b = {n: _attrs(p) for n, p in ours.named_parameters()}
                    ck.true("attrs", a == b, f"{where} {kind}: megatron-core {a} vs ours {b}")
                if not is_expert:
                    continue
                grouped = (("column", ColumnParallelGroupedLinear(GEMMS, K, N, **dict(kw, skip_bias_add=True)), 0),
                           ("row", RowParallelGroupedLinear(GEMMS, N, K, **dict(kw, skip_bias_add=True)), 1))
                for kind, layer, i in grouped:
                    want = {n: _attrs(p) for n, p in pairs[i][1].named_parameters()}
                    for n, p in layer.named_parameters():
                        base = re.sub(r"\d+$", "", n)
                        ck.true("attrs", _attrs(p) == want[base],
                                f"{where} grouped {kind} {n}: ours {_attrs(p)} vs megatron-core {want[base]}")


def _moe_config(**extra: Any) -> TransformerConfig:
    kw: dict[str, Any] = dict(num_layers=1, hidden_size=K, num_attention_heads=4, ffn_hidden_size=256,
                             tensor_model_parallel_size=2, expert_tensor_parallel_size=1,
                             expert_model_parallel_size=1, use_cpu_initialization=True, params_dtype=torch.float32,
                             hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
                             bias_dropout_fusion=False, masked_softmax_fusion=False,
                             gradient_accumulation_fusion=False, persist_layer_norm=False, num_moe_experts=4,
                             moe_router_topk=2, moe_ffn_hidden_size=128, moe_token_dispatcher_type="allgather",
                             moe_router_load_balancing_type="none")
    kw.update(extra)
    return TransformerConfig(**kw)


def _expert_name(name: str) -> str:
    """Our grouped ``mlp.experts.linear_fc1.weight2`` -> megatron-core's sequential
    ``mlp.experts.local_experts.2.linear_fc1.weight``."""
    m = re.fullmatch(r"mlp\.experts\.(linear_fc\d)\.weight(\d+)", name)
    return f"mlp.experts.local_experts.{m.group(2)}.{m.group(1)}.weight" if m else name


def compare_ddp(ck: Checker) -> None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from megatron_fp8.megatron import get_gpt_layer_spec

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)
    cfg = _moe_config()
    fused_cfg = _moe_config(gradient_accumulation_fusion=True)  # Megatron-LM's default; ours need no apex
    layers, configs = {}, {"megatron": cfg, "ours": cfg, "ours-fused": fused_cfg}
    ours_spec = get_gpt_layer_spec(num_experts=4, moe_grouped_gemm=True)
    for kind, spec in (("megatron", get_gpt_layer_local_spec(num_experts=4)), ("ours", ours_spec),
                       ("ours-fused", ours_spec)):
        torch.manual_seed(0)
        layers[kind] = build_module(spec, config=configs[kind], layer_number=1).eval()  # eval: MoE + TP without SP
    ref = dict(layers["megatron"].named_parameters())
    with torch.no_grad():
        for kind in ("ours", "ours-fused"):
            for n, p in layers[kind].named_parameters():
                p.copy_(ref[_expert_name(n)])
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=False)
    # the fused wgrads under the hooks' overlapped reduction (which asserts that every parameter got a .grad)
    overlapped = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                               use_distributed_optimizer=False)
    wrapped = {k: DistributedDataParallel(configs[k], overlapped if k == "ours-fused" else ddp_cfg, m)
               for k, m in layers.items()}
    g = torch.Generator().manual_seed(7 + dist.get_rank())  # different tokens per rank: the experts' DP matters
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril().logical_not()
    for step in range(2):
        x = torch.randn(16, 2, K, generator=g)
        grads = {}
        for kind, model in wrapped.items():
            model.zero_grad_buffer()
            y, _ = model(x.clone().requires_grad_(), attention_mask=mask)
            y.float().pow(2).mean().backward()
            model.finish_grad_sync()
            grads[kind] = {n: p.main_grad.clone() for n, p in model.module.named_parameters()}
        experts = [n for n in grads["ours"] if ".experts." in n]
        ck.true("ddp", len(experts) == 2 * 4, f"our experts' parameters: {experts}")
        for n in experts:
            ck.bitwise("ddp", f"step {step} {n}", grads["ours"][n], grads["megatron"][_expert_name(n)])
        fused = [m for m in layers["ours-fused"].modules() if getattr(m, "gradient_accumulation_fusion", False)]
        ck.true("ddp", len(fused) >= 4, f"{len(fused)} of our linears fuse under gradient_accumulation_fusion")
        for n, want in grads["ours"].items():  # FP32 parameters: the fused wgrads are the unfused ones' bits
            ck.bitwise("ddp", f"step {step} fused {n}", grads["ours-fused"][n], want)


def _stream_shim() -> None:
    """Test-only: megatron-core 0.20's grad sync asks for the current CUDA stream (to wait on CUDA
    graph events) even on CPU; give it one that has nothing to wait for."""
    if not torch.cuda.is_available():
        stream = SimpleNamespace(wait_event=lambda event: None, wait_stream=lambda other: None)
        torch.cuda.current_stream = lambda *a, **k: stream  # type: ignore[assignment]


def main() -> int:
    return run_checks([("attrs", "parameter attributes vs megatron-core", compare_grid, ()),
                       ("ddp", "MoE layer through megatron-core's DDP", compare_ddp, ())], tp=1, shims=(_stream_shim,))


if __name__ == "__main__":
    sys.exit(main())
