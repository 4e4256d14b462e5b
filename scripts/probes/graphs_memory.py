"""Where the per-layer CUDA graphs' memory goes (``MEGATRON_FP8_GRAPHS=1``, ops/graphed.py).

Run AV measured the graphs at 6.7-8.7 GB more peak memory than eager in Megatron-LM's dense-1b
loop, against ~2 GB of static buffers counted by hand. This probe trains a stack of dense-1b's
linears (qkv, proj, fc1, fc2 per layer; hidden 2048, ffn 8192 with SwiGLU, 4096 tokens, four
micro-batches, Megatron's wgrad fusion into ``main_grad``) eagerly and graphed, each in a fresh
process, and prints per mode: peak allocated in the first step (the captures) and in a later
step, what stays allocated between steps, what the graphs hold by their own count
(``held_by_graphs``) against the sum of their static buffers, and the allocator's reserved
memory per pool (the default pool against the graphs' private pools).

The graphs' private pools reserved 4,928 MiB around 1,480 live (run AW): ``--history`` also lists
the pools' free blocks by the site that last held them.

Modes: ``eager``; ``graphs`` (as shipped: every capture on one side stream); ``graphs-stream-each``
(a new side stream per capture, as before 2026-12-07: 8.6 GB between steps on the H100 against
3.7 GB). The default pool's live blocks are also split by stream: the caller's against the
capture streams'.

    python scripts/probes/graphs_memory.py [--recipes current,blockwise] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MiB = 2**20


def _where(frames: list[dict]) -> str:
    """The allocating call as our code saw it: the innermost frame of ours and the one of ours
    it came from."""
    ours = [f for f in frames if "megatron_fp8" in f.get("filename", "") or "graphs_memory" in f.get("filename", "")]
    said = [f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in ours[:3]]
    return " < ".join(said) if said else "(no frame of ours)"


def _live_by_site(snapshot: dict, main_stream: int) -> dict[str, int]:
    """Bytes of live blocks by pool, stream (the caller's or a capture's) and allocating site
    (blocks allocated before the recording began, the parameters, have no frames), and of the
    graph pools' free blocks (what they reserve beyond their live ones; by the site that last
    allocated them, where the snapshot keeps it)."""
    by: dict[str, int] = {}
    for seg in snapshot["segments"]:
        graph_pool = tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
        where = "graph pool" if graph_pool else "capture stream" if seg.get("stream") != main_stream else "main stream"
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                key = f"{where}: {_where(b.get('frames', []))}"
            elif graph_pool and b["state"] == "inactive":  # a pool's reserve: free between replays
                key = f"graph pool, free: {_where(b.get('frames', []))}"
            else:
                continue
            by[key] = by.get(key, 0) + b["size"]
    return by


def _one(recipe: str, graphs: bool, layers: int, tokens: int, stream_each: bool,
         history: bool = False) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    import megatron_fp8 as mf
    from megatron_fp8.ops import graph_buffers, graphed
    from megatron_fp8.recipe import PRESETS

    os.environ[graphed.ENV] = "1" if graphs else "0"
    if stream_each:
        graphed._side_stream = lambda device: torch.cuda.Stream(device)  # type: ignore[assignment]
    torch.manual_seed(0)
    dev, dt, h, ffn = "cuda", torch.bfloat16, 2048, 8192
    shapes = {"qkv": (h, 2 * h), "proj": (h, h), "fc1": (h, 2 * ffn), "fc2": (ffn, h)}
    stack = []
    for i in range(layers):
        mods = {}
        for name, (k, n) in shapes.items():
            m = mf.Linear(k, n, bias=False, params_dtype=dt, device=dev, fuse_wgrad_accumulation=True,
                          name=f"layer{i}.{name}")
            m.weight.main_grad = torch.zeros(m.weight.shape, dtype=torch.float32, device=dev)
            mods[name] = m
        stack.append(mods)
    recipe_obj = PRESETS[recipe]

    def forward(x: torch.Tensor, first: bool) -> torch.Tensor:
        for mods in stack:
            a = F.rms_norm(x, (h,))
            qkv = mods["qkv"](a, is_first_microbatch=first)
            x = x + mods["proj"](qkv[..., :h].contiguous(), is_first_microbatch=first)
            b = F.rms_norm(x, (h,))
            u, v = mods["fc1"](b, is_first_microbatch=first).chunk(2, dim=-1)
            x = x + mods["fc2"](F.silu(u) * v, is_first_microbatch=first)
        return x

    def step() -> None:
        for micro in range(4):
            x = torch.randn(tokens, 1, h, dtype=dt, device=dev, requires_grad=True)
            with mf.fp8_autocast(fp8_recipe=recipe_obj):
                y = forward(x, micro == 0)
            y.float().pow(2).mean().backward()
        torch.cuda.synchronize()

    base = torch.cuda.memory_allocated()
    got: dict[str, float] = {}
    if history:
        torch.cuda.memory._record_memory_history(max_entries=200000)
    for i in range(3):
        torch.cuda.reset_peak_memory_stats()
        step()
        got[f"peak step {i + 1}"] = (torch.cuda.max_memory_allocated() - base) / MiB
    got["between steps"] = (torch.cuda.memory_allocated() - base) / MiB
    live = list(graph_buffers._live)
    got["graphs: held"] = sum(g.held for g in live) / MiB
    got["graphs: reserved over captures"] = sum(g.reserved for g in live) / MiB

    def nbytes(ts: object) -> int:
        return sum(t.untyped_storage().nbytes() for t in ts if t is not None)  # type: ignore[union-attr]
    statics = {t.untyped_storage().data_ptr(): t for g in live for t in (g.x_s, g.y_s, g.dy_s) if t is not None}
    got["graphs: static x, y, dy"] = nbytes(statics.values()) / MiB  # each storage once: x and dy are shared
    got["graphs: shared static x, dy"] = graph_buffers.shared_by_graphs() / MiB
    got["graphs: static grads"] = sum(nbytes(g.grad_out) for g in live) / MiB
    got["graphs: static FP8 weights"] = sum(nbytes(g.w_s.tensors()) for g in live if g.w_s is not None) / MiB
    got["graph pairs"] = len(live)
    pools: dict[str, list[int]] = {}
    main_stream = torch.cuda.current_stream().cuda_stream
    for seg in torch.cuda.memory_snapshot():
        key = "default pool" if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0) else "graph pools"
        used = sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        if key == "default pool" and seg.get("stream") != main_stream:
            side = "default pool: live on capture streams"
            got[side] = got.get(side, 0) + used / MiB
            largest = max((b["size"] for b in seg["blocks"] if b["state"] == "active_allocated"), default=0)
            got["largest such block"] = max(got.get("largest such block", 0), largest / MiB)
        p = pools.setdefault(key, [0, 0])
        p[0] += used
        p[1] += seg["total_size"]
    for key, (used, total) in pools.items():
        got[f"{key}: allocated"] = used / MiB
        got[f"{key}: reserved"] = total / MiB
    got["reserved total"] = torch.cuda.memory_reserved() / MiB
    if history:
        sites = _live_by_site(torch.cuda.memory._snapshot(), main_stream)
        for key, n in sorted(sites.items(), key=lambda kv: -kv[1])[:24]:
            print(f"SITE {n / MiB:9,.1f} MiB  {key}")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="current,blockwise")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--modes", default="eager,graphs,graphs-stream-each")
    ap.add_argument("--history", action="store_true",
                    help="record allocations; print where the live blocks off the caller's stream came from")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        recipe, mode = args.child.split(":")
        got = _one(recipe, mode != "eager", args.layers, args.tokens, mode == "graphs-stream-each", args.history)
        print("RESULT " + json.dumps(got))
        return
    modes = args.modes.split(",")
    table: dict[str, dict[str, dict[str, float]]] = {}
    for recipe in args.recipes.split(","):
        for mode in modes:
            try:
                run = subprocess.run([sys.executable, __file__, "--child", f"{recipe}:{mode}", "--layers",
                                      str(args.layers), "--tokens", str(args.tokens)]
                                     + (["--history"] if args.history else []),
                                     capture_output=True, text=True, timeout=300)
            except subprocess.TimeoutExpired:
                print(f"{recipe} {mode}: over 300 s, left out")
                continue
            lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
            for ln in run.stdout.splitlines():
                if ln.startswith("SITE "):
                    print(f"{recipe} {mode}: {ln[5:]}")
            if run.returncode or not lines:
                print(f"{recipe} {mode}: rc={run.returncode}\n{run.stderr[-3000:]}")
                continue
            table.setdefault(recipe, {})[mode] = json.loads(lines[-1][7:])
    for recipe, by_mode in table.items():
        print(f"\n{recipe}, {args.layers} layers x 4 linears, {args.tokens} tokens, MiB over the parameters")
        keys = list(dict.fromkeys(k for got in by_mode.values() for k in got))
        print(f"{'':34}" + "".join(f"{m:>22}" for m in by_mode))
        for k in keys:
            print(f"{k:34}" + "".join(f"{by_mode[m].get(k, float('nan')):>22,.1f}" for m in by_mode))


if __name__ == "__main__":
    main()
