"""Shared helpers for model parity tests: tiny configs and gathering TP shards."""

import torch
import torch.distributed as dist

from megalite.config import ModelConfig
from megalite.distributed.param_facts import tensor_parallel

FLAVOURS = {
    "gpt2": dict(),
    "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                  num_attention_heads=8, num_query_groups=4, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True),
}


def tiny_config(flavour="gpt2", **overrides):
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=250,
              make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0, seed=7)
    kw.update(FLAVOURS[flavour])  # later keys win: the flavour may change the head count
    kw.update(overrides)
    return ModelConfig(**kw)


def gather_full(param, tensor):
    """The full (TP=1) tensor of a parameter's shard `tensor` (a weight or its grad)."""
    tp, _, group = tensor_parallel(param)  # (an MoE expert's: expert-TP)
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    dim = param.partition_dim
    chunks = getattr(param, "shard_chunks", 1)
    if chunks == 1:
        return torch.cat(parts, dim=dim)
    pieces = [p.chunk(chunks, dim=dim) for p in parts]
    return torch.cat([torch.cat([pc[c] for pc in pieces], dim=dim) for c in range(chunks)], dim=dim)


def full_grads(model, vocab_size):
    """name -> full gradient, with vocabulary padding rows cut off."""
    out = {}
    for name, p in model.named_parameters():
        g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        full = gather_full(p, g)
        if "word_embeddings" in name or "output_layer" in name:
            full = full[:vocab_size]
        out[name] = full
    return out


def batch(cfg, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
