"""Bytes autograd keeps for one micro-batch on one rank, by the tensors megalite's layers save for backward
(read from the code and from saved-tensor hooks on its CPU path: tests/test_planner_activations.py).

Per pre-norm transformer layer, with S = seq / CP rows of b sequences, t the TP size, S_n = S / t under
sequence parallelism (else S) and e the activation dtype's bytes:
  each norm          its input [S_n, b, h] and its statistics (LayerNorm mean and rstd, RMSNorm rstd)
  linear_qkv         its input [S, b, h] (gathered under SP) and its output [S, b, (hq + 2 hkv) d / t]
                     (v is read from it by attention); with rope, the rotated q and k as well
  attention          flash / SDPA: its output [S, b, hq d / t] (the projection's input) and the fp32
                     log-sum-exp [b, hq / t, S] (CP's ring: fp32 k and v too);
                     --recompute-granularity selective keeps a copy of the
                     output instead of the two (attention runs again in backward)
  MLP                fc1's input [S, b, h], fc1's output [S, b, ffn (x2 SwiGLU) / t], the activation's
                     output [S, b, ffn / t]
and nothing else (no dropout masks with dropout 0; attention dropout draws its masks again in backward on
the flash path). Full recompute keeps only each recomputed chunk's input [S_n, b, h]. Outside the layers:
token and position ids (int64), the final norm, the output layer's input and the loss's logits (fp32
[S, b, V / t] on the torch path; the Triton loss computes its gradient in place in the logits' dtype).

backend "torch" is the path without Triton (CPU): its norms compute in fp32, so RMSNorm keeps x and x / rms
in fp32; "triton" (CUDA, fused kernels) keeps the norm's input in its dtype and fp32 statistics.
MoE layers, MLA and DSA are not modelled yet (predict() refuses them in one line)."""

from megalite.config import ConfigError


def _norm(c, rows, b, h, e, backend):
    if backend == "torch" and c.normalization == "RMSNorm":
        return 2 * rows * b * h * 4 + rows * b * 4  # x and x * rstd in fp32, rstd
    stats = 2 if c.normalization == "LayerNorm" else 1
    return rows * b * h * e + stats * rows * b * (e if backend == "torch" else 4)


def layer_bytes(c, grid, micro, e, backend="triton"):
    """One transformer layer's saved bytes for one micro-batch (no recompute)."""
    if c.num_moe_experts or c.multi_latent_attention:
        raise ConfigError("the planner's activation model covers dense GPT layers; MoE and MLA come next")
    t, S, b, h = grid.tp, c.seq_length // grid.cp, micro, c.hidden_size
    rows = S // t if c.sequence_parallel and t > 1 else S
    d, hq, hkv = c.kv_channels, c.num_attention_heads // t, c.num_query_groups // t
    ffn = c.ffn_hidden_size // t
    out = 2 * _norm(c, rows, b, h, e, backend)
    out += S * b * h * e + S * b * (hq + 2 * hkv) * d * e  # qkv's input and output
    if c.position_embedding_type == "rope":
        out += S * b * (hq + hkv) * d * e
    out += S * b * hq * d * e + (0 if c.recompute_granularity == "selective" else b * hq * S * 4)
    if grid.cp > 1 and (c.cp_comm_type or ["p2p"])[0] == "p2p":
        out += 2 * S * b * hkv * d * 4  # ring attention's contiguous fp32 k and v (the blocks it passes on)
    out += S * b * h * e + S * b * ffn * (2 if c.swiglu else 1) * e + S * b * ffn * e
    return out


def chunk_bytes(c, grid, micro, e, num_layers, pre, post, padded_vocab, backend="triton"):
    """A model chunk's saved bytes for one micro-batch: its layers under the recompute policy, plus the
    embedding's ids on the first chunk and the final norm, output layer and loss on the last."""
    t, S, b, h = grid.tp, c.seq_length // grid.cp, micro, c.hidden_size
    rows = S // t if c.sequence_parallel and t > 1 else S
    if c.recompute_granularity == "full":
        k = c.recompute_num_layers or 1
        kept = -(-num_layers // k) if c.recompute_method == "uniform" else min(k, num_layers)
        out = kept * rows * b * h * e
        if c.recompute_method != "uniform":  # "block": the first k recomputed, the rest kept whole
            out += (num_layers - kept) * layer_bytes(c, grid, micro, e, backend)
    else:
        out = num_layers * layer_bytes(c, grid, micro, e, backend)
    if pre:
        out += S * b * 8 + (S * 8 if c.position_embedding_type == "learned_absolute" else 0)
    if c.position_embedding_type == "rope" and num_layers:
        out += 2 * S * c.kv_channels * 4  # the cos / sin tables, shared by the layers
    if post:
        v = padded_vocab // t
        out += _norm(c, rows, b, h, e, backend) + S * b * h * e + S * b * 8
        out += S * b * v * 4 + 4 if backend == "torch" else S * b * v * e
    return out


def transient_bytes(c, grid, micro, e, backend="triton"):
    """What a full-recompute chunk holds while its backward runs again (on top of the saved bytes)."""
    if c.recompute_granularity != "full":
        return 0
    k = (c.recompute_num_layers or 1) if c.recompute_method == "uniform" else 1
    return k * layer_bytes(c, grid, micro, e, backend)
