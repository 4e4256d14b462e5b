"""Train a tensor-parallel FP8 transformer layer under torchrun, flags from a YAML config.

A pre-norm layer built from megatron_fp8's Column/RowParallelLinear: attention (qkv -> core
attention that keeps its output, like flash attention -> proj) and an MLP of shared experts
gated by a router that reads the same pre-MLP norm output (Megatron's shared-expert layout).
The config turns ``save_original_input`` on exactly where the input is kept alive anyway.

The run trains the same initial model twice: with the config's flags (and, by default, the
pre-MLP norm output discarded after its consumers ran and recomputed in backward — which frees
memory only because the flagged fc1 saved that very tensor), and with every flag off and no
recompute. It prints per-step losses (identical to the bit) and the saved-activation bytes each
rank still holds at the end of forward: the difference is the columnwise FP8 copies the flagged
layers no longer keep plus the discarded norm output.

    torchrun --nproc_per_node 2 examples/train_tp.py --config configs/tp_block.yaml
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_fp8 import memory
from megatron_fp8.config import FP8Config, apply_layer_flags, load_config
from megatron_fp8.parallel import ColumnParallelLinear, ParallelConfig, RowParallelLinear
from megatron_fp8.recompute import CheckpointWithoutOutput
from megatron_fp8.testing import flash_like_attention


class Attention(nn.Module):
    def __init__(self, cfg: ParallelConfig, hidden: int, heads: int) -> None:
        super().__init__()
        tp = cfg.tensor_model_parallel_size
        self.heads, self.head_dim = heads // tp, hidden // heads
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, config=cfg, bias=False, name="qkv")
        self.proj = RowParallelLinear(hidden, hidden, config=cfg, bias=False, input_is_parallel=True,
                                      name="proj")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv(h)  # [s, b, 3 * hidden / tp] (gathered along s under SP)
        s, b = qkv.shape[:2]
        q, k, v = qkv.view(s, b, self.heads, 3, self.head_dim).unbind(3)
        out = flash_like_attention(q, k, v, causal=True)  # [s, b, heads/tp, d], saved by attention
        y, _ = self.proj(out.view(s, b, -1))  # proj's input aliases that saved output
        return y


class SharedExperts(nn.Module):
    def __init__(self, cfg: ParallelConfig, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, 2 * ffn, config=cfg, bias=False, name="fc1")
        self.fc2 = RowParallelLinear(ffn, hidden, config=cfg, bias=False, input_is_parallel=True, name="fc2")

    def after_fc1(self, h1: torch.Tensor) -> torch.Tensor:
        gate, up = h1.chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)[0]


class Layer(nn.Module):
    """Pre-norm attention + shared-expert MLP. ``recompute_norm``: free the pre-MLP norm output
    once the router and fc1 consumed it, recompute it in backward (needs fc1's flag)."""

    def __init__(self, cfg: ParallelConfig, hidden: int, heads: int, ffn: int, recompute_norm: bool) -> None:
        super().__init__()
        dtype = cfg.params_dtype
        self.input_norm = nn.LayerNorm(hidden, dtype=dtype)
        self.attention = Attention(cfg, hidden, heads)
        self.pre_mlp_norm = nn.LayerNorm(hidden, dtype=dtype)
        self.router = nn.Linear(hidden, 4, bias=False, dtype=dtype)  # reads (and saves) the norm output
        self.shared_experts = SharedExperts(cfg, hidden, ffn)
        self.recompute_norm = recompute_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.input_norm(x))
        ckpt = CheckpointWithoutOutput("pre_mlp_norm") if self.recompute_norm else None
        h = ckpt.checkpoint(self.pre_mlp_norm, x) if ckpt else self.pre_mlp_norm(x)
        logits, h1 = self.router(h), self.shared_experts.fc1(h)[0]
        if ckpt:  # both consumers saved h itself (the router always, fc1 by its flag): free it
            ckpt.discard_output_and_register_recompute([logits, h1])
        gate = torch.sigmoid(logits.mean(-1, keepdim=True))
        return x + self.shared_experts.after_fc1(h1) * gate


class Model(nn.Module):
    def __init__(self, cfg: ParallelConfig, hidden: int, heads: int, ffn: int, recompute_norm: bool) -> None:
        super().__init__()
        self.layer = Layer(cfg, hidden, heads, ffn, recompute_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def _replicated_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if not getattr(p, "tensor_model_parallel", False)]


def train(args: argparse.Namespace, fp8: FP8Config, flags_on: bool) -> tuple[list[float], int, dict[str, bool]]:
    """Train ``args.steps`` steps; return losses, the saved activation bytes still held at the end
    of step 0's forward, and the applied flags. Recompute only with the flags (it needs them)."""
    world = dist.get_world_size()
    cfg = ParallelConfig(tensor_model_parallel_size=world, sequence_parallel=args.sequence_parallel,
                         params_dtype=torch.bfloat16, use_cpu_initialization=True)
    torch.manual_seed(0)
    model = Model(cfg, args.hidden, args.heads, args.ffn, recompute_norm=flags_on and args.recompute_norm)
    applied = apply_layer_flags(model, fp8) if flags_on else {}
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)
    losses, saved_bytes = [], 0
    for step in range(args.steps):
        x = torch.randn(args.seq, args.batch, args.hidden, generator=gen).to(torch.bfloat16)
        target = torch.randn(args.seq, args.batch, args.hidden, generator=gen).to(torch.bfloat16)
        if args.sequence_parallel:  # each rank holds its sequence shard
            x, target = (t.chunk(world)[dist.get_rank()] for t in (x, target))
        with memory.track_saved_tensors(model) as saved, fp8.autocast():
            y = model(x)
        if step == 0:
            saved_bytes = saved.live_bytes()  # storages freed by recompute count 0
        loss = F.mse_loss(y.float(), target.float())
        loss.backward()
        if args.sequence_parallel:  # norms/router saw only local tokens: sum their grads over TP
            for p in _replicated_params(model):
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        if args.sequence_parallel:
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
    return losses, saved_bytes, applied


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace, tp: int, fp8: FP8Config) -> None:
    """The sizes must split over the ranks (and fit the recipe's blocks): say so before any layer
    is built, in the arguments' names."""
    for name in ("hidden", "heads", "ffn"):
        if getattr(args, name) % tp:
            ap.error(f"--{name} {getattr(args, name)} must be divisible by the {tp} ranks (tensor-parallel size)")
    if args.hidden % args.heads:
        ap.error(f"--hidden {args.hidden} must be divisible by --heads {args.heads}")
    if args.sequence_parallel and args.seq % tp:
        ap.error(f"--seq {args.seq} must be divisible by the {tp} ranks with --sequence-parallel "
                 f"(or pass --no-sequence-parallel)")
    block = {"Float8BlockScaling": 128, "MXFP8BlockScaling": 32}.get(type(fp8.recipe()).__name__)
    if block and fp8.fp8.enabled:
        tokens = args.seq * args.batch // (tp if args.sequence_parallel else 1)
        if tokens % block or (args.hidden // tp) % block or (args.ffn // tp) % block:
            ap.error(f"{type(fp8.recipe()).__name__} needs the tokens per rank ({tokens}) and the hidden and ffn sizes "
                     f"per rank ({args.hidden // tp}, {args.ffn // tp}) to be multiples of {block}; change --seq, "
                     f"--batch, --hidden or --ffn, or use a config with the current (tensorwise) recipe")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "tp_block.yaml"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--recompute-norm", action=argparse.BooleanOptionalAction, default=True,
                    help="with the flags: discard and recompute the pre-MLP norm output")
    args = ap.parse_args()
    if "RANK" not in os.environ:  # plain `python examples/train_tp.py`: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    fp8 = load_config(args.config)
    if dist.get_world_size() == 1:
        args.sequence_parallel = False
    check_args(ap, args, dist.get_world_size(), fp8)
    on_losses, on_bytes, applied = train(args, fp8, flags_on=True)
    off_losses, off_bytes, _ = train(args, fp8, flags_on=False)
    rank = dist.get_rank()
    # a tensor all-gather (all_gather_object would need NumPy, which this example does not)
    mine = torch.tensor([on_bytes, off_bytes], dtype=torch.int64,
                        device="cuda" if dist.get_backend() == "nccl" else "cpu")
    gathered = torch.empty(dist.get_world_size() * 2, dtype=torch.int64, device=mine.device)
    dist.all_gather_into_tensor(gathered, mine)
    per_rank = gathered.view(-1, 2).tolist()
    if rank == 0:
        print(f"recipe {fp8.recipe().describe()}, TP={dist.get_world_size()}, sequence parallel "
              f"{args.sequence_parallel}\nsave_original_input on: {sorted(n for n, f in applied.items() if f)}; "
              f"pre-MLP norm recomputed: {args.recompute_norm}\n")
        print(f"{'step':>4s} {'loss, flags from config':>24s} {'loss, all flags off':>20s}  bitwise equal")
        for i, (a, b) in enumerate(zip(on_losses, off_losses)):
            print(f"{i:4d} {a:24.6f} {b:20.6f}  {a == b}")
        print("\nsaved activation bytes held at the end of forward (step 0):")
        print(f"{'rank':>4s} {'flags on':>12s} {'all off':>12s} {'difference':>12s}")
        for r, (a, b) in enumerate(per_rank):
            print(f"{r:4d} {a:12d} {b:12d} {b - a:12d}")
    gc.collect()  # free any autograd graph still holding a collective's work object before teardown
    dist.barrier()  # no rank tears down gloo while a peer still talks to it
    dist.destroy_process_group()
    if on_losses != off_losses:
        raise SystemExit("save_original_input changed the losses")


if __name__ == "__main__":
    main()
