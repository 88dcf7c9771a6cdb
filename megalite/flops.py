"""Model FLOPs per iteration, Megatron-LM's formula (fwd + bwd, no recomputation counted)."""


def num_floating_point_operations(config, batch_size, padded_vocab_size):
    """12 * B * s * L * h^2 * (attention + MLP + logit terms), as Megatron's training.py:
    attention: (1 + G/A + s/h) * (kv_channels * A / h); MLP: (ffn / h) * (3/2 if SwiGLU);
    logits: V / (2 L h). For GPT-2 shapes this is 72 B s L h^2 (1 + s/6h + V/12Lh)."""
    c = config
    h, L, s = c.hidden_size, c.num_layers, c.seq_length
    q_ratio = c.kv_channels * c.num_attention_heads / h
    gated = 1.5 if c.swiglu else 1.0
    # MoE layers (as Megatron): each token runs k experts of --moe-ffn-hidden-size (router not counted)
    moe = sum(c.is_moe_layer(i) for i in range(1, L + 1)) if c.num_moe_experts else 0
    ffn = ((L - moe) * c.ffn_hidden_size + moe * c.moe_router_topk * (c.moe_ffn_hidden_size or 0)) / L
    return 12 * batch_size * s * L * h * h * (
        (1 + c.num_query_groups / c.num_attention_heads + s / h) * q_ratio
        + (ffn / h) * gated
        + padded_vocab_size / (2 * L * h))
