"""Probe: does scaled_dot_product_attention keep the query's [s, b, h, d] memory for its output,
per backend, on this GPU (so that megatron_fp8's SDPAttention returns a view of its saved output)?"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

s, b, h, g, d = 4096, 2, 32, 8, 128
for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
    for heads_kv in (h, g):
        q = torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(s, b, heads_kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(s, b, heads_kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        try:
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                                   enable_gqa=heads_kv != h)
        except RuntimeError as e:
            print(f"{backend.name:20s} kv_heads={heads_kv:2d}: refused ({str(e).splitlines()[0][:80]})")
            continue
        ctx = o.permute(2, 0, 1, 3)
        saved = getattr(o.grad_fn, "_saved_output", None)
        same = saved is not None and saved.untyped_storage().data_ptr() == o.untyped_storage().data_ptr()
        print(f"{backend.name:20s} kv_heads={heads_kv:2d}: {type(o.grad_fn).__name__}, out strides {o.stride()}, "
              f"[s,b,h*d] view: {ctx.is_contiguous()}, saved output is the output: {same}")
