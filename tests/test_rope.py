"""RoPE fusion without Transformer Engine (``megatron/rope.py``, ``kernels/triton_rope.py``):
the one-pass kernel equals megatron-core's unfused RoPE bit for bit, forward and backward (BF16
and FP16, rotating all of the head dim or part of it, interleaved or not, q as a strided view of
the QKV output, frequencies per position or per sample, signed zeros, subnormals, overflow and infinities);
megatron-core's own ``apply_rotary_pos_emb`` under ``apply_rope_fusion`` (which its config
refuses without a fused RoPE in the slot the plug-in fills) gives the bits of the unfused path; a
kernel that fails leaves the unfused chain with one warning. The kernel runs on CUDA, or on the
CPU under ``TRITON_INTERPRET=1`` (CI's interpreter list); elsewhere the fused function is
megatron-core's unfused one."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_fp8.testing import bits

pytest.importorskip("megatron.core")
rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")

KERNEL = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _freqs(s: int, rot: int, fb: int = 1, interleaved: bool = False) -> torch.Tensor:
    """Frequencies as megatron-core's ``RotaryEmbedding`` lays them out: ``[s, fb, 1, rot]``, FP32."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    pos = torch.arange(s, dtype=torch.float32)[:, None] + torch.arange(fb, dtype=torch.float32)[None, :] * 7
    f = pos[..., None] * inv  # [s, fb, rot / 2]
    emb = torch.stack((f, f), dim=-1).reshape(s, fb, rot) if interleaved else torch.cat((f, f), dim=-1)
    return emb[:, :, None, :].to(DEV)


def _unfused(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)


def _qkv_view(s: int, b: int, h: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A leaf ``[s, b, h, 3 d]`` and its q: a strided view, as megatron-core splits its QKV output."""
    torch.manual_seed(0)
    mixed = (torch.randn(s, b, h, 3 * d, device=DEV) * 3).to(dtype).requires_grad_()
    return mixed, mixed[..., :d]


@pytest.mark.skipif(not KERNEL, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot, fb", [(32, 1), (16, 1), (32, 2)])
def test_kernel_equals_unfused_rope_bitwise(dtype: torch.dtype, interleaved: bool, rot: int, fb: int) -> None:
    from megatron_fp8.megatron import rope

    s, b, h, d = 24, 2, 3, 32
    freqs = _freqs(s, rot, fb, interleaved)
    grads = []
    outs = []
    for fused in (False, True):
        mixed, q = _qkv_view(s, b, h, d, dtype)
        assert not q.is_contiguous()
        if fused:
            assert rope._serves(q, freqs)
            y = rope.fused_apply_rotary_pos_emb(q, freqs, interleaved=interleaved)
            assert type(y.grad_fn).__name__ == "_FusedRoPEBackward"
        else:
            y = _unfused(q, freqs, interleaved)
        g = (torch.randn(y.shape, generator=torch.Generator().manual_seed(1)) * 2).to(dtype).to(DEV)
        g[5, 1, 2], g[6, 0, 1] = 0.0, -0.0  # zero gradients: signed zeros as autograd's sums leave them
        y.backward(g)
        outs.append(y.detach())
        grads.append(mixed.grad)
    assert outs[1].is_contiguous() and outs[1].shape == outs[0].shape
    assert torch.equal(bits(outs[0]), bits(outs[1]))
    assert torch.equal(bits(grads[0]), bits(grads[1]))


@pytest.mark.skipif(not KERNEL, reason="needs CUDA or TRITON_INTERPRET=1")
def test_cosine_and_sine_kept_on_the_frequencies_until_they_change() -> None:
    from megatron_fp8.megatron import rope

    freqs = _freqs(8, 16)
    t = torch.randn(8, 1, 2, 16, device=DEV).to(torch.bfloat16)
    first = rope.fused_apply_rotary_pos_emb(t, freqs)
    kept = getattr(freqs, rope._CACHE)
    assert torch.equal(bits(rope.fused_apply_rotary_pos_emb(t, freqs)), bits(first))
    assert getattr(freqs, rope._CACHE) is kept  # reused
    with torch.no_grad():
        freqs.mul_(2)  # a new version: the cosine and sine are made again
    again = rope.fused_apply_rotary_pos_emb(t, freqs)
    assert getattr(freqs, rope._CACHE) is not kept
    assert torch.equal(bits(again), bits(_unfused(t, freqs, False)))


@pytest.mark.skipif(not KERNEL, reason="needs CUDA or TRITON_INTERPRET=1")
def test_inference_mode_no_grad_and_strided_gradients() -> None:
    """Inference tensors (megatron-core generates under ``torch.inference_mode``) have no version
    to key the cache by: computed, not kept. A gradient with a strided last dim, a head dim that
    is not a power of 2 (masked columns), the output's memory in [b, s] order: all bitwise."""
    from megatron_fp8.megatron import rope

    with torch.inference_mode():
        freqs = _freqs(8, 16)
        t = torch.randn(8, 2, 3, 24, device=DEV).to(torch.bfloat16)
        y = rope.fused_apply_rotary_pos_emb(t, freqs)
        assert not hasattr(freqs, rope._CACHE)
        assert torch.equal(bits(y), bits(_unfused(t, freqs, False)))
    freqs = _freqs(8, 16)
    with torch.no_grad():
        t = torch.randn(8, 2, 3, 24, device=DEV).to(torch.bfloat16)
        assert torch.equal(bits(rope.fused_apply_rotary_pos_emb(t, freqs)), bits(_unfused(t, freqs, False)))
    moved = rope.fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory=True)
    assert moved.transpose(0, 1).is_contiguous()
    assert torch.equal(bits(moved.contiguous()), bits(_unfused(t, freqs, False)))
    grads = []
    for fused in (False, True):
        leaf = t.clone().requires_grad_()
        y = rope.fused_apply_rotary_pos_emb(leaf, freqs) if fused else _unfused(leaf, freqs, False)
        g = torch.randn(24, 8, 2, 3, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEV)
        y.backward(g.permute(1, 2, 3, 0))  # last dim strided: the backward makes it contiguous
        grads.append(leaf.grad)
    assert torch.equal(bits(grads[0]), bits(grads[1]))


def test_frequencies_that_need_a_gradient_get_one() -> None:
    from megatron_fp8.megatron import rope

    freqs = _freqs(8, 16).requires_grad_()
    t = torch.randn(8, 1, 2, 16, device=DEV).to(torch.bfloat16)
    assert not rope._serves(t, freqs)  # the kernel gives the frequencies no gradient: the unfused chain does
    rope.fused_apply_rotary_pos_emb(t, freqs).float().sum().backward()
    assert freqs.grad is not None


@pytest.mark.skipif(not KERNEL, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_equals_unfused_rope_with_special_values(dtype: torch.dtype) -> None:
    """Subnormals, values whose products overflow, infinities; a Llama-sized head (h 32, d 128):
    bitwise, NaN payloads aside (the same places are NaN)."""
    from megatron_fp8.megatron import rope

    torch.manual_seed(0)
    s, b, h, d = (64, 2, 32, 128) if torch.cuda.is_available() else (8, 2, 4, 128)
    freqs = _freqs(s, d) * 37  # angles of every quadrant
    tiny = torch.finfo(dtype).tiny
    x = torch.randn(s, b, h, d, device=DEV)
    x[0] *= tiny / 4  # subnormal inputs
    x[1] *= torch.finfo(dtype).max / 2  # products and sums near overflow
    x[2, 0, 0, :8] = float("inf")
    x = x.to(dtype)
    g = torch.randn(x.shape, device=DEV)
    g[3] *= tiny / 4  # subnormal gradients
    g = g.to(dtype)
    outs, grads = [], []
    for fused in (False, True):
        leaf = x.clone().requires_grad_()
        y = rope.fused_apply_rotary_pos_emb(leaf, freqs) if fused else _unfused(leaf, freqs, False)
        y.backward(g)
        outs.append(y.detach())
        grads.append(leaf.grad)
    for a, b_ in ((outs[0], outs[1]), (grads[0], grads[1])):
        assert torch.equal(a.isnan(), b_.isnan())
        ok = ~a.isnan()
        assert torch.equal(bits(a[ok]), bits(b_[ok]))


def test_unserved_calls_take_megatrons_unfused_rope() -> None:
    from megatron_fp8.megatron import rope

    freqs = _freqs(8, 16)
    t = torch.randn(8, 1, 2, 16, device=DEV, requires_grad=True)  # FP32: not the kernel's
    assert not rope._serves(t, freqs)
    y = rope.fused_apply_rotary_pos_emb(t, freqs)
    assert torch.equal(bits(y), bits(_unfused(t, freqs, False)))
    moved = rope.fused_apply_rotary_pos_emb(t.detach(), freqs, transpose_output_memory=True)
    assert moved.transpose(0, 1).is_contiguous() and torch.equal(bits(moved.contiguous()), bits(y))


def test_a_kernel_that_fails_warns_once_and_leaves_the_unfused_rope(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_fp8.megatron import rope

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no compiler for this GPU")

    monkeypatch.setattr(rope._FusedRoPE, "apply", broken)
    monkeypatch.setattr(rope, "_state", rope._State())
    monkeypatch.setattr(rope, "_serves", lambda t, freqs: True)  # as on a GPU
    freqs = _freqs(8, 16)
    t = torch.randn(8, 1, 2, 16, device=DEV).to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="fused RoPE kernel failed.*unfused"):
        y = rope.fused_apply_rotary_pos_emb(t, freqs)
    assert torch.equal(bits(y), bits(_unfused(t, freqs, False)))
    assert not rope._state.kernel_ok
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the next call goes straight to the unfused RoPE
        assert torch.equal(bits(rope.fused_apply_rotary_pos_emb(t, freqs)), bits(y))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [32, 16])
def test_backward_by_torch_equals_autograds_through_the_unfused_rope(interleaved: bool, rot: int) -> None:
    """The backward a failed kernel leaves (torch ops): autograd's through the unfused chain, bitwise."""
    from megatron_fp8.megatron import rope

    freqs = _freqs(12, rot, 1, interleaved)
    mixed, q = _qkv_view(12, 2, 2, 32, torch.bfloat16)
    y = _unfused(q, freqs, interleaved)
    g = (torch.randn(y.shape, generator=torch.Generator().manual_seed(1)) * 2).to(torch.bfloat16).to(DEV)
    g[5, 1, 1], g[6, 0, 0] = 0.0, -0.0
    y.backward(g)
    cos, sin = rope._cos_sin(freqs, torch.bfloat16)
    got = rope._backward_by_torch(g, cos, sin, interleaved)
    assert torch.equal(bits(got), bits(mixed.grad[..., :32]))


def test_install_fills_only_an_empty_slot_and_packed_sequences_name_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_fp8.megatron import rope

    def te_rope(*args: object, **kwargs: object) -> None:  # stands in for Transformer Engine's kernel
        return None

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", te_rope)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None)
    assert rope.install() is False and rope_utils.fused_apply_rotary_pos_emb is te_rope
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    assert rope.install() is True
    with pytest.raises(RuntimeError, match="--no-rope-fusion"):
        rope_utils.fused_apply_rotary_pos_emb_thd(torch.zeros(1), None, None, cp_size=1, cp_rank=0)


def test_megatron_dispatches_to_the_fused_rope_with_the_unfused_bits() -> None:
    """megatron-core's own ``apply_rotary_pos_emb`` under a config with ``apply_rope_fusion``
    (which its config check refuses without a fused RoPE in the slot): the plug-in's function
    runs, with the bits of the same call under ``apply_rope_fusion=False``."""
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_fp8.megatron import plugin  # noqa: F401  (installs the fused RoPE where TE is missing)

    assert rope_utils.fused_apply_rotary_pos_emb is not None
    kw = dict(num_layers=1, hidden_size=64, num_attention_heads=2)
    on, off = TransformerConfig(apply_rope_fusion=True, **kw), TransformerConfig(apply_rope_fusion=False, **kw)
    freqs = _freqs(16, 32)
    cp = SimpleNamespace(size=lambda: 1, rank=lambda: 0)  # read for packed sequences only
    outs, grads = [], []
    for cfg in (off, on):
        mixed, q = _qkv_view(16, 2, 2, 32, torch.bfloat16)
        y = rope_utils.apply_rotary_pos_emb(q, freqs, config=cfg, cp_group=cp)
        y.float().square().sum().backward()
        outs.append(y.detach())
        grads.append(mixed.grad)
    assert torch.equal(bits(outs[0]), bits(outs[1])) and torch.equal(bits(grads[0]), bits(grads[1]))


def test_launcher_installs_the_fused_rope_before_the_script_builds_its_config(tmp_path, monkeypatch) -> None:
    """Megatron-LM builds its ``TransformerConfig`` before importing ``--spec``: under our launcher
    the slot is filled first, so a config with ``apply_rope_fusion`` (Megatron-LM's default) builds."""
    import sys

    from megatron_fp8.megatron.launch import main

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    script = tmp_path / "pretrain_stub.py"
    out = tmp_path / "built.txt"
    script.write_text(
        "import sys\n"
        "from megatron.core.transformer.transformer_config import TransformerConfig\n"
        "cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=2, apply_rope_fusion=True)\n"
        "open(sys.argv[1], 'w').write(str(cfg.apply_rope_fusion))\n")
    main([str(script), str(out)])
    assert out.read_text() == "True"
