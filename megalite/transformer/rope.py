"""Rotary position embeddings, rotate-half (GPT-NeoX / Llama) layout."""

import torch

import kernels


def rotary_cos_sin(seq_length, dim, base, device, dtype=torch.float32):
    """cos, sin of shape [seq, dim] (the frequencies repeated for both halves)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    t = torch.arange(seq_length, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x, cos, sin, fused=False):
    """x [b, s, heads, dim]; cos/sin [s, rot] with rot <= dim (Megatron's --rotary-percent): the
    first rot dims of each head rotate, the rest pass through. Triton on CUDA unless fused is False."""
    if fused and kernels.use_triton(x):
        return kernels.rotary(x, cos, sin)  # rotates cos.shape[-1] dims, copies the rest in the same pass
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return (x.float() * c + rotate_half(x.float()) * s).to(x.dtype)
