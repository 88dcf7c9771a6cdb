"""YaRN rotary frequencies (Peng et al. 2023, as Megatron-Core's YarnRotaryEmbedding) and the rotary
tables of multi-latent attention (MLA), which rotates only each head's qk_pos_emb_head_dim dims.

For rotary dim d, base b, scaling factor s, original context L0 and beta_fast / beta_slow:
  f_i     = b^(-2i/d), i < d/2                          plain rope frequencies
  dim(r)  = d ln(L0 / (2 pi r)) / (2 ln b)              the dim index whose wave turns r times in L0
  lo      = max(floor(dim(beta_fast)), 0), hi = min(ceil(dim(beta_slow)), d - 1)   (hi += 0.001 if equal)
  ramp_i  = clamp((i - lo) / (hi - lo), 0, 1)
  inv_i   = f_i / s * ramp_i + f_i * (1 - ramp_i)       fast dims extrapolate, slow dims interpolate by s
  m(s, k) = 0.1 k ln s + 1 for s > 1, else 1
The cos/sin tables are multiplied by the concentration m(s, mscale) / m(s, mscale_all_dim), so the
rotated part of every q.k carries its square; MLA's softmax scale is m(s, mscale_all_dim)^2 /
sqrt(qk_head_dim + qk_pos_emb_head_dim) (for rope_type "rope" too, as Megatron).

MLA rotates pairs (2j, 2j+1) of the pos-emb dims by frequency j: Megatron de-interleaves them and
rotates halves, which permutes the rotated dims of q and k alike, so every q.k equals this
interleaved rotation's (megalite.transformer.rope.apply_rotary(..., interleaved=True)).
"""

import math

import torch

from megalite.transformer.rope import rope_inv_freq, rotary_cos_sin


def yarn_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_correction_range(beta_fast, beta_slow, dim, base, original_max_position_embeddings):
    def dim_of(rotations):
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))
    return max(math.floor(dim_of(beta_fast)), 0), min(math.ceil(dim_of(beta_slow)), dim - 1)


def yarn_inv_freq(dim, base, scale, original_max_position_embeddings, beta_fast, beta_slow, device=None):
    """The d/2 YaRN inverse frequencies (fp32, as Megatron)."""
    extra = rope_inv_freq(dim, base, device)
    lo, hi = yarn_correction_range(beta_fast, beta_slow, dim, base, original_max_position_embeddings)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - lo) / (hi - lo)).clamp(0, 1)
    return extra / scale * ramp + extra * (1 - ramp)


def mla_softmax_scale(config):
    c = config
    mscale = yarn_mscale(c.rotary_scaling_factor, c.mscale_all_dim)
    return mscale ** 2 / math.sqrt(c.qk_head_dim + c.qk_pos_emb_head_dim)


def mla_rotary_cos_sin(config, seq_length, device):
    """MLA's cos, sin [seq, rot] in the interleaved layout: rot = qk_pos_emb_head_dim (yarn) or
    int(qk_pos_emb_head_dim * rotary_percent) (rope); YaRN's concentration factor folded in."""
    c = config
    if c.rope_type == "rope":
        return rotary_cos_sin(seq_length, int(c.qk_pos_emb_head_dim * c.rotary_percent), c.rotary_base, device,
                              interleaved=True)
    inv = yarn_inv_freq(c.qk_pos_emb_head_dim, c.rotary_base, c.rotary_scaling_factor,
                        c.original_max_position_embeddings, c.beta_fast, c.beta_slow, device)
    cos, sin = rotary_cos_sin(seq_length, c.qk_pos_emb_head_dim, c.rotary_base, device, interleaved=True, inv_freq=inv)
    m = yarn_mscale(c.rotary_scaling_factor, c.mscale) / yarn_mscale(c.rotary_scaling_factor, c.mscale_all_dim)
    return cos * m, sin * m
