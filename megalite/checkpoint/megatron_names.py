"""Megatron-Core's sharded-state-dict names <-> megalite's checkpoint names, for GPT models (beside the HF tables).

Megatron-Core stacks a decoder's layers under one key with a leading layer axis (`decoder.layers.<suffix>`,
[num_layers, ...]) and files the norms under the linear layer they are fused into with Transformer Engine
(`self_attention.linear_qkv.layer_norm_weight` is megalite's `input_layernorm.weight`, `mlp.linear_fc1.
layer_norm_weight` its `pre_mlp_layernorm.weight`); older or heterogeneous checkpoints keep per-layer keys
(`decoder.layers.<i>.<suffix>`) and the local spec's own norm names; both are read. SwiGLU's fc1 is [gate; up]
there and [2, ffn, h] in megalite; the fused QKV has the same per-query-group rows [q heads | k | v] in both;
the vocabulary is padded there (megalite keeps the real rows)."""

# megalite's suffix of a layer's tensor -> Megatron's suffixes for it, in the order tried
LAYER = (
    ("input_layernorm.weight", ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")),
    ("input_layernorm.bias", ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias")),
    ("self_attention.linear_qkv.weight", ("self_attention.linear_qkv.weight",)),
    ("self_attention.linear_qkv.bias", ("self_attention.linear_qkv.bias",)),
    ("self_attention.q_layernorm.weight", ("self_attention.q_layernorm.weight",)),
    ("self_attention.q_layernorm.bias", ("self_attention.q_layernorm.bias",)),
    ("self_attention.k_layernorm.weight", ("self_attention.k_layernorm.weight",)),
    ("self_attention.k_layernorm.bias", ("self_attention.k_layernorm.bias",)),
    ("self_attention.linear_proj.weight", ("self_attention.linear_proj.weight",)),
    ("self_attention.linear_proj.bias", ("self_attention.linear_proj.bias",)),
    ("pre_mlp_layernorm.weight", ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")),
    ("pre_mlp_layernorm.bias", ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias")),
    ("mlp.linear_fc1.weight", ("mlp.linear_fc1.weight",)),
    ("mlp.linear_fc1.bias", ("mlp.linear_fc1.bias",)),
    ("mlp.linear_fc2.weight", ("mlp.linear_fc2.weight",)),
    ("mlp.linear_fc2.bias", ("mlp.linear_fc2.bias",)),
)
# MLA's attention (--multi-latent-attention), in place of the fused QKV: Transformer Engine's spec folds each
# latent's norm into its up-projection (`linear_q_up_proj.layer_norm_weight`); the local spec keeps the norms'
# own names and, unlike its dense layers, maps no norm to a fused name (pre_mlp_layernorm stays itself)
MLA = (
    ("self_attention.linear_q_proj.weight", ("self_attention.linear_q_proj.weight",)),
    ("self_attention.linear_q_down_proj.weight", ("self_attention.linear_q_down_proj.weight",)),
    ("self_attention.linear_q_up_proj.weight", ("self_attention.linear_q_up_proj.weight",)),
    ("self_attention.q_layernorm.weight", ("self_attention.linear_q_up_proj.layer_norm_weight",
                                           "self_attention.q_layernorm.weight")),
    ("self_attention.q_layernorm.bias", ("self_attention.linear_q_up_proj.layer_norm_bias",
                                         "self_attention.q_layernorm.bias")),
    ("self_attention.linear_kv_down_proj.weight", ("self_attention.linear_kv_down_proj.weight",)),
    ("self_attention.linear_kv_up_proj.weight", ("self_attention.linear_kv_up_proj.weight",)),
    ("self_attention.kv_layernorm.weight", ("self_attention.linear_kv_up_proj.layer_norm_weight",
                                            "self_attention.kv_layernorm.weight")),
    ("self_attention.kv_layernorm.bias", ("self_attention.linear_kv_up_proj.layer_norm_bias",
                                          "self_attention.kv_layernorm.bias")),
)


def layer_suffixes(cfg):
    """(megalite's suffix, Megatron's suffixes in the order tried) of every tensor megalite's GPT layer has for
    the model config `cfg` (a checkpoint's model_config dict)."""
    layer_norm = cfg["normalization"] == "LayerNorm"
    bias = cfg["add_bias_linear"]
    mla = cfg.get("multi_latent_attention")
    have = {"input_layernorm.weight", "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}
    if layer_norm:
        have |= {"input_layernorm.bias", "pre_mlp_layernorm.bias"}
    if bias:
        have |= {"self_attention.linear_proj.bias", "mlp.linear_fc1.bias", "mlp.linear_fc2.bias"}
    if mla:
        q = ["linear_q_proj"] if cfg.get("q_lora_rank") is None else ["linear_q_down_proj", "linear_q_up_proj"]
        have |= {f"self_attention.{m}.weight" for m in q + ["linear_kv_down_proj", "linear_kv_up_proj"]}
        norms = (["q_layernorm"] if cfg.get("q_lora_rank") is not None else []) + ["kv_layernorm"]
    else:
        have.add("self_attention.linear_qkv.weight")
        if bias or cfg.get("add_qkv_bias"):
            have.add("self_attention.linear_qkv.bias")
        norms = ["q_layernorm", "k_layernorm"]
    if cfg.get("qk_layernorm"):
        have |= {f"self_attention.{n}.{w}" for n in norms for w in (("weight", "bias") if layer_norm else ("weight",))}
    table = LAYER[:2] + (MLA if mla else LAYER[2:8]) + LAYER[8:]  # (MLA's projections where the QKV is)
    return [(mine, theirs) for mine, theirs in table if mine in have]


def _fc1(cfg):
    """SwiGLU: [gate; up] -> [2, ffn, ...]."""
    if not cfg["swiglu"]:
        return lambda t: t
    return lambda t: t.reshape(2, cfg["ffn_hidden_size"], *t.shape[1:])


# an MoE layer's MLP: megalite's suffix -> Megatron's (its experts stacked on an expert axis after the layer axis:
# `mlp.experts.experts.linear_fc1.weight` [L, E, ...], whatever the expert implementation)
MOE = (("mlp.router.weight", "mlp.router.weight"), ("mlp.router.expert_bias", "mlp.router.expert_bias"),
       ("mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"),
       ("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.linear_fc2.weight"),
       ("mlp.shared_experts.gate_weight", "mlp.shared_experts.gate_weight"))
EXPERT = (("linear_fc1.weight", "mlp.experts.experts.linear_fc1.weight"),
          ("linear_fc2.weight", "mlp.experts.experts.linear_fc2.weight"))


def moe_layers(cfg):
    """[bool per layer]: which layers are MoE (--moe-layer-freq; none in a dense model)."""
    from megalite.checkpoint.hf_moe import moe_layers as of_moe_model
    return of_moe_model(cfg) if cfg.get("num_moe_experts") else [False] * cfg["num_layers"]


def _moe_suffixes(cfg):
    have = {"mlp.router.weight"}
    if cfg.get("moe_router_enable_expert_bias"):
        have.add("mlp.router.expert_bias")
    if cfg.get("moe_shared_expert_intermediate_size"):
        have |= {"mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"}
        if cfg.get("moe_shared_expert_gate"):
            have.add("mlp.shared_experts.gate_weight")
    return [(mine, theirs) for mine, theirs in MOE if mine in have]


def _find(has, theirs, i):
    """(key, index prefix) of layer i's tensor: a stacked key (the layer's index first) or a per-layer one."""
    for s in theirs:
        if has(f"decoder.layers.{s}"):
            return f"decoder.layers.{s}", (i,)
        if has(f"decoder.layers.{i}.{s}"):
            return f"decoder.layers.{i}.{s}", ()
    from megalite.checkpoint.storage import CheckpointError
    raise CheckpointError(f"the Megatron checkpoint has no decoder.layers.{theirs[0]} (nor decoder.layers.{i}."
                          f"{theirs[0]}), which megalite's layer {i} needs")


def _moe_rows(cfg, has, i):
    """Layer i's MoE MLP: router (and expert bias), shared experts, each expert's fc1 / fc2 (SwiGLU's [gate; up]
    as megalite's [2, ffn, h])."""
    rows = []
    for mine, theirs in _moe_suffixes(cfg):
        key, at = _find(has, (theirs,), i)
        fn = _fc1(dict(cfg, ffn_hidden_size=cfg["moe_shared_expert_intermediate_size"])) \
            if mine.endswith("shared_experts.linear_fc1.weight") else (lambda t: t)
        rows.append((f"decoder.layers.{i}.{mine}", key, at or None, fn))
    for mine, theirs in EXPERT:
        key, at = _find(has, (theirs,), i)
        fn = _fc1(dict(cfg, ffn_hidden_size=cfg["moe_ffn_hidden_size"])) if mine.startswith("linear_fc1.") \
            else (lambda t: t)
        rows += [(f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{mine}", key, at + (e,), fn)
                 for e in range(cfg["num_moe_experts"])]
    return rows


def gpt_rows(cfg, has):
    """(megalite name, Megatron key, index into it (a stacked key's layer, an expert) or None, Megatron tensor ->
    megalite's) for every weight of a megalite GPT of config `cfg`; has(key): whether the checkpoint holds that
    tensor."""
    vocab = cfg["vocab_size"]

    def rows_of_vocab(t):
        return t[:vocab]
    same = (lambda t: t)
    rows = [("embedding.word_embeddings.weight", "embedding.word_embeddings.weight", None, rows_of_vocab)]
    if cfg["position_embedding_type"] == "learned_absolute":
        rows.append(("embedding.position_embeddings.weight", "embedding.position_embeddings.weight", None, same))
    moe = moe_layers(cfg)
    for i in range(cfg["num_layers"]):
        for mine, theirs in layer_suffixes(cfg):
            if moe[i] and mine.startswith("mlp."):
                continue  # (an MoE layer's MLP: _moe_rows)
            fn = _fc1(cfg) if mine.startswith("mlp.linear_fc1.") else same
            stacked = [f"decoder.layers.{s}" for s in theirs if has(f"decoder.layers.{s}")]
            single = [f"decoder.layers.{i}.{s}" for s in theirs if has(f"decoder.layers.{i}.{s}")]
            if stacked:
                rows.append((f"decoder.layers.{i}.{mine}", stacked[0], i, fn))
            elif single:
                rows.append((f"decoder.layers.{i}.{mine}", single[0], None, fn))
            else:
                from megalite.checkpoint.storage import CheckpointError
                raise CheckpointError(f"the Megatron checkpoint has no decoder.layers.{theirs[0]} (nor "
                                      f"decoder.layers.{i}.{theirs[0]}), which megalite's layer {i}.{mine} needs")
        if moe[i]:
            rows += _moe_rows(cfg, has, i)
    rows.append(("decoder.final_layernorm.weight", "decoder.final_layernorm.weight", None, same))
    if cfg["normalization"] == "LayerNorm":
        rows.append(("decoder.final_layernorm.bias", "decoder.final_layernorm.bias", None, same))
    if cfg["untie_embeddings_and_output_weights"]:
        rows.append(("output_layer.weight", "output_layer.weight", None, rows_of_vocab))
    return rows


def unsupported(args):
    """Why megalite cannot read this Megatron model yet (one line), or None."""
    if getattr(args, "mtp_num_layers", None):
        return "multi-token prediction layers (--mtp-num-layers) are not read from Megatron's format yet"
    if "bert" in str(getattr(args, "model_type", "")).lower():
        return "BERT checkpoints are not read from Megatron's format yet"
    return None
