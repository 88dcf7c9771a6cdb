"""Rotary position embeddings: rotate-half (GPT-NeoX / Llama) layout, or interleaved pairs
(GPT-J; Megatron's --rotary-interleaved: dims 2i and 2i+1 rotate together by frequency i)."""

import torch

import kernels


def rope_inv_freq(dim, base, device=None):
    """The dim/2 rotary inverse frequencies base^(-2i/dim), fp32."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def rotary_cos_sin(seq_length, dim, base, device, dtype=torch.float32, interleaved=False, inv_freq=None):
    """cos, sin of shape [seq, dim]: the frequencies (rope's, or inv_freq) repeated for both halves,
    or (interleaved) each repeated for its pair."""
    inv_freq = rope_inv_freq(dim, base, device) if inv_freq is None else inv_freq
    t = torch.arange(seq_length, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rotate_pairs(x):
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


def apply_rotary(x, cos, sin, fused=False, interleaved=False):
    """x [b, s, heads, dim]; cos/sin [s, rot] with rot <= dim (Megatron's --rotary-percent): the
    first rot dims of each head rotate, the rest pass through. Triton on CUDA unless fused is False
    (the kernel has the rotate-half layout; interleaved pairs run in torch)."""
    if fused and not interleaved and kernels.use_triton(x, kernel="rotary"):
        return kernels.rotary(x, cos, sin)  # rotates cos.shape[-1] dims, copies the rest in the same pass
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rot], cos, sin, interleaved=interleaved), x[..., rot:]], dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    turned = rotate_pairs(x.float()) if interleaved else rotate_half(x.float())
    return (x.float() * c + turned * s).to(x.dtype)
