"""Multi-latent attention (DeepSeek-V2/V3; Megatron-Core's MLASelfAttention), heads sharded over TP.

Per token x [h], n heads, dn = qk_head_dim, dr = qk_pos_emb_head_dim, dv = v_head_dim:
  q      = W_qu norm_q(W_qd x)  (with --q-lora-rank; else W_q x)       -> per head [q_nope (dn) | q_pe (dr)]
  [c; kr] = W_kvd x,  c: kv_lora_rank dims, kr: dr dims (one rotary key part shared by all heads)
  kv     = W_kvu norm_kv(c)                                             -> per head [k_nope (dn) | v (dv)]
  q_h    = [q_nope_h | R q_pe_h],  k_h = [k_nope_h | R kr],  R: rotary (YaRN by default, yarn.py)
  out    = W_o concat_h softmax(q_h k_h^T * scale, causal) v_h,  scale = m^2 / sqrt(dn + dr)  (yarn.py)
norm_q / norm_kv (--normalization) exist only with --qk-layernorm, as in Megatron's layer specs.

Sharding (Megatron's TE spec): W_qd and W_kvd are replicated ("duplicated") over TP, so under sequence
parallelism they see this rank's sequence slice only and their gradients (and the latent norms') are
partial sums over TP, marked `sequence_parallel` so the grads are summed over TP; W_qu, W_kvu and W_q
are column-parallel (they gather the sequence), W_o row-parallel. kr feeds every head: under SP it is
gathered over the sequence (its gradient reduce-scattered); without SP each rank's heads give a
partial gradient, summed over TP by copy_to_tensor_model_parallel_region. Parameter names are
Megatron's (self_attention.linear_q_down_proj.weight, ...); init is topology independent.
--experimental-attention-variant dsa: DeepSeek sparse attention (dsa.py, self_attention.core_attention.indexer.*)
picks the keys each query attends to; the core attention below runs with its mask.
"""

import torch
from torch import nn

from megalite import parallel_state as ps
from megalite.distributed.cp_comm import cp_size
from megalite.tensor_parallel import (
    ColumnParallelLinear,
    DuplicatedLinear,
    RowParallelLinear,
    checkpoint,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megalite.tensor_parallel.init import init_normal, param_seed
from megalite.transformer.attention import core_attention
from megalite.transformer.cp_attention import context_parallel_attention
from megalite.transformer.dsa import DSAttention
from megalite.transformer.norm import build_norm
from megalite.transformer.rope import apply_rotary
from megalite.transformer.utils import output_init_std
from megalite.transformer.yarn import mla_softmax_scale


class MLASelfAttention(nn.Module):
    def __init__(self, config, prefix, layer_number=1, grid=None):
        super().__init__()
        c = self.config = config
        self.layer_number = layer_number
        self.grid = grid = ps.current_grid(grid)
        tp = grid.tp
        self.heads = c.num_attention_heads // tp
        self.dq = c.qk_head_dim + c.qk_pos_emb_head_dim
        self.softmax_scale = mla_softmax_scale(c)

        def column(inp, out, name):
            return ColumnParallelLinear(inp, out, bias=False, init_method=init_normal(c.init_method_std),
                                        sequence_parallel=c.sequence_parallel,
                                        init_seed=param_seed(c.seed, f"{prefix}.{name}"), params_dtype=c.params_dtype,
                                        grid=grid)
        def duplicated(inp, out, name):  # under SP it projects this rank's tokens: partial gradients
            return DuplicatedLinear(inp, out, init_normal(c.init_method_std), param_seed(c.seed, f"{prefix}.{name}"),
                                    c.params_dtype, partial_grads=c.sequence_parallel and tp > 1)
        n = c.num_attention_heads
        if c.q_lora_rank is None:
            self.linear_q_proj = column(c.hidden_size, n * self.dq, "linear_q_proj")
        else:
            self.linear_q_down_proj = duplicated(c.hidden_size, c.q_lora_rank, "linear_q_down_proj")
            self.linear_q_up_proj = column(c.q_lora_rank, n * self.dq, "linear_q_up_proj")
        self.linear_kv_down_proj = duplicated(c.hidden_size, c.kv_lora_rank + c.qk_pos_emb_head_dim,
                                              "linear_kv_down_proj")
        self.linear_kv_up_proj = column(c.kv_lora_rank, n * (c.qk_head_dim + c.v_head_dim), "linear_kv_up_proj")
        if c.qk_layernorm:  # on the latents (this rank's sequence slice under SP: partial grads, summed over TP)
            self.q_layernorm = build_norm(c, c.q_lora_rank, grid=grid)
            self.kv_layernorm = build_norm(c, c.kv_lora_rank, grid=grid)
        self.linear_proj = RowParallelLinear(
            n * c.v_head_dim, c.hidden_size, bias=c.add_bias_linear, input_is_parallel=True,
            init_method=init_normal(output_init_std(c)), skip_bias_add=True, sequence_parallel=c.sequence_parallel,
            init_seed=param_seed(c.seed, prefix + ".linear_proj"), params_dtype=c.params_dtype, grid=grid)
        if c.experimental_attention_variant == "dsa":
            self.core_attention = DSAttention(c, prefix + ".core_attention", layer_number, self.softmax_scale, grid)

    def _shared_rotary_key(self, k_pe):
        """k_pe [s(/TP under SP), b, dr] -> [s, b, dr], every head of this rank reading it."""
        if self.grid.tp == 1:
            return k_pe
        if self.config.sequence_parallel:
            return gather_from_sequence_parallel_region(k_pe, tensor_parallel_output_grad=True, grid=self.grid)
        return copy_to_tensor_model_parallel_region(k_pe, grid=self.grid)

    def qkv(self, x, rotary, latent=False):
        """x [s(/TP), b, h] -> q, k [b, s, heads, dn + dr], v [b, s, heads, dv] (this rank's heads)
        (and, latent=True, the query latent after its norm, or x without --q-lora-rank: DSA's indexer input)."""
        c = self.config
        q_latent = x
        if c.q_lora_rank is None:
            q = self.linear_q_proj(x)
        else:
            q_latent = self.linear_q_down_proj(x)
            if c.qk_layernorm:
                q_latent = self.q_layernorm(q_latent)
            q = self.linear_q_up_proj(q_latent)
        kv_latent, k_pe = self.linear_kv_down_proj(x).split([c.kv_lora_rank, c.qk_pos_emb_head_dim], dim=-1)
        if c.qk_layernorm:
            kv_latent = self.kv_layernorm(kv_latent)
        kv = self.linear_kv_up_proj(kv_latent)
        s, b = q.shape[:2]
        q = q.view(s, b, self.heads, self.dq).transpose(0, 1)
        k_nope, v = kv.view(s, b, self.heads, -1).transpose(0, 1).split([c.qk_head_dim, c.v_head_dim], dim=-1)
        v = v.contiguous()  # a view saved by attention would keep the whole k/v up-projection output alive
        k_pe = self._shared_rotary_key(k_pe).transpose(0, 1).unsqueeze(2)  # [b, s, 1, dr]
        q_nope, q_pe = q.split([c.qk_head_dim, c.qk_pos_emb_head_dim], dim=-1)
        if rotary is not None:
            cos, sin = rotary
            q_pe = apply_rotary(q_pe, cos, sin, c.fused_kernels, interleaved=True)
            k_pe = apply_rotary(k_pe, cos, sin, c.fused_kernels, interleaved=True)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.heads, -1)], dim=-1)
        return (q, k, v, q_latent) if latent else (q, k, v)

    def forward(self, x, rotary=None, attn_mask=None, inference_cache=None):
        """x [s, b, h] (sequence-sharded under SP); rotary: MLA's (cos, sin) tables (yarn.py) at this
        micro-batch's positions -> (out [s, b, h], bias or None)."""
        c = self.config
        q, k, v, q_latent = self.qkv(x, rotary, latent=True)
        b, s = q.shape[:2]
        dsa_loss = None
        if c.experimental_attention_variant == "dsa":
            if inference_cache is not None:
                raise NotImplementedError("DSA (--experimental-attention-variant dsa) with a KV cache: generate "
                                          "with use_cache=False")
            attn_mask, dsa_loss = self.core_attention(x, q_latent, q, k, rotary, attn_mask)
        elif inference_cache is not None:
            k, v, attn_mask = inference_cache.extend(id(self), k, v)
        if inference_cache is None and cp_size(self.grid) > 1:  # this rank's part of every sequence (not DSA)
            kinds = c.cp_comm_type or ["p2p"]
            fn = context_parallel_attention
            args = (q, k, v, kinds[0] if len(kinds) == 1 else kinds[self.layer_number - 1], c.attention_dropout,
                    self.training, core_attention, c.fused_kernels, attn_mask, self.grid, self.softmax_scale)
        else:
            fn = core_attention
            args = (q, k, v, c.attention_dropout, c.fused_kernels, self.training, attn_mask, c.use_flash_attn,
                    self.layer_number if c.apply_query_key_layer_scaling else None, self.softmax_scale)
        ctx = checkpoint(fn, *args) if c.recompute_granularity == "selective" else fn(*args)
        if dsa_loss is not None:
            ctx = self.core_attention.attach(ctx, dsa_loss)
        return self.linear_proj(ctx.reshape(b, s, -1), batch_first=True)  # [b, s, heads * dv] in
