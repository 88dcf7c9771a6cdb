"""The model's configuration: ModelConfig (the architecture; how it runs: ExecutionConfig, execution.py, inherited),
and the name lists derived from each field's declared role (fields.py).

Every check raises ConfigError with one line naming the values and what to change; the
entry points print that line on every rank and exit non-zero before any heavy work.
"""

import dataclasses
import typing
from dataclasses import dataclass
from typing import Annotated, Optional

from megalite.config.execution import ExecutionConfig
from megalite.config.fields import LAYOUT, PLAIN, RESTORED, SHAPE_RESTORED, Field  # noqa: F401 (re-exported)
from megalite.errors import ConfigError
from megalite.mup import finalize as finalize_mup


@dataclass
class ModelConfig(ExecutionConfig):
    """What the model is (its architecture); how it runs is ExecutionConfig's, inherited as Megatron's
    TransformerConfig inherits ModelParallelConfig, so model code reads one object."""

    num_layers: Annotated[int, SHAPE_RESTORED] = 2
    hidden_size: Annotated[int, SHAPE_RESTORED] = 64
    num_attention_heads: Annotated[int, SHAPE_RESTORED] = 4
    ffn_hidden_size: Annotated[Optional[int], SHAPE_RESTORED] = None  # default 4h (or 8h/3 rounded for SwiGLU)
    num_query_groups: Annotated[Optional[int], SHAPE_RESTORED] = None  # None: = heads (plain multi-head attention)
    kv_channels: Annotated[Optional[int], SHAPE_RESTORED] = None  # default hidden / heads
    seq_length: Annotated[int, RESTORED] = 128
    max_position_embeddings: Annotated[Optional[int], RESTORED] = None
    vocab_size: Annotated[int, Field(flag=None, shape=True)] = 1024  # real (unpadded) vocabulary
    make_vocab_size_divisible_by: int = 128
    position_embedding_type: Annotated[str, SHAPE_RESTORED] = "learned_absolute"  # or "rope"
    rotary_base: Annotated[float, RESTORED] = 10000.0
    # Llama 3.1's rope scaling (transformer/rope.py): Megatron's two flags; the band and original context megalite's
    # (shape fields: what the weights mean, so a checkpoint and the run must agree)
    use_rope_scaling: Annotated[bool, SHAPE_RESTORED] = False
    rope_scaling_factor: Annotated[float, SHAPE_RESTORED] = 8.0
    rope_scaling_low_freq_factor: Annotated[float, SHAPE_RESTORED] = 1.0
    rope_scaling_high_freq_factor: Annotated[float, SHAPE_RESTORED] = 4.0
    rope_scaling_original_max_position_embeddings: Annotated[int, SHAPE_RESTORED] = 8192
    normalization: Annotated[str, SHAPE_RESTORED] = "LayerNorm"  # or "RMSNorm"
    layernorm_epsilon: Annotated[float, Field("norm_epsilon", restored=True)] = 1e-5
    swiglu: Annotated[bool, SHAPE_RESTORED] = False
    geglu: Annotated[bool, SHAPE_RESTORED] = False  # the gated MLP's gate through tanh GeLU, not SiLU (Gemma)
    embedding_multiplier: Annotated[float, SHAPE_RESTORED] = 1.0  # the embeddings times it (Gemma: sqrt(hidden))
    # MLP activation relu(x)^2 instead of GeLU (Megatron's --squared-relu)
    squared_relu: Annotated[bool, SHAPE_RESTORED] = False
    add_bias_linear: Annotated[bool, Field(flag=None, shape=True, restored=True)] = True
    # a bias on the QKV projection only (Qwen); implied by add_bias_linear
    add_qkv_bias: Annotated[bool, SHAPE_RESTORED] = False
    hidden_dropout: Annotated[float, RESTORED] = 0.1
    attention_dropout: Annotated[float, RESTORED] = 0.1
    init_method_std: float = 0.02
    embedding_init_method_std: Optional[float] = None  # the embeddings' (and a tied output layer's); None: the above
    untie_embeddings_and_output_weights: Annotated[bool, SHAPE_RESTORED] = False
    # "gpt" or "bert": which model (and HF architecture) the weights are
    model_type: Annotated[str, Field(shape=True)] = "gpt"
    # "pre" (x + f(norm(x))) or "post" (norm(x + f(x)), original BERT)
    layernorm_position: Annotated[str, Field(shape=True)] = "pre"
    # "tanh" (approximation, as GPT-2) or "exact" (erf, as BERT)
    gelu: Annotated[str, Field(flag=None, shape=True)] = "tanh"
    num_tokentypes: Annotated[int, Field(flag=None, shape=True)] = 0  # segment (token-type) embeddings; BERT uses 2
    # BERT: pooler + sentence-order / next-sentence head
    bert_binary_head: Annotated[bool, Field(flag=None, shape=True)] = True
    rotary_percent: Annotated[float, SHAPE_RESTORED] = 1.0  # fraction of each head's dims that rotary embeddings rotate
    # rotate adjacent pairs (2i, 2i+1), not the two halves (GPT-J / Megatron)
    rotary_interleaved: Annotated[bool, SHAPE_RESTORED] = False
    # norm weights stored as (gamma - 1): zero-centred, as Megatron's 1p
    apply_layernorm_1p: Annotated[bool, SHAPE_RESTORED] = False
    qk_layernorm: Annotated[bool, SHAPE_RESTORED] = False  # normalize queries and keys per head before attention
    # sliding-window attention (Megatron's --window-size L,0): a query at i sees keys i - L .. i; None: all before it.
    # --window-attn-skip-freq N: every N-th layer (layer_number % N == 0) attends to everything (Gemma 2, gpt-oss: 2)
    window_size: Annotated[Optional[int], SHAPE_RESTORED] = None
    window_attn_skip_freq: Annotated[Optional[int], SHAPE_RESTORED] = None
    # fp16 attention scores computed / layer_number, multiplied back inside the fp32 softmax (Megatron)
    apply_query_key_layer_scaling: Annotated[bool, RESTORED] = False
    reset_attention_mask: bool = False  # document masks: attention on every pipeline stage needs the batch
    # Mixture of Experts (Megatron's --num-experts, --moe-*; megalite/moe/)
    num_moe_experts: Annotated[Optional[int], Field("num_experts", shape=True, restored=True)] = None
    moe_router_topk: Annotated[int, RESTORED] = 2
    moe_ffn_hidden_size: Annotated[Optional[int], SHAPE_RESTORED] = None  # default: ffn_hidden_size
    moe_layer_freq: Annotated[object, RESTORED] = 1  # every k-th layer is MoE, or a 0/1 list per layer
    moe_router_load_balancing_type: Annotated[str, RESTORED] = "aux_loss"  # aux_loss, seq_aux_loss or none
    moe_aux_loss_coeff: Annotated[float, RESTORED] = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_router_score_function: Annotated[str, RESTORED] = "softmax"  # or sigmoid
    moe_router_pre_softmax: Annotated[bool, RESTORED] = False
    moe_router_topk_scaling_factor: Annotated[Optional[float], RESTORED] = None
    # multi-token prediction depths (DeepSeek-V3), on the last stage
    mtp_num_layers: Annotated[Optional[int], SHAPE_RESTORED] = None
    mtp_loss_scaling_factor: float = 0.1  # λ: the MTP loss, averaged over the depths, times this
    # group-limited routing (DeepSeek-V3): experts in groups,
    moe_router_num_groups: Annotated[Optional[int], RESTORED] = None
    # each token's top-k chosen within its best group-topk groups
    moe_router_group_topk: Annotated[Optional[int], RESTORED] = None
    moe_router_dtype: Optional[str] = None  # fp32 (default) or fp64 routing
    moe_expert_capacity_factor: Optional[float] = None  # None: dropless
    moe_token_drop_policy: str = "probs"  # or position
    moe_pad_expert_input_to_capacity: bool = False
    moe_shared_expert_intermediate_size: Annotated[Optional[int], SHAPE_RESTORED] = None
    moe_shared_expert_gate: Annotated[bool, SHAPE_RESTORED] = False
    moe_router_enable_expert_bias: Annotated[bool, SHAPE_RESTORED] = False  # aux-loss-free balancing (sigmoid scores)
    moe_router_bias_update_rate: float = 1e-3
    # Multi-latent attention (DeepSeek-V2/V3, Megatron's --multi-latent-attention; megalite/transformer/mla.py):
    # Megatron's flag defaults; YaRN's original context and betas are MLATransformerConfig's (no flag reaches them)
    multi_latent_attention: Annotated[bool, SHAPE_RESTORED] = False
    # None: queries straight from the hidden state (linear_q_proj)
    q_lora_rank: Annotated[Optional[int], SHAPE_RESTORED] = None
    kv_lora_rank: Annotated[int, SHAPE_RESTORED] = 32
    qk_head_dim: Annotated[int, SHAPE_RESTORED] = 128
    # the rotated part of each q/k head (k's shared by all heads)
    qk_pos_emb_head_dim: Annotated[int, SHAPE_RESTORED] = 64
    v_head_dim: Annotated[int, SHAPE_RESTORED] = 128
    rope_type: Annotated[Optional[str], RESTORED] = None  # MLA's rotary: "yarn" (its default) or "rope"
    rotary_scaling_factor: Annotated[float, RESTORED] = 1.0
    mscale: Annotated[float, RESTORED] = 1.0
    mscale_all_dim: Annotated[float, RESTORED] = 0.0
    original_max_position_embeddings: Annotated[int, Field(flag=None)] = 4096
    beta_fast: Annotated[float, Field(flag=None)] = 32.0
    beta_slow: Annotated[float, Field(flag=None)] = 1.0
    # DeepSeek sparse attention on MLA (Megatron's --experimental-attention-variant dsa; transformer/dsa.py)
    experimental_attention_variant: Annotated[Optional[str], SHAPE_RESTORED] = None
    dsa_indexer_n_heads: Annotated[Optional[int], SHAPE_RESTORED] = None
    dsa_indexer_head_dim: Annotated[Optional[int], SHAPE_RESTORED] = None
    dsa_indexer_topk: Annotated[Optional[int], RESTORED] = None
    dsa_indexer_topk_freq: int = 1
    dsa_indexer_skip_topk_offset: int = 0
    dsa_indexer_loss_coeff: Optional[float] = None
    dsa_indexer_use_sparse_loss: bool = False
    dsa_indexer_rope_interleaved: bool = False
    dsa_indexer_scoring_relu: bool = True
    dsa_indexer_k_norm_epsilon: Optional[float] = None
    dsa_indexer_k_norm_fp32: bool = False
    # muP (Megatron's --use-mup, --mup-*; formulas in megalite/mup.py); width and output mults are derived
    use_mup: bool = False
    mup_base_hidden_size: Optional[int] = None  # default: hidden_size (width multiplier 1)
    mup_width_mult: float = 1.0  # hidden_size / mup_base_hidden_size
    mup_embedding_mult: float = 1.0
    mup_output_mult: float = 1.0  # left at 1 with a width multiplier m != 1: 1/m
    mup_base_head_dim: Optional[float] = None
    mup_attn_scale_power: float = 1.0

    def is_moe_layer(self, layer_number):
        """Whether the layer (global, 1-based) is an MoE layer."""
        if not self.num_moe_experts:
            return False
        f = self.moe_layer_freq
        layer_number = min(layer_number, self.num_layers)  # an MTP layer is built as the decoder's last
        return bool(f[layer_number - 1]) if isinstance(f, (list, tuple)) else (layer_number - 1) % f == 0

    @property
    def embedding_std(self):
        """The word, position and token-type embeddings' init std (Megatron's --embedding-init-method-std)."""
        return self.init_method_std if self.embedding_init_method_std is None else self.embedding_init_method_std

    def __post_init__(self):
        h, a = self.hidden_size, self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = a
        if self.kv_channels is None:
            if h % a:
                raise ConfigError(f"--hidden-size {h} is not divisible by --num-attention-heads {a}; "
                                  "pick sizes with hidden = heads x head dim")
            self.kv_channels = h // a
        if self.geglu and not self.swiglu:
            raise ConfigError("--geglu is a gated MLP: it takes --swiglu's [gate | up] shape (the command line sets "
                              "it)")
        if self.ffn_hidden_size is None:
            # Megatron's SwiGLU size: 2/3 of 4h, rounded *down* to a multiple of 64
            self.ffn_hidden_size = 4 * h if not self.swiglu else int(8 * h / 3 / 64) * 64
        if self.num_moe_experts and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.squared_relu and self.swiglu:
            raise ConfigError("--squared-relu and --swiglu are exclusive (as Megatron); pick one activation")
        if self.ffn_hidden_size < 1:
            raise ConfigError(f"the FFN size of --hidden-size {h} rounds to {self.ffn_hidden_size}; "
                              "pass --ffn-hidden-size")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if a % self.num_query_groups:
            raise ConfigError(f"--num-attention-heads {a} is not divisible by --num-query-groups "
                              f"{self.num_query_groups}")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ConfigError(f"--position-embedding-type {self.position_embedding_type!r} is not one of "
                              "learned_absolute, rope")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ConfigError(f"--normalization {self.normalization!r} is not one of LayerNorm, RMSNorm")
        for field, allowed in (("model_type", ("gpt", "bert")), ("layernorm_position", ("pre", "post")),
                               ("gelu", ("tanh", "exact"))):
            if getattr(self, field) not in allowed:
                raise ConfigError(f"{field} {getattr(self, field)!r} is not one of {', '.join(allowed)}")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ConfigError(f"--recompute-granularity {self.recompute_granularity!r} is not one of full, selective")
        if self.recompute_granularity == "full":
            self.recompute_method = self.recompute_method or "uniform"
            self.recompute_num_layers = self.recompute_num_layers or 1
            if self.recompute_method not in ("uniform", "block") or self.recompute_num_layers < 1:
                raise ConfigError(f"--recompute-method {self.recompute_method!r} / --recompute-num-layers "
                                  f"{self.recompute_num_layers}: need uniform or block and a positive count")
        if self.position_embedding_type == "learned_absolute" and self.seq_length > self.max_position_embeddings:
            raise ConfigError(f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                              f"{self.max_position_embeddings}")
        if self.multi_latent_attention or self.rope_type is not None:
            self._check_mla()
        if self.experimental_attention_variant is not None:
            self._check_dsa()
        if self.position_embedding_type == "rope" and not self.multi_latent_attention:
            rot = int(self.kv_channels * self.rotary_percent)
            if not 0 < self.rotary_percent <= 1 or rot < 2 or rot % 2:
                raise ConfigError(f"--rotary-percent {self.rotary_percent} of head dim {self.kv_channels} gives a "
                                  f"rotary dim of {rot}: it needs 0 < p <= 1 and an even rotary dim")
        if self.use_rope_scaling:
            self._check_rope_scaling()
        if self.use_mup:
            finalize_mup(self)

    def _check_rope_scaling(self):
        if self.position_embedding_type != "rope" or self.multi_latent_attention:
            raise ConfigError("--use-rope-scaling (Llama 3.1's) scales rotary embeddings: it needs "
                              "--position-embedding-type rope without --multi-latent-attention (MLA has YaRN)")
        low, high = self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor
        if self.rope_scaling_factor < 1 or not 0 < low < high or self.rope_scaling_original_max_position_embeddings < 1:
            raise ConfigError(f"--use-rope-scaling needs --rope-scaling-factor >= 1 (got {self.rope_scaling_factor}), "
                              f"0 < low < high frequency factor (got {low}, {high}) and an original context >= 1")

    def _check_mla(self):
        """Megatron's MLA checks, and what megalite's MLA does not do, one line each."""
        if not self.multi_latent_attention:
            if self.rope_type not in (None, "rope"):
                raise ConfigError(f"--rope-type {self.rope_type}: standard attention takes rope only (as Megatron); "
                                  "yarn is for --multi-latent-attention")
            return
        self.rope_type = self.rope_type or "yarn"  # Megatron's MLA default
        rot = self.qk_pos_emb_head_dim if self.rope_type == "yarn" else \
            int(self.qk_pos_emb_head_dim * self.rotary_percent)
        dims = dict(q_lora_rank=self.q_lora_rank if self.q_lora_rank is not None else 1, kv_lora_rank=self.kv_lora_rank,
                    qk_head_dim=self.qk_head_dim, v_head_dim=self.v_head_dim)
        for cond, msg in (
                (self.num_query_groups != self.num_attention_heads,
                 "--multi-latent-attention and --group-query-attention are exclusive (as Megatron)"),
                (min(dims.values()) < 1, "MLA sizes must be >= 1: " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                                              for k, v in dims.items() if v < 1)),
                (self.rope_type not in ("rope", "yarn"), f"--rope-type {self.rope_type!r} is not one of rope, yarn"),
                (rot < 2 or rot % 2 or not 0 < self.rotary_percent <= 1,
                 f"--qk-pos-emb-head-dim {self.qk_pos_emb_head_dim} (x --rotary-percent {self.rotary_percent} with "
                 f"rope) gives a rotary dim of {rot}: it must be even and >= 2"),
                (self.rotary_scaling_factor <= 0, f"--rotary-scaling-factor {self.rotary_scaling_factor} must be > 0"),
                (self.rotary_interleaved, "--rotary-interleaved does not work with --multi-latent-attention (as "
                                          "Megatron: MLA always rotates pairs of its pos-emb dims)"),
                (self.qk_layernorm and self.q_lora_rank is None,
                 "--qk-layernorm with --multi-latent-attention needs --q-lora-rank (the norm is on the query latent)"),
                (self.add_qkv_bias,
                 "--add-qkv-bias: multi-latent attention's projections have no biases (as Megatron)"),
                (self.model_type != "gpt", "--multi-latent-attention is implemented for GPT models only")):
            if cond:
                raise ConfigError(msg)

    def _check_dsa(self):
        """--experimental-attention-variant dsa: Megatron's checks, and what megalite's DSA does not do."""
        v, sizes = self.experimental_attention_variant, ("n_heads", "head_dim", "topk")
        missing = [f"--dsa-indexer-{k.replace('_', '-')}" for k in sizes
                   if (getattr(self, "dsa_indexer_" + k) or 0) < 1]
        for cond, msg in (
                (v != "dsa", f"--experimental-attention-variant {v} is not implemented in megalite (dsa is)"),
                (not self.multi_latent_attention, "--experimental-attention-variant dsa needs --multi-latent-attention "
                                                  "(as Megatron: only MLA has sparse attention)"),
                (bool(missing), f"--experimental-attention-variant dsa needs {', '.join(missing)} >= 1"),
                (self.add_bias_linear,
                 "--experimental-attention-variant dsa needs --disable-bias-linear (as Megatron)"),
                (self.cp_comm_type is not None,
                 "--experimental-attention-variant dsa with --context-parallel-size > 1 is not built in megalite "
                 "(its indexer scores every key of a sequence)"),
                (self.dsa_indexer_topk_freq != 1, f"--dsa-indexer-topk-freq {self.dsa_indexer_topk_freq}: sharing "
                                                  "top-k indices across layers is not implemented in megalite (use 1)"),
                (self.dsa_indexer_skip_topk_offset < 0,
                 f"--dsa-indexer-skip-topk-offset {self.dsa_indexer_skip_topk_offset} must be non-negative"),
                (self.dsa_indexer_head_dim is not None and self.dsa_indexer_head_dim < self.qk_pos_emb_head_dim,
                 f"--dsa-indexer-head-dim {self.dsa_indexer_head_dim} must be >= --qk-pos-emb-head-dim "
                 f"{self.qk_pos_emb_head_dim} (the indexer's rotary part)")):
            if cond:
                raise ConfigError(msg)

    def check_parallel(self, tp):
        """Checks that depend on the tensor-parallel size."""
        if self.num_attention_heads % tp:
            raise ConfigError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                              f"--tensor-model-parallel-size {tp}")
        if self.num_query_groups % tp:
            raise ConfigError(f"--num-query-groups {self.num_query_groups} is not divisible by "
                              f"--tensor-model-parallel-size {tp}")
        if self.ffn_hidden_size % tp:
            raise ConfigError(f"--ffn-hidden-size {self.ffn_hidden_size} is not divisible by "
                              f"--tensor-model-parallel-size {tp}")
        if self.sequence_parallel and tp > 1 and self.seq_length % tp:
            raise ConfigError(f"--sequence-parallel needs --seq-length {self.seq_length} divisible by "
                              f"--tensor-model-parallel-size {tp}")


def model_fields():
    """{field name: its Field} of ModelConfig, in declaration order (un-annotated fields: PLAIN)."""
    hints = typing.get_type_hints(ModelConfig, include_extras=True)
    return {f.name: next((m for m in getattr(hints[f.name], "__metadata__", ()) if isinstance(m, Field)), PLAIN)
            for f in dataclasses.fields(ModelConfig)}


SHAPE_FIELDS = tuple(n for n, f in model_fields().items() if f.shape)
LAYOUT_FIELDS = {f.name: f.default for f in dataclasses.fields(ModelConfig) if model_fields()[f.name].layout}
# command-line dest -> the field a checkpoint records (add_bias_linear: --disable-bias-linear, negated)
CHECKPOINT_ARGS = {("disable_bias_linear" if n == "add_bias_linear" else f.flag or n): n
                   for n, f in model_fields().items() if f.restored}
FLAG_FIELDS = {n: f.flag or n for n, f in model_fields().items() if f.flag is not None}  # field -> its dest
