"""Rotary position embeddings: rotate-half (GPT-NeoX / Llama) layout, or interleaved pairs
(GPT-J; Megatron's --rotary-interleaved: dims 2i and 2i+1 rotate together by frequency i)."""

import math

import torch

import kernels


def rope_inv_freq(dim, base, device=None):
    """The dim/2 rotary inverse frequencies base^(-2i/dim), fp32."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def llama3_inv_freq(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    """Llama 3.1's scaling of rotary inverse frequencies (--use-rope-scaling): a frequency whose wavelength is
    beyond the original context / low_freq_factor is divided by `factor`, one within the original context /
    high_freq_factor is kept, and between the two the blend that is linear in original context / wavelength."""
    wavelength = 2 * math.pi / inv_freq
    blend = (original_max_position_embeddings / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    long_wave = wavelength > original_max_position_embeddings / low_freq_factor
    short_wave = wavelength < original_max_position_embeddings / high_freq_factor
    return torch.where(long_wave, inv_freq / factor, torch.where(short_wave, inv_freq, blended))


def config_inv_freq(c, dim, device=None):
    """The rotary inverse frequencies of ModelConfig c (rotary base, Llama 3.1's scaling if asked), dim wide."""
    inv_freq = rope_inv_freq(dim, c.rotary_base, device)
    if not c.use_rope_scaling:
        return inv_freq
    return llama3_inv_freq(inv_freq, c.rope_scaling_factor, c.rope_scaling_low_freq_factor,
                           c.rope_scaling_high_freq_factor, c.rope_scaling_original_max_position_embeddings)


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
