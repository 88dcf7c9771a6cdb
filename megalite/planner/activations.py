"""Bytes autograd keeps for one micro-batch on one rank, by the tensors megalite's layers save for backward
(read from the code and from saved-tensor hooks on its CPU path: tests/test_planner_activations.py).

Per pre-norm transformer layer, with S = seq / CP rows of b sequences, t the TP size, S_n = S / t under
sequence parallelism (else S) and e the activation dtype's bytes:
  each norm          its input [S_n, b, h] and its statistics (LayerNorm mean and rstd, RMSNorm rstd)
  linear_qkv         its input [S_n, b, h] (under SP its own rows: it gathers them again in backward, as
                     Megatron does); q, k and v [S, b, (hq + 2 hkv) d / t] in all,
                     copied out of its output (rotated, with rope) so that the output itself is freed;
                     --qk-layernorm: each head's norm keeps its input and statistics
  attention          flash / SDPA: its output [S, b, hq d / t] (the projection's input) and the fp32
                     log-sum-exp [b, hq / t, S] (CP's ring: fp32 copies of k and v instead of k and v);
                     --recompute-granularity selective keeps a copy of the
                     output instead of the two (attention runs again in backward)
  MLP                fc1's input [S_n, b, h], fc1's output [S, b, ffn (x2 SwiGLU) / t], the activation's
                     output [S, b, ffn / t] (and SwiGLU's silu(gate) on the torch path)
and nothing else (no dropout masks with dropout 0; attention dropout draws its masks again in backward on
the flash path). Full recompute keeps only each recomputed chunk's input [S_n, b, h]. Outside the layers:
token and position ids (int64), the final norm, the output layer's input and the loss's logits (fp32
[S, b, V / t] on the torch path; the Triton loss computes its gradient in place in the logits' dtype).

backend "torch" is the path without Triton (CPU): its norms compute in fp32, so RMSNorm keeps x and x / rms
in fp32; "triton" (CUDA, fused kernels) keeps the norm's input in its dtype and fp32 statistics.
MoE layers: the router's, dispatch's and experts' tensors for evenly routed tokens (_moe); multi-latent
attention: its latents, norms and projections (_mla). DSA is not modelled yet (refused in one line)."""

from megalite.config import ConfigError


def _norm(c, rows, b, h, e, backend):
    if backend == "torch" and c.normalization == "RMSNorm":
        return 2 * rows * b * h * 4 + rows * b * 4  # x and x * rstd in fp32, rstd
    stats = 2 if c.normalization == "LayerNorm" else 1
    return rows * b * h * e + stats * rows * b * (e if backend == "torch" else 4)


def _ffn_factor(c, backend):
    """Saved [rows, ffn] tensors of an MLP's activation: GeLU keeps fc1's output and fc2 its input; SwiGLU's
    fc1 output is [rows, 2 ffn], and on the torch path silu(gate) is kept too (the Triton kernel recomputes it)."""
    if not c.swiglu:
        return 2
    return 4 if backend == "torch" else 3


def _moe(c, grid, tokens, rows_all, e, backend):
    """An MoE block's saved bytes (moe/: router, allgather / alltoall dispatch, experts, combine) for `tokens`
    rows on this rank, routed evenly: each of the R = ETP x tokens x k rows its experts take (the dispatch
    gathers over ETP x EP, and 1/EP of the routes are this rank's) keeps its dispatched input, the expert's
    fc1 output and activation, its output and its weighted output, with the routes' indices."""
    k, experts = c.moe_router_topk, c.num_moe_experts
    r = grid.expert_tp()[0] * tokens * k if grid.experts else tokens * k
    ffn = c.moe_ffn_hidden_size // (grid.expert_tp()[0] if grid.experts else grid.tp)
    out = tokens * c.hidden_size * 4 + tokens * experts * 4 + 12 * tokens * k  # router input (fp32), scores, top-k
    out += 28 * r + 3 * r * c.hidden_size * e + r * ffn * _ffn_factor(c, backend) * e
    if c.moe_shared_expert_intermediate_size:  # a TP-sharded MLP on every token (its input: this rank's rows,
        shared = c.moe_shared_expert_intermediate_size // grid.tp  # the router's fp32 input itself in fp32)
        out += (tokens * c.hidden_size * e if e != 4 else 0) + rows_all * shared * _ffn_factor(c, backend) * e
    return out


def _mla(c, grid, rows, S, b, e, backend):
    """Multi-latent attention's saved bytes (transformer/mla.py): the layer input its duplicated down-projections
    read (this rank's rows, which the q projection keeps too), the latents and their norms (the up-projections'
    inputs: this rank's rows under SP), the value heads (copied out of the k/v up-projection's output), the
    assembled q and k, and attention's output (also the projection's input) and LSE."""
    h, n = c.hidden_size, c.num_attention_heads // grid.tp
    dq, dv = c.qk_head_dim + c.qk_pos_emb_head_dim, c.v_head_dim
    out = rows * b * h * e
    for latent, extra in ((c.q_lora_rank, 0), (c.kv_lora_rank, c.qk_pos_emb_head_dim)):
        if latent is None:
            continue
        out += rows * b * (latent + extra) * e  # the down-projection's output
        if c.qk_layernorm:  # its norm (input: the output above) and output, the up-projection's input
            out += _norm(c, rows, b, latent, e, backend)
    out += S * b * n * dv * e + 2 * S * b * n * dq * e  # v; q and k
    out += S * b * n * dv * e + (0 if c.recompute_granularity == "selective" else b * n * S * 4)
    return out


def layer_bytes(c, grid, micro, e, backend="triton", layer_number=1):
    """One transformer layer's saved bytes for one micro-batch (no recompute); layer_number (global, 1-based)
    says whether it is an MoE layer."""
    if c.experimental_attention_variant:
        raise ConfigError(f"the planner's activation model has no --experimental-attention-variant "
                          f"{c.experimental_attention_variant} (DSA) yet")
    t, S, b, h = grid.tp, c.seq_length // grid.cp, micro, c.hidden_size
    rows = S // t if c.sequence_parallel and t > 1 else S
    d, hq, hkv = c.kv_channels, c.num_attention_heads // t, c.num_query_groups // t
    ffn = c.ffn_hidden_size // t
    out = 2 * _norm(c, rows, b, h, e, backend)
    if c.multi_latent_attention:
        out += _mla(c, grid, rows, S, b, e, backend)
    else:
        out += rows * b * h * e + S * b * hq * d * e  # qkv's input (this rank's rows under SP); q
        if grid.cp > 1 and (c.cp_comm_type or ["p2p"])[0] == "p2p":
            out += 2 * S * b * hkv * d * 4  # ring attention keeps contiguous fp32 k and v (the blocks it passes on)
        else:
            out += 2 * S * b * hkv * d * e  # k and v
        if c.qk_layernorm:  # per head: q's and k's norms keep their inputs and statistics
            out += _norm(c, S * (hq + hkv), b, d, e, backend)
        out += S * b * hq * d * e + (0 if c.recompute_granularity == "selective" else b * hq * S * 4)
    if c.is_moe_layer(layer_number):
        return out + _moe(c, grid, rows * b, S * b, e, backend)
    out += rows * b * h * e + S * b * ffn * _ffn_factor(c, backend) * e  # fc1's input, its output on
    return out


def layers_bytes(c, grid, micro, e, backend, numbers):
    """layer_bytes of each global layer number in `numbers`, computed once per kind of layer (dense, MoE: all that
    layer_number decides) instead of once per layer: a search asks for every layer of every layout."""
    kinds = {}
    for n in numbers:
        moe = c.is_moe_layer(n)
        if moe not in kinds:
            kinds[moe] = layer_bytes(c, grid, micro, e, backend, n)
        yield kinds[moe]


def _logits(c, grid, b, e, padded_vocab, backend):
    """The loss's logits [S, b, V / t]: fp32 on the torch path, the model's dtype where the Triton loss computes its
    gradient in place."""
    S, v = c.seq_length // grid.cp, padded_vocab // grid.tp
    return S * b * v * 4 + 4 if backend == "torch" else S * b * v * e


def mtp_bytes(c, grid, micro, e, padded_vocab, backend="triton"):
    """Multi-token prediction's saved bytes on the last stage (transformer/mtp.py), per depth: the shifted ids,
    labels and loss mask, the embedding's lookup of the ids, enorm and hnorm (hnorm's input is the previous
    depth's output, which the output layer keeps already), eh_proj's input (both norms' outputs side by side),
    its transformer layer, its final norm, the shared output layer's input and logits, and the masked loss."""
    t, S, b, h = grid.tp, c.seq_length // grid.cp, micro, c.hidden_size
    rows = S // t if c.sequence_parallel and t > 1 else S
    per = S * b * (8 + 8 + 4) + 2 * S * b * 4  # shifted ids, labels, mask; the per-token loss and the mask it meets
    per += rows * b * h * e + _logits(c, grid, b, e, padded_vocab, backend)  # the output layer's input, the logits
    if c.recompute_granularity == "full":  # a depth runs again in backward from h (kept) and its embedding output
        return c.mtp_num_layers * (per + rows * b * h * e)
    per += _norm(c, rows, b, h, e, backend) + _norm(c, rows, b, h, e, backend) - rows * b * h * e  # enorm, hnorm
    per += rows * b * 2 * h * e + _norm(c, rows, b, h, e, backend)  # eh_proj's input, the final norm
    return sum(per + layer_bytes(c, grid, micro, e, backend, c.num_layers + k + 1) for k in range(c.mtp_num_layers))


def chunk_bytes(c, grid, micro, e, num_layers, pre, post, padded_vocab, backend="triton", first_layer=0):
    """A model chunk's saved bytes for one micro-batch: its layers (first_layer: the global index of its
    first) under the recompute policy, plus the embedding's ids on the first chunk and the final norm,
    output layer and loss on the last."""
    layers = list(layers_bytes(c, grid, micro, e, backend, range(first_layer + 1, first_layer + num_layers + 1)))
    t, S, b, h = grid.tp, c.seq_length // grid.cp, micro, c.hidden_size
    rows = S // t if c.sequence_parallel and t > 1 else S
    if c.recompute_granularity == "full":
        k = c.recompute_num_layers or 1
        kept = -(-num_layers // k) if c.recompute_method == "uniform" else min(k, num_layers)
        out = kept * rows * b * h * e
        if c.recompute_method != "uniform":  # "block": the first k recomputed, the rest kept whole
            out += sum(layers[kept:])
    else:
        out = sum(layers)
    if pre:
        out += S * b * 8 + (S * 8 if c.position_embedding_type == "learned_absolute" else 0)
    if c.position_embedding_type == "rope" and num_layers:
        out += 2 * S * c.kv_channels * 4  # the cos / sin tables, shared by the layers
    if post:
        out += _norm(c, rows, b, h, e, backend) + rows * b * h * e + S * b * 8  # the output layer's input
        out += _logits(c, grid, b, e, padded_vocab, backend)
        if c.mtp_num_layers:
            out += mtp_bytes(c, grid, micro, e, padded_vocab, backend)
    return out


def transient_bytes(c, grid, micro, e, backend="triton"):
    """What a full-recompute chunk holds while its backward runs again (on top of the saved bytes)."""
    if c.recompute_granularity != "full":
        return 0
    k = (c.recompute_num_layers or 1) if c.recompute_method == "uniform" else 1
    return k * max(layers_bytes(c, grid, micro, e, backend, range(1, c.num_layers + 1)))
