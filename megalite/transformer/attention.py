"""Self-attention with heads (and query groups, for GQA/MQA) sharded across TP ranks."""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

import kernels

from megalite import mup, parallel_state as ps
from megalite.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint, get_rng_tracker
from megalite.tensor_parallel.layers import init_normal
from megalite.distributed.cp_comm import cp_size
from megalite.transformer.cp_attention import context_parallel_attention
from megalite.transformer.max_logit import max_logits
from megalite.transformer.norm import build_norm
from megalite.transformer.rope import apply_rotary
from megalite.transformer.utils import output_init_std, param_seed


def sliding_window_mask(sq, sk, window, device):
    """bool [1, 1, sq, sk], True = masked out: the keys after each query (the sq queries are the last sq of the sk
    positions, as under a KV cache) and those more than `window` before it."""
    i = torch.arange(sk - sq, sk, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return ((j > i) | (i - j > window))[None, None]


def core_attention(q, k, v, dropout_p, fused, training, attn_mask=None, flash=False, layer_scale=None,
                   softmax_scale=None, window=None):
    """q [b, s, hq, d]; k, v [b, s, hkv, d (v: dv)] -> [b, s, hq, dv]. Causal unless attn_mask is given
    (bool [b, 1 or h, sq, sk], True = masked out; a key-padding mask [b, 1, 1, sk] runs flash
    attention on CUDA).

    Dropout on attention probabilities drops this rank's heads only, so it draws from the
    per-TP-rank stream (`get_rng_tracker().fork()`), whichever path runs: flash attention
    takes its Philox seed from it, SDPA and the unfused softmax path their masks.
    GQA: k/v keep their hkv heads on every path (no repeat_interleave copies).
    flash (--use-flash-attn): the Triton flash attention on CUDA even with fused kernels off.
    layer_scale (--apply-query-key-layer-scaling: the layer number): fp16 scores are computed
    in fp16 as q.k / (sqrt(d) * layer_scale) and multiplied back by layer_scale in the fp32
    softmax, as Megatron's DotProductAttention; other dtypes never hold scores in fp16, so
    for them it changes nothing and the fast paths stay.
    softmax_scale: default 1/sqrt(q's head dim). v may have another head dim than q and k (MLA): the
    flash kernel, which takes one, gets zero-padded heads and the output is cut back.
    window (--window-size): each query sees the `window` keys before it and itself, as an explicit mask (added to
    attn_mask's); the flash kernel, which has no window yet, is not used then."""
    if window is not None:
        band = sliding_window_mask(q.shape[1], k.shape[1], window, q.device)
        attn_mask = band if attn_mask is None else attn_mask | band
    p = dropout_p if training else 0.0
    triton = fused and kernels.use_triton(q, kernel="flash_attention")
    key_padding = attn_mask is not None and attn_mask.shape[1:3] == (1, 1)  # [b, 1, 1, sk]: BERT's padding
    scaled = layer_scale is not None and q.dtype == torch.float16
    if not scaled and (triton or flash and q.is_cuda) and (attn_mask is None or key_padding):
        dv, d = v.shape[-1], max(q.shape[-1], v.shape[-1])
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        q, k, v = (F.pad(t, (0, d - t.shape[-1])) if t.shape[-1] < d else t for t in (q, k, v))
        with get_rng_tracker().fork() if p > 0 else contextlib.nullcontext():
            if key_padding:
                out = kernels.flash_attention(q, k, v, causal=False, softmax_scale=scale, dropout_p=p,
                                              key_padding_mask=~attn_mask[:, 0, 0])
            else:
                out = kernels.flash_attention(q, k, v, causal=True, softmax_scale=scale, dropout_p=p)
        return out if dv == d else out[..., :dv]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if triton or scaled:
        return _explicit_scores_attention(q, k, v, p, attn_mask, layer_scale if scaled else 1, triton,
                                          softmax_scale=softmax_scale)
    with get_rng_tracker().fork():
        sdpa_mask = None if attn_mask is None else ~attn_mask  # SDPA: True = take part
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, dropout_p=p, is_causal=attn_mask is None,
                                             scale=softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


def _explicit_scores_attention(q, k, v, p, attn_mask, layer_scale, triton, softmax_scale=None):
    """Megatron's unfused attention on q, k [b, h(kv), s, d], v [b, hkv, s, dv] -> [b, s, hq, dv]:
    scores in the input dtype (one batched GEMM scaled by softmax_scale (1 / sqrt(d)) / layer_scale), the
    scaled masked softmax in fp32 (times layer_scale; causal when attn_mask is None), dropout,
    probs @ v. Query heads are grouped per KV head, so GQA needs no repeated k/v."""
    b, hq, s, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    qg = q.reshape(b * hkv, hq // hkv * s, d)
    kg = k.reshape(b * hkv, sk, d).transpose(1, 2)
    alpha = (d ** -0.5 if softmax_scale is None else softmax_scale) / layer_scale
    scores = torch.baddbmm(qg.new_empty(qg.shape[0], qg.shape[1], sk), qg, kg, beta=0.0,
                           alpha=alpha).reshape(b, hq, s, sk)
    with contextlib.nullcontext() if triton else kernels.use_backend("torch"):
        probs = kernels.softmax(scores, scale=layer_scale, mask=attn_mask, causal=attn_mask is None)
    with get_rng_tracker().fork():
        probs = F.dropout(probs, p=p, training=True)
    dv = v.shape[-1]
    out = probs.reshape(b * hkv, hq // hkv * s, sk) @ v.reshape(b * hkv, sk, dv)
    return out.reshape(b, hq, s, dv).transpose(1, 2)


class SelfAttention(nn.Module):
    """QKV rows are laid out per query group: [q heads of group g | k_g | v_g] for each g,
    so a contiguous TP shard holds whole groups with their queries."""

    def __init__(self, config, prefix, layer_number=1, grid=None):
        super().__init__()
        c = config
        self.layer_number = layer_number  # global, 1-based: --apply-query-key-layer-scaling divides by it
        self.grid = grid = ps.current_grid(grid)
        tp = grid.tp
        self.config = c
        self.d = c.kv_channels
        self.groups_local = c.num_query_groups // tp
        self.q_per_group = c.num_attention_heads // c.num_query_groups
        qkv_out = (c.num_attention_heads + 2 * c.num_query_groups) * self.d
        self.linear_qkv = ColumnParallelLinear(
            c.hidden_size, qkv_out, bias=c.add_bias_linear or c.add_qkv_bias,
            init_method=init_normal(mup.hidden_std(c)), sequence_parallel=c.sequence_parallel,
            init_seed=param_seed(c.seed, prefix + ".linear_qkv"), params_dtype=c.params_dtype, grid=grid)
        # rows per query group [q heads; k; v]: Muon orthogonalises q, k and v as three matrices
        self.linear_qkv.weight.qkv_split_shapes = [self.q_per_group * self.d, self.d, self.d]
        self.linear_proj = RowParallelLinear(
            c.num_attention_heads * self.d, c.hidden_size, bias=c.add_bias_linear, input_is_parallel=True,
            init_method=init_normal(output_init_std(c)), skip_bias_add=True,
            sequence_parallel=c.sequence_parallel, init_seed=param_seed(c.seed, prefix + ".linear_proj"),
            params_dtype=c.params_dtype, grid=grid)
        self.max_logits = None  # --qk-clip: the largest q.k / sqrt(d) per local head since the last step
        self.query_scale = mup.query_scale(c)  # muP's softmax scale (megalite/mup.py); None: 1/sqrt(d)
        skip = c.window_attn_skip_freq
        self.window = c.window_size if skip is None or layer_number % skip else None  # (None: all keys before)
        if c.qk_layernorm:  # per head, weights shared by the heads; a TP rank sees only its heads
            self.q_layernorm = build_norm(c, self.d, partial_grads=True, grid=grid)
            self.k_layernorm = build_norm(c, self.d, partial_grads=True, grid=grid)

    def forward(self, x, rotary=None, attn_mask=None, inference_cache=None):
        """x [s, b, h] (sequence-sharded under SP) -> (out [s, b, h], bias or None).
        inference_cache (megalite.transformer.kv_cache.KVCache): keys/values of earlier tokens are reused."""
        c = self.config
        qkv = self.linear_qkv(x)  # [s, b, groups_local * (q_per_group + 2) * d]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.groups_local, self.q_per_group + 2, self.d).transpose(0, 1)
        # q [b, s, heads_local, d], k and v [b, s, groups_local, d], none a view of the QKV output: one that
        # attention or a norm saves for backward would keep the whole output alive. Rope writes fresh q and k, so
        # only v is copied then. Attention's output takes q's [b, s] layout, which the projection reads in place.
        q = qkv[:, :, :, :self.q_per_group].reshape(b, s, self.groups_local * self.q_per_group, self.d)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1].contiguous()
        if rotary is None or c.qk_layernorm:
            q, k = q.contiguous(), k.contiguous()
        if c.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            cos, sin = rotary
            q = apply_rotary(q, cos, sin, c.fused_kernels, c.rotary_interleaved)
            k = apply_rotary(k, cos, sin, c.fused_kernels, c.rotary_interleaved)
        if self.query_scale is not None:  # every attention path below divides q.k by sqrt(d)
            q = q * self.query_scale
        if (c.qk_clip or c.log_max_attention_logit) and self.training:  # this step's largest logit per head
            m = max_logits(q, k, self.grid)
            self.max_logits = m if self.max_logits is None else torch.maximum(self.max_logits, m)
        if inference_cache is not None:
            k, v, attn_mask = inference_cache.extend(id(self), k, v)
        if inference_cache is None and cp_size(self.grid) > 1:  # this rank's part of every sequence
            kinds = c.cp_comm_type or ["p2p"]
            fn = context_parallel_attention
            args = (q, k, v, kinds[0] if len(kinds) == 1 else kinds[self.layer_number - 1], c.attention_dropout,
                    self.training, core_attention, c.fused_kernels, attn_mask, self.grid)
        else:
            fn = core_attention
            args = (q, k, v, c.attention_dropout, c.fused_kernels, self.training, attn_mask, c.use_flash_attn,
                    self.layer_number if c.apply_query_key_layer_scaling else None, None, self.window)
        ctx = checkpoint(fn, *args) if c.recompute_granularity == "selective" else fn(*args)
        return self.linear_proj(ctx.reshape(b, s, -1), batch_first=True)  # [b, s, heads_local * d] in
