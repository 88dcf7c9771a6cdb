"""The kernels' race (kernels/choice.py) in a training run: the shape classes a model configuration meets, decided
once after the model is built and before anything runs it (the pipeline layout's and the memory budget's
measurements run it), the same decision on every rank.

The list comes from the configuration alone, never from what this rank's pipeline stage holds, so it is the same
on every rank of a replica (its dtype aside: replicas of other precisions agree position by position); each rank
reads or times its classes and the times are summed over the replica's ranks in one all-reduce
(distributed/collectives.py). What the list leaves out is decided by the rank that meets it, alone: the MoE
experts' activations (their rows vary with the routing), ring attention's sub-blocks (CP > 1), DSA's and MLA's
own shapes, the softmax of the unfused attention (document masks), the FP8 cast (the grouped GEMM and the FP8
product are never raced: kernels/shape_class.py).
"""
import torch

import kernels
from megalite import parallel_state as ps
from megalite.distributed.collectives import sum_over_replica_world
from megalite.tensor_parallel.layers import padded_vocab_size


def kernel_shapes(c, micro_batch_size, tp, cp, device, adam=True):
    """[(kernel, shape of the first tensor it hands use_triton, dtype, device)] for model config c, as its layers
    call the kernels: norms on [s/cp (/tp with SP), b, h] (and q, k with --qk-layernorm), attention's q and
    rotary on [b, s/cp, heads/tp, d], the activation on fc1's output [s/cp, b, ffn/tp], the loss on the logits
    [s/cp, b, V/tp]; AdamW (adam: the optimizer uses it) on fp32."""
    s, b, e = c.seq_length // cp, micro_batch_size, c.params_dtype
    rows = s // tp if c.sequence_parallel and tp > 1 else s
    norm = "rms_norm" if c.normalization == "RMSNorm" else "layer_norm"
    out = [(norm, (rows, b, c.hidden_size), e)]
    if not c.multi_latent_attention:
        hq, hkv, d = c.num_attention_heads // tp, c.num_query_groups // tp, c.kv_channels
        if c.qk_layernorm:  # per head, over this rank's heads
            out += [(norm, (b, s, hq, d), e), (norm, (b, s, hkv, d), e)]
        if cp == 1:
            out.append(("flash_attention", (b, s, hq, d), e))
        if c.position_embedding_type == "rope" and not c.rotary_interleaved:
            out += [("rotary", (b, s, hq, d), e), ("rotary", (b, s, hkv, d), e)]
    if c.swiglu and not c.geglu:  # (GeGLU runs torch's ops: no kernel to choose)
        out.append(("swiglu", (s, b, 2 * c.ffn_hidden_size // tp), e))
    elif c.add_bias_linear and not c.squared_relu and c.gelu == "tanh":
        out.append(("bias_gelu", (s, b, c.ffn_hidden_size // tp), e))
    out.append(("cross_entropy", (s, b, padded_vocab_size(c.vocab_size, c.make_vocab_size_divisible_by, tp) // tp),
                e))
    if adam:
        out.append(("adamw_step", (1,), torch.float32))
    return [(k, shape, dtype, device) for k, shape, dtype in out]


def decide_kernels(cfg, mcfg, grid):
    """cfg: the KernelConfig. --kernel-choice set, and (auto, on CUDA) the configuration's classes decided on every rank
    of the replica. --no-fused-kernels: the torch path everywhere, nothing raced (flash attention under
    --use-flash-attn still asks the race when it first runs)."""
    kernels.set_kernel_choice(cfg.kernel_choice)
    if cfg.no_fused_kernels:
        return {}
    shapes = kernel_shapes(mcfg, cfg.micro_batch_size, grid.tp, grid.cp, ps.get_device(), cfg.fused_adam)
    return kernels.choice.decide(shapes, reduce_fn=lambda t: sum_over_replica_world(t, grid))
