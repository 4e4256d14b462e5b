"""Megatron's RoPE fusion (``--apply-rope-fusion``, on by default in Megatron-LM) without
Transformer Engine: one Triton pass for q and one for k, forward and backward, with the bits of
megatron-core's unfused RoPE.

megatron-core takes its fused RoPE from Transformer Engine only
(``rope_utils.fused_apply_rotary_pos_emb``); without TE, its ``TransformerConfig`` refuses
``apply_rope_fusion`` and Megatron-LM users pass ``--no-rope-fusion``, getting the unfused chain
of about a dozen elementwise launches per tensor forward and more backward
(``kernels/triton_rope.py``). ``install()`` (run by the plug-in and by our launcher, which runs
before Megatron-LM builds its config) puts ``fused_apply_rotary_pos_emb`` below in that slot
where TE left it empty; with TE installed nothing changes. Where the kernel does not serve a call
(CPU without Triton's interpreter, FP32, an unusual frequency layout) megatron-core's own unfused
function computes it, so the flag never changes a number: only how many launches it takes.
Packed sequences (THD) keep needing TE's fused kernel: ``fused_apply_rotary_pos_emb_thd``
raises, naming the fix (``--no-rope-fusion``).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ..quant.kernels import _kernel_device
from .specs import import_megatron

_CACHE = "_megatron_fp8_rope"  # the attribute on a frequency tensor holding its cosine and sine


@functools.cache
def _kernels() -> Any | None:
    """``kernels.triton_rope``, or None without Triton (imported once, not per call)."""
    try:
        from ..kernels import triton_rope
    except ImportError:
        return None
    return triton_rope


def _cos_sin(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``freqs [s, fb, 1, rot]``'s cosine and sine as megatron-core's unfused RoPE rounds them
    (FP32, then ``dtype``), ``[s, fb, rot]`` contiguous. Kept on the frequency tensor (megatron-core's
    ``RotaryEmbedding`` returns the same one every step) until it is modified in place (a write
    through ``.data`` is not seen: megatron-core makes its frequencies once). Not kept, nor read
    from what is kept, while a CUDA graph is being captured (the graph computes them itself, so a
    replay never reads tensors the cache may have dropped), nor for inference tensors (which have
    no version to key them by)."""
    capturing = freqs.is_cuda and torch.cuda.is_current_stream_capturing()
    keep = not capturing and not freqs.is_inference()
    key = (freqs._version, dtype) if keep else None
    kept = getattr(freqs, _CACHE, None) if keep else None
    if kept is not None and kept[0] == key:
        return kept[1], kept[2]
    f = freqs.reshape(freqs.shape[0], freqs.shape[1], freqs.shape[-1])
    cos, sin = torch.cos(f).to(dtype).contiguous(), torch.sin(f).to(dtype).contiguous()
    if keep:
        setattr(freqs, _CACHE, (key, cos, sin))
    return cos, sin


class _FusedRoPE(torch.autograd.Function):
    """``kernels.triton_rope.rope`` forward and backward (the cosine and sine saved: small)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,  # type: ignore[override]
                interleaved: bool) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _kernels().rope(t, cos, sin, interleaved, backward=False)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        g = grad if grad.stride(-1) == 1 else grad.contiguous()
        if _state.kernel_ok:
            try:
                return _kernels().rope(g, cos, sin, ctx.interleaved, backward=True), None, None, None
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - torch's ops compute the same bits
                _failed(exc)
        return _backward_by_torch(g, cos, sin, ctx.interleaved), None, None, None


def _backward_by_torch(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The kernel's backward in torch ops (where it failed): ``g cos`` plus ``rotate_half``'s
    transpose of ``g sin``, rounded as autograd rounds them through the unfused chain."""
    rot = cos.shape[-1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    g_rot = g[..., :rot]
    a, b = g_rot * c, g_rot * s
    if interleaved:  # dx[2i] += b[2i + 1], dx[2i + 1] -= b[2i]
        r = torch.stack((b[..., 1::2], -b[..., 0::2]), dim=-1).flatten(-2)
    else:  # dx[i] += b[i + half], dx[i + half] -= b[i]
        r = torch.cat((b[..., rot // 2:], -b[..., : rot // 2]), dim=-1)
    return torch.cat((a + r, g[..., rot:]), dim=-1) + 0.0  # -0 comes out +0, as autograd's sums


def _serves(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether the kernel takes ``t`` with ``freqs`` (``[s, 1 or b, 1, rot]``) on this device."""
    if not _kernel_device(t) or freqs.dim() != 4 or freqs.shape[2] != 1 or freqs.device != t.device:
        return False
    if freqs.requires_grad:  # the kernel gives no gradient to the frequencies
        return False
    if t.dim() != 4 or t.dtype not in (torch.bfloat16, torch.float16) or t.stride(-1) != 1:
        return False
    if _kernels() is None:
        return False
    s, b, _, d = t.shape
    rot = freqs.shape[-1]
    return freqs.shape[0] == s and freqs.shape[1] in (1, b) and rot % 2 == 0 and 0 < rot <= d and t.numel() > 0


class _State:
    kernel_ok = True  # False once the kernel failed: megatron-core's unfused RoPE from then on (same bits)
    proven = False  # a forward ran through the kernel


_state = _State()


def _failed(exc: BaseException) -> None:
    _state.kernel_ok = False
    warnings.warn(f"megatron_fp8: the fused RoPE kernel failed ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0] if str(exc) else ''}); RoPE runs megatron-core's unfused ops "
                  f"from now on (the same numbers, more launches; --no-rope-fusion says so explicitly)",
                  RuntimeWarning, stacklevel=4)


def _fused(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor | None:
    """The kernel's RoPE; None (after a warning, once) where its first forward fails, e.g. a
    Triton that cannot compile it: the caller computes the unfused RoPE, with the same bits."""
    cos, sin = _cos_sin(freqs, t.dtype)
    if _state.proven:
        return _FusedRoPE.apply(t, cos, sin, interleaved)
    try:
        out = _FusedRoPE.apply(t, cos, sin, interleaved)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - the unfused chain computes the same bits
        _failed(exc)
        return None
    _state.proven = True
    return out


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                               interleaved: bool = False) -> torch.Tensor:
    """RoPE of ``t [s, b, h, d]`` with ``freqs [s, 1, 1, rot]`` (Transformer Engine's signature,
    which megatron-core calls): the Triton kernel where it serves, megatron-core's unfused RoPE
    elsewhere; the same bits either way. ``transpose_output_memory``: the output's memory in
    ``[b, s, h, d]`` order, as TE's option."""
    if freqs.dim() == t.dim() + 1 and freqs.size(-2) == 1:  # [s, 1, 1, 1, rot], as megatron-core squeezes
        freqs = freqs.squeeze(-2)
    out = _fused(t, freqs, interleaved) if _state.kernel_ok and _serves(t, freqs) else None
    if out is None:
        rope_utils = import_megatron("megatron.core.models.common.embeddings.rope_utils",
                                     "megatron_fp8.megatron.rope")
        out = rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    if transpose_output_memory:
        return out.transpose(0, 1).contiguous().transpose(0, 1)
    return out


def fused_apply_rotary_pos_emb_thd(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Packed sequences (THD) under ``apply_rope_fusion``: Transformer Engine's kernel only."""
    raise RuntimeError("megatron_fp8: RoPE fusion (apply_rope_fusion) for packed sequences (THD) needs Transformer "
                       "Engine's fused kernel, which is not installed; pass --no-rope-fusion (apply_rope_fusion=False) "
                       "for the unfused RoPE")


def install() -> bool:
    """Fill megatron-core's fused-RoPE slots where Transformer Engine left them empty (both, so
    its config check passes); True where ours are in place."""
    try:
        rope_utils = import_megatron("megatron.core.models.common.embeddings.rope_utils",
                                     "megatron_fp8.megatron.rope")
    except ImportError:
        return False
    if getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is None and \
            getattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None) is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
        rope_utils.fused_apply_rotary_pos_emb_thd = fused_apply_rotary_pos_emb_thd
    return rope_utils.fused_apply_rotary_pos_emb is fused_apply_rotary_pos_emb
