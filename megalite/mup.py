"""Maximal Update Parameterization (muP), as Megatron-LM's --use-mup defines it.

A model of width h is tuned as if it were a narrower base model of width h0
(--mup-base-hidden-size, default h itself). With m = h / h0 (the width multiplier; Megatron's
mup_width_mult, derived, never taken from the command line), sigma = --init-method-std, L =
--num-layers and d = --kv-channels (head dim), the rules are:

initialisation (each weight keeps its own seed and tiles: the same values at every TP layout)
  - embedding class (word and position embeddings, an untied output layer): N(0, sigma), as
    without muP;
  - hidden matrices reading the residual stream (QKV, MLP fc1, MoE experts' fc1, router,
    shared-expert gate): N(0, sigma / sqrt(m));
  - matrices writing into it (attention output projection, MLP fc2): N(0, sigma / (sqrt(2L) sqrt(m)));
  - norms and biases as without muP (ones, zeros).
forward
  - embedding output (word + position, before dropout) times --mup-embedding-mult (default 1);
  - attention softmax scale (sqrt(--mup-base-head-dim) if given, else 1) / d ** --mup-attn-scale-power
    (power default 1: 1/d instead of 1/sqrt(d)); megalite applies it by multiplying the queries
    by scale * sqrt(d), so every attention path (flash, SDPA, unfused, context-parallel, KV cache),
    which divides by sqrt(d), computes exactly that score;
  - logits times --mup-output-mult; left at 1 with m != 1 it becomes 1/m.
optimizer (whichever --optimizer: the LR rule is its param groups'; the eps rule, Adam's)
  - hidden matrices (parameters of 2 or more dims outside the embedding class) take peak LR
    lr * (1/m), floor min_lr * (1/m) and Adam eps adam_eps * (1/m) (warm-up still starts at
    --lr-warmup-init); all others keep lr, min_lr and eps. Weight decay keeps its coefficient
    (decoupled: the decay step lr * wd shrinks with the LR). At m = 1 nothing changes.
  - with --decoupled-lr the embedding class takes the decoupled LR, the hidden matrices muP's.
So at the base width (m = 1) muP differs from the plain model only in the attention scale:
--mup-base-head-dim d (or --mup-attn-scale-power 0.5) makes the two the same function.
"""

import math

from megalite.errors import ConfigError

def finalize(c):
    """Megatron's derived muP fields on a ModelConfig with use_mup (idempotent: a config copied
    with dataclasses.replace derives the same values again)."""
    if c.model_type != "gpt":
        raise ConfigError(f"--use-mup is implemented for GPT models only in megalite, not {c.model_type}")
    if getattr(c, "multi_latent_attention", False):
        raise ConfigError("--use-mup with --multi-latent-attention is not implemented in megalite")
    if c.mup_base_hidden_size is None:
        c.mup_base_hidden_size = c.hidden_size
    if c.mup_base_hidden_size <= 0:
        raise ConfigError(f"--mup-base-hidden-size {c.mup_base_hidden_size} must be positive")
    if c.mup_base_head_dim is not None and c.mup_base_head_dim <= 0:
        raise ConfigError(f"--mup-base-head-dim {c.mup_base_head_dim} must be positive")
    c.mup_width_mult = c.hidden_size / c.mup_base_hidden_size
    if c.mup_output_mult == 1.0 and c.mup_width_mult != 1.0:
        c.mup_output_mult = 1.0 / c.mup_width_mult


def hidden_std(c):
    """Init std of hidden matrices that read the residual stream."""
    if getattr(c, "use_mup", False):
        return c.init_method_std / math.sqrt(c.mup_width_mult)
    return c.init_method_std


def output_std(c):
    """Init std of matrices that write into the residual stream (muP only; see transformer.utils)."""
    return c.init_method_std / (math.sqrt(2.0 * c.num_layers) * math.sqrt(c.mup_width_mult))


def softmax_scale(c):
    """The attention scale applied to q.k: Megatron's 1/sqrt(d) without muP."""
    if not getattr(c, "use_mup", False):
        return 1.0 / math.sqrt(c.kv_channels)
    base = 1.0 if c.mup_base_head_dim is None else c.mup_base_head_dim ** 0.5
    return base / (c.kv_channels ** c.mup_attn_scale_power)


def query_scale(c):
    """The factor queries are multiplied by so that attention's own 1/sqrt(d) gives softmax_scale;
    None when there is nothing to do (no muP, or a scale within rounding of 1/sqrt(d))."""
    if not getattr(c, "use_mup", False):
        return None
    f = softmax_scale(c) * math.sqrt(c.kv_channels)
    return None if abs(f - 1.0) < 1e-12 else f


def embedding_mult(c):
    return c.mup_embedding_mult if getattr(c, "use_mup", False) else 1.0


def output_mult(c):
    return c.mup_output_mult if getattr(c, "use_mup", False) else 1.0


# -- optimizer --------------------------------------------------------------------------------
def width_mult(model_chunks):
    """m of the model the optimizer steps (1.0 without muP), read from its config as Megatron does."""
    for m in model_chunks:
        c = getattr(getattr(m, "module", m), "config", None)
        if c is not None:
            return c.mup_width_mult if getattr(c, "use_mup", False) else 1.0
    return 1.0


def is_embedding_class(name, param):
    """Word / position embeddings, the output layer and the last stage's tied copy (models mark them
    is_embedding_parameter); a parameter nobody marked falls back to its name, as Megatron's."""
    if getattr(param, "shared_embedding", False):
        return True
    if hasattr(param, "is_embedding_parameter"):
        return bool(param.is_embedding_parameter)
    return "embedding" in name.lower()


def lr_mult(name, param, width):
    """The factor on a parameter's peak and minimum LR and on its Adam eps: 1/m for hidden matrices."""
    if width == 1.0 or param.dim() <= 1 or is_embedding_class(name, param):
        return 1.0
    return 1.0 / width
