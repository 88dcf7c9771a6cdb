"""Model FLOPs per iteration, Megatron-LM's formula (fwd + bwd, no recomputation counted)."""


def window_share(c):
    """The share of a causal attention's (query, key) pairs the layers compute, averaged over them: 1 without
    --window-size; with it a windowed layer's queries see at most window + 1 keys each (--window-attn-skip-freq N:
    every N-th layer all of them)."""
    if getattr(c, "window_size", None) is None:
        return 1.0
    s, w, L = c.seq_length, min(c.window_size + 1, c.seq_length), c.num_layers
    band = w * (w + 1) / 2 + (s - w) * w  # sum over the queries of min(i + 1, w)
    local = L - (L // c.window_attn_skip_freq if c.window_attn_skip_freq else 0)
    return (local * band / (s * (s + 1) / 2) + (L - local)) / L


def num_floating_point_operations(config, batch_size, padded_vocab_size):
    """12 * B * s * L * h^2 * (attention + MLP + logit terms), as Megatron's training.py:
    attention: (1 + G/A + s/h) * (kv_channels * A / h); MLP: (ffn / h) * (3/2 if SwiGLU);
    logits: V / (2 L h). For GPT-2 shapes this is 72 B s L h^2 (1 + s/6h + V/12Lh). MLA: 6 B s L (its
    projection weights + s n (dq + dv)), the same convention (6 FLOPs per weight per token, non-causal scores).
    Multi-token prediction (as Megatron): D more layers built as the decoder's last, D more logits, and each
    depth's norms and eh_proj, 6 B s D (3h + 2h^2). Sliding-window layers: the scores' term times window_share."""
    c = config
    d = c.mtp_num_layers or 0
    h, L, s = c.hidden_size, c.num_layers + d, c.seq_length
    q_ratio = c.kv_channels * c.num_attention_heads / h
    gated = 1.5 if c.swiglu else 1.0
    # MoE layers (as Megatron): each token runs k experts of --moe-ffn-hidden-size (router not counted)
    moe = sum(c.is_moe_layer(i) for i in range(1, L + 1)) if c.num_moe_experts else 0
    ffn = ((L - moe) * c.ffn_hidden_size + moe * c.moe_router_topk * (c.moe_ffn_hidden_size or 0)) / L
    attention = (1 + c.num_query_groups / c.num_attention_heads + s / h * window_share(c)) * q_ratio
    if c.multi_latent_attention:  # Megatron's MLA terms (projections, latent norms), scores without the causal half
        n, dq = c.num_attention_heads, c.qk_head_dim + c.qk_pos_emb_head_dim
        q_term = h * n * dq if c.q_lora_rank is None else c.q_lora_rank * (h + n * dq + 1)
        weights = q_term + c.kv_lora_rank * (h + n * (c.qk_head_dim + c.v_head_dim) + 1) + h * c.qk_pos_emb_head_dim \
            + n * c.v_head_dim * h
        attention = (weights + s * n * (dq + c.v_head_dim)) / (2 * h * h)
    return 12 * batch_size * s * L * h * h * (
        attention
        + (ffn / h) * gated
        + padded_vocab_size * (1 + d) / (2 * L * h)) + 6 * batch_size * s * d * (3 * h + 2 * h * h)
