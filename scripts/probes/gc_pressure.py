"""Probe (CPU): how many of Python's garbage collections, per generation, a megatron-core GPTModel's
training iterations set off, and how many objects they promote to the oldest generation (what
makes CPython run a full collection, which costs ~0.1-0.3 s in a process with Megatron loaded).

Megatron's local spec (``baseline_spec``) against ours, FP8 off and on (lean path forced), each
iteration ``--micro`` forward+backward passes and an SGD step, after a warm-up. One process, gloo.

    python scripts/probes/gc_pressure.py --layers 4 --iters 30
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.distributed as dist


class _Iteration:
    """One training iteration: ``micro`` forward+backward passes, then an SGD step."""

    def __init__(self, model: torch.nn.Module, seq: int, micro: int) -> None:
        self.model, self.micro = model, micro
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        self.tokens = torch.randint(0, 512, (1, seq))
        self.pos = torch.arange(seq).unsqueeze(0)
        self.mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).tril().logical_not()

    def __call__(self) -> None:
        for _ in range(self.micro):
            self.model(self.tokens, self.pos, self.mask, labels=self.tokens).float().mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("MEGATRON_FP8_LEAN", "1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from megatron_fp8.audit import cpu_accommodations
    from megatron_fp8.megatron import plugin

    parallel_state.initialize_model_parallel(1)
    cpu_accommodations()
    stats = {"collections": [0, 0, 0], "ms": [0.0, 0.0, 0.0]}
    start = [0.0]

    def cb(phase: str, info: dict) -> None:
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            g = info["generation"]
            stats["collections"][g] += 1
            stats["ms"][g] += (time.perf_counter() - start[0]) * 1e3

    rows = []
    variants = (("megatron local, FP32", plugin.baseline_spec, None), ("ours, FP8 off", plugin.layer_spec, None),
                ("ours, tensorwise", plugin.layer_spec, ("tensorwise", "hybrid")))
    for name, spec, fp8 in variants:
        kw = dict(num_layers=args.layers, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512,
                  use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                  add_bias_linear=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                  gradient_accumulation_fusion=False, persist_layer_norm=False, normalization="RMSNorm")
        if fp8:
            kw.update(fp8=fp8[1], fp8_recipe=fp8[0])
        cfg = TransformerConfig(**kw)
        plugin.install()
        torch.manual_seed(0)
        model = GPTModel(config=cfg, transformer_layer_spec=spec(cfg), vocab_size=512, max_sequence_length=args.seq,
                         position_embedding_type="rope")
        step = _Iteration(model, args.seq, args.micro)
        for _ in range(3):
            step()
        gc.collect()
        stats["collections"], stats["ms"] = [0, 0, 0], [0.0, 0.0, 0.0]
        gc.callbacks.append(cb)
        t0 = time.perf_counter()
        for _ in range(args.iters):
            step()
        secs = time.perf_counter() - t0
        gc.callbacks.remove(cb)
        per_iter = [f"{n / args.iters:.2f}" for n in stats["collections"]]
        rows.append((name, *per_iter, f"{stats['ms'][2]:.0f}", f"{secs / args.iters * 1e3:.0f}"))
        del model, step
    head = ("model", "gen 0 / iter", "gen 1 / iter", "gen 2 / iter", "gen 2 ms total", "ms / iter")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(f"({args.layers} layers, seq {args.seq}, {args.micro} micro-batches, {args.iters} iterations; objects "
          f"tracked at the end: {len(gc.get_objects())}; Python {sys.version.split()[0]})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
