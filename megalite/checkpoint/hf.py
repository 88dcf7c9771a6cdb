"""Hugging Face `transformers` <-> megalite: one table per architecture, used both ways.

Each table maps global megalite tensors (checkpoint names, real vocabulary, SwiGLU fc1 as
[2, ffn, h]) to HF tensors, tensor by tensor, so the converter streams. The one layout
difference that needs care is QKV: megalite keeps rows per query group
[q heads of group g | k_g | v_g] (a TP shard then holds whole groups); HF keeps separate
q/k/v (Llama, BERT) or [Q | K | V] in a transposed Conv1D (GPT-2).
"""

import torch

from megalite.checkpoint.hf_window import check_window, window_fields
from megalite.checkpoint.storage import CheckpointError


def qkv_split(w, heads, groups, d):
    """megalite's per-group QKV rows -> (q, k, v) blocks (rows in head order)."""
    rest = w.shape[1:]
    x = w.reshape(groups, heads // groups + 2, d, *rest)
    return (x[:, :-2].reshape(heads * d, *rest), x[:, -2].reshape(groups * d, *rest),
            x[:, -1].reshape(groups * d, *rest))


def qkv_join(q, k, v, heads, groups, d):
    rest = q.shape[1:]
    x = torch.cat([q.reshape(groups, heads // groups, d, *rest), k.reshape(groups, 1, d, *rest),
                   v.reshape(groups, 1, d, *rest)], dim=1)
    return x.reshape((heads + 2 * groups) * d, *rest)


EXPORT_ONLY = "export only"  # a table row's from_hf: a copy the HF layout repeats (the import reads the first)


def _plain(cfg, arch, fields=("qk_layernorm", "apply_layernorm_1p", "rotary_percent", "rotary_interleaved",
                              "squared_relu", "add_qkv_bias")):
    """Megatron-only variations no HF class of ours represents (absent in older checkpoints), and a sliding window
    where `arch` has none."""
    check_window(cfg, arch)
    if cfg.get("num_moe_experts"):
        raise CheckpointError(f"{arch} cannot represent a Mixture of Experts model ({cfg['num_moe_experts']} experts)")
    defaults = {"qk_layernorm": False, "apply_layernorm_1p": False, "rotary_percent": 1.0, "rotary_interleaved": False,
                "squared_relu": False, "add_qkv_bias": False}
    for field in fields:
        if cfg.get(field, defaults[field]) != defaults[field]:
            hint = " (Phi3ForCausalLM can: --hf-architecture)" if field == "rotary_percent" and \
                arch == "LlamaForCausalLM" else ""
            raise CheckpointError(f"{arch} cannot represent {field}={cfg[field]!r}{hint}; convert a model trained "
                                  f"without --{field.replace('_', '-')}")


def _gamma_rows(table):
    """--apply-layernorm-1p stores gamma - 1 in the norm weights (every norm built by build_norm);
    HF stores gamma: +1 on export, -1 on import."""
    def rows(c):
        out = table(c)
        if not c.get("apply_layernorm_1p"):
            return out
        return [(h, m, (lambda x: x + 1), (lambda x: x - 1)) if m.endswith("layernorm.weight") else (h, m, t, f)
                for h, m, t, f in out]
    return rows


def _need(cfg, arch, **want):
    for field, value in want.items():
        if cfg.get(field) != value:
            raise CheckpointError(f"{arch} cannot represent {field}={cfg.get(field)!r} (it needs {value!r})")


def attention_rows(c, m, h):
    """A Llama-family layer's norms and attention (q/k/v split from megalite's per-group QKV;
    --add-qkv-bias: their biases; --qk-layernorm: q_norm / k_norm). m, h: the layer's prefixes."""
    a, g, d = c["num_attention_heads"], c["num_query_groups"], c["kv_channels"]
    ident = (lambda x: x)
    rows = [(h + "input_layernorm.weight", m + "input_layernorm.weight", ident, ident)]
    for kind in ("weight", "bias") if c.get("add_qkv_bias") else ("weight",):
        qkv, q, k, v = (m + f"self_attention.linear_qkv.{kind}",
                        *(h + f"self_attn.{x}_proj.{kind}" for x in "qkv"))
        rows += [(q, qkv, lambda w: qkv_split(w, a, g, d)[0], None),
                 (k, qkv, lambda w: qkv_split(w, a, g, d)[1], None),
                 # the last of the three rebuilds megalite's tensor from all of them
                 (v, qkv, lambda w: qkv_split(w, a, g, d)[2], ("join", (q, k), lambda q_, k_, v_: qkv_join(
                     q_, k_, v_, a, g, d)))]
    rows.append((h + "self_attn.o_proj.weight", m + "self_attention.linear_proj.weight", ident, ident))
    if c.get("qk_layernorm"):
        rows += [(h + "self_attn.q_norm.weight", m + "self_attention.q_layernorm.weight", ident, ident),
                 (h + "self_attn.k_norm.weight", m + "self_attention.k_layernorm.weight", ident, ident)]
    rows.append((h + "post_attention_layernorm.weight", m + "pre_mlp_layernorm.weight", ident, ident))
    return rows


def swiglu_rows(m, gate, up, down):
    """A SwiGLU MLP: megalite's fc1 [2, ffn, h] is HF's (gate, up); fc2 is down. m: its prefix."""
    ident = (lambda x: x)
    return [(gate, m + "linear_fc1.weight", lambda w: w[0], None),
            (up, m + "linear_fc1.weight", lambda w: w[1], ("join", (gate,), lambda g_, u_: torch.stack([g_, u_]))),
            (down, m + "linear_fc2.weight", ident, ident)]


def llama_hf_config(c, arch, model_type):
    """The config keys every Llama-family class (Llama, Mixtral, Qwen-MoE) shares."""
    theta = c["rotary_base"]
    rope = {"rope_type": "default", "rope_theta": theta}
    if c.get("use_rope_scaling"):
        rope = dict(rope, rope_type="llama3", **{hf: c[ours] for hf, ours in LLAMA3_ROPE.items()})
    return {"architectures": [arch], "model_type": model_type, "vocab_size": c["vocab_size"],
            "hidden_size": c["hidden_size"], "num_hidden_layers": c["num_layers"],
            "num_attention_heads": c["num_attention_heads"], "num_key_value_heads": c["num_query_groups"],
            "head_dim": c["kv_channels"], "max_position_embeddings": c["max_position_embeddings"],
            "rms_norm_eps": c["layernorm_epsilon"], "rope_theta": theta, "rope_parameters": rope,
            "hidden_act": "silu", "tie_word_embeddings": not c["untie_embeddings_and_output_weights"],
            "torch_dtype": c["params_dtype"]}


# HF's rope_type "llama3" parameters -> megalite's --use-rope-scaling fields
LLAMA3_ROPE = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_scaling_low_freq_factor",
               "high_freq_factor": "rope_scaling_high_freq_factor",
               "original_max_position_embeddings": "rope_scaling_original_max_position_embeddings"}


def _rope_fields(h):
    """The megalite rope fields of a Llama-family HF config: its base, and Llama 3.1's scaling (rope_type llama3)."""
    rope = h.get("rope_parameters") or h.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = {"rotary_base": float(rope.get("rope_theta", h.get("rope_theta", 10000.0)))}
    if kind == "llama3":
        missing = [k for k in LLAMA3_ROPE if k not in rope]
        if missing:
            raise CheckpointError(f"{h.get('model_type', 'llama')} rope scaling 'llama3' without {', '.join(missing)}")
        return dict(out, use_rope_scaling=True, **{ours: rope[hf] for hf, ours in LLAMA3_ROPE.items()})
    if kind != "default":
        raise CheckpointError(f"{h.get('model_type', 'llama')} rope scaling {kind!r} is not implemented in megalite "
                              "(it has Llama 3.1's, rope_type 'llama3')")
    return out


def llama_model_config(h):
    """The megalite fields of a Llama-family HF config (rope, RMSNorm, SwiGLU, GQA, no biases)."""
    rope, window = _rope_fields(h), window_fields(h)
    heads = h["num_attention_heads"]
    return {"num_layers": h["num_hidden_layers"], "hidden_size": h["hidden_size"], "num_attention_heads": heads,
            "num_query_groups": h.get("num_key_value_heads") or heads,
            "kv_channels": h.get("head_dim") or h["hidden_size"] // heads, "vocab_size": h["vocab_size"],
            "max_position_embeddings": h["max_position_embeddings"], "seq_length": h["max_position_embeddings"],
            "position_embedding_type": "rope", **rope, "normalization": "RMSNorm",
            "layernorm_epsilon": h.get("rms_norm_eps", 1e-6), "swiglu": True, "add_bias_linear": False,
            "untie_embeddings_and_output_weights": not h.get("tie_word_embeddings", False), **window}


class GPT2:
    """GPT2LMHeadModel: learned positions, LayerNorm, tanh GeLU, biases, tied or untied embeddings."""
    hf_class = "GPT2LMHeadModel"

    @staticmethod
    def check(c):
        _plain(c, "GPT2LMHeadModel", ("qk_layernorm", "rotary_percent", "squared_relu"))
        if c.get("layernorm_position", "pre") != "pre" or c.get("gelu", "tanh") != "tanh":
            raise CheckpointError("GPT2LMHeadModel cannot represent a post-norm model or exact GeLU")
        _need(c, "GPT2LMHeadModel", position_embedding_type="learned_absolute", normalization="LayerNorm",
              swiglu=False, add_bias_linear=True, num_query_groups=c["num_attention_heads"],
              kv_channels=c["hidden_size"] // c["num_attention_heads"])

    @staticmethod
    def hf_config(c):
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c["vocab_size"],
                "n_positions": c["max_position_embeddings"], "n_embd": c["hidden_size"], "n_layer": c["num_layers"],
                "n_head": c["num_attention_heads"], "n_inner": c["ffn_hidden_size"],
                "activation_function": "gelu_new", "layer_norm_epsilon": c["layernorm_epsilon"],
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "tie_word_embeddings": not c["untie_embeddings_and_output_weights"],
                "bos_token_id": None, "eos_token_id": None,  # GPT-2's 50256 is not in every vocabulary
                "torch_dtype": c["params_dtype"]}

    @staticmethod
    def model_config(h):
        n = h["n_embd"]
        return {"num_layers": h["n_layer"], "hidden_size": n, "num_attention_heads": h["n_head"],
                "num_query_groups": h["n_head"], "kv_channels": n // h["n_head"],
                "ffn_hidden_size": h.get("n_inner") or 4 * n, "vocab_size": h["vocab_size"],
                "max_position_embeddings": h["n_positions"], "seq_length": h["n_positions"],
                "position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
                "layernorm_epsilon": h.get("layer_norm_epsilon", 1e-5), "swiglu": False, "add_bias_linear": True,
                "untie_embeddings_and_output_weights": not h.get("tie_word_embeddings", True)}

    @staticmethod
    def check_hf(h):
        if h.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise CheckpointError(f"GPT-2 activation_function={h['activation_function']!r}: megalite's GeLU is "
                                  "the tanh approximation (gelu_new)")
        for f in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
            if h.get(f):
                raise CheckpointError(f"GPT-2 {f}=True has no megalite equivalent")
        if not h.get("scale_attn_weights", True):
            raise CheckpointError("GPT-2 scale_attn_weights=False (attention scores not divided by the square root "
                                  "of the head size) has no megalite equivalent")

    @staticmethod
    def inert(h):
        """n_ctx: older files' copy of n_positions; summary_*: GPT2DoubleHeadsModel's classifier, not built by
        GPT2LMHeadModel."""
        return {"n_ctx", "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels"}

    @staticmethod
    @_gamma_rows
    def table(c):
        """[(hf name, megalite names, to_hf(*tensors), from_hf(tensor) -> tensors)]."""
        a, d = c["num_attention_heads"], c["hidden_size"] // c["num_attention_heads"]
        ident, t = (lambda x: x), (lambda x: x.t().contiguous())

        def qkv_to(w):
            return torch.cat(qkv_split(w, a, a, d), dim=0)

        def qkv_from(w):
            return qkv_join(*w.chunk(3, dim=0), a, a, d)

        rows = [("transformer.wte.weight", "embedding.word_embeddings.weight", ident, ident),
                ("transformer.wpe.weight", "embedding.position_embeddings.weight", ident, ident)]
        for i in range(c["num_layers"]):
            m, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
            rows += [(h + "ln_1.weight", m + "input_layernorm.weight", ident, ident),
                     (h + "ln_1.bias", m + "input_layernorm.bias", ident, ident),
                     (h + "attn.c_attn.weight", m + "self_attention.linear_qkv.weight",
                      lambda w: qkv_to(w).t().contiguous(), lambda w: qkv_from(w.t().contiguous())),
                     (h + "attn.c_attn.bias", m + "self_attention.linear_qkv.bias", qkv_to, qkv_from),
                     (h + "attn.c_proj.weight", m + "self_attention.linear_proj.weight", t, t),
                     (h + "attn.c_proj.bias", m + "self_attention.linear_proj.bias", ident, ident),
                     (h + "ln_2.weight", m + "pre_mlp_layernorm.weight", ident, ident),
                     (h + "ln_2.bias", m + "pre_mlp_layernorm.bias", ident, ident),
                     (h + "mlp.c_fc.weight", m + "mlp.linear_fc1.weight", t, t),
                     (h + "mlp.c_fc.bias", m + "mlp.linear_fc1.bias", ident, ident),
                     (h + "mlp.c_proj.weight", m + "mlp.linear_fc2.weight", t, t),
                     (h + "mlp.c_proj.bias", m + "mlp.linear_fc2.bias", ident, ident)]
        rows += [("transformer.ln_f.weight", "decoder.final_layernorm.weight", ident, ident),
                 ("transformer.ln_f.bias", "decoder.final_layernorm.bias", ident, ident)]
        if c["untie_embeddings_and_output_weights"]:
            rows.append(("lm_head.weight", "output_layer.weight", ident, ident))
        return rows


def llama_rows(c):
    """A Llama-layout model's tensors (norm weights as megalite holds them: Llama's table adds --apply-layernorm-1p's
    one back, Gemma's stores them so)."""
    ident = (lambda x: x)
    rows = [("model.embed_tokens.weight", "embedding.word_embeddings.weight", ident, ident)]
    for i in range(c["num_layers"]):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        rows += attention_rows(c, m, h)
        rows += swiglu_rows(m + "mlp.", h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight",
                            h + "mlp.down_proj.weight")
    rows.append(("model.norm.weight", "decoder.final_layernorm.weight", ident, ident))
    if c["untie_embeddings_and_output_weights"]:
        rows.append(("lm_head.weight", "output_layer.weight", ident, ident))
    return rows


class Llama:
    """LlamaForCausalLM: rope, RMSNorm, SwiGLU, GQA, no biases, tied or untied."""
    hf_class = "LlamaForCausalLM"

    @staticmethod
    def check(c):
        _plain(c, "LlamaForCausalLM", ("qk_layernorm", "rotary_percent", "rotary_interleaved", "squared_relu",
                                       "add_qkv_bias"))
        if c.get("layernorm_position", "pre") != "pre":
            raise CheckpointError("LlamaForCausalLM cannot represent a post-norm model")
        _need(c, "LlamaForCausalLM", position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
              add_bias_linear=False)

    @staticmethod
    def hf_config(c):
        return dict(llama_hf_config(c, "LlamaForCausalLM", "llama"), intermediate_size=c["ffn_hidden_size"],
                    attention_bias=False, mlp_bias=False)

    @staticmethod
    def model_config(h):
        return dict(llama_model_config(h), ffn_hidden_size=h["intermediate_size"])

    @staticmethod
    def check_hf(h):
        if h.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"Llama hidden_act={h['hidden_act']!r}: megalite's SwiGLU uses silu")
        for f in ("attention_bias", "mlp_bias"):
            if h.get(f):
                raise CheckpointError(f"Llama {f}=True has no megalite equivalent (megalite's Llama has no biases)")

    table = staticmethod(_gamma_rows(lambda c: llama_rows(c)))


class Bert:
    """BertForPreTraining: post-norm encoder, learned positions, token types, MLM head tied to the
    word embeddings with its own bias, pooler + next-sentence (here: sentence-order) head."""
    hf_class = "BertForPreTraining"
    ACTS = {"gelu": "exact", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}

    @staticmethod
    def check(c):
        _plain(c, "BertForPreTraining")
        a = c["num_attention_heads"]
        _need(c, "BertForPreTraining", layernorm_position="post", bert_binary_head=True,
              position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
              add_bias_linear=True, num_query_groups=a, kv_channels=c["hidden_size"] // a)

    @staticmethod
    def hf_config(c):
        return {"architectures": ["BertForPreTraining"], "model_type": "bert", "vocab_size": c["vocab_size"],
                "hidden_size": c["hidden_size"], "num_hidden_layers": c["num_layers"],
                "num_attention_heads": c["num_attention_heads"], "intermediate_size": c["ffn_hidden_size"],
                "hidden_act": "gelu" if c["gelu"] == "exact" else "gelu_pytorch_tanh",
                "hidden_dropout_prob": c.get("hidden_dropout", 0.1),
                "attention_probs_dropout_prob": c.get("attention_dropout", 0.1),
                "max_position_embeddings": c["max_position_embeddings"], "type_vocab_size": c["num_tokentypes"],
                "layer_norm_eps": c["layernorm_epsilon"], "initializer_range": c.get("init_method_std", 0.02),
                "tie_word_embeddings": True, "torch_dtype": c["params_dtype"]}

    @staticmethod
    def model_config(h):
        n, a = h["hidden_size"], h["num_attention_heads"]
        return {"model_type": "bert", "num_layers": h["num_hidden_layers"], "hidden_size": n,
                "num_attention_heads": a, "num_query_groups": a, "kv_channels": n // a,
                "ffn_hidden_size": h["intermediate_size"], "vocab_size": h["vocab_size"],
                "max_position_embeddings": h["max_position_embeddings"], "seq_length": h["max_position_embeddings"],
                "position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
                "layernorm_epsilon": h.get("layer_norm_eps", 1e-12), "swiglu": False, "add_bias_linear": True,
                "untie_embeddings_and_output_weights": False, "layernorm_position": "post",
                "gelu": Bert.ACTS[h.get("hidden_act", "gelu")], "num_tokentypes": h.get("type_vocab_size", 2),
                "bert_binary_head": True, "init_method_std": h.get("initializer_range", 0.02),
                "hidden_dropout": h.get("hidden_dropout_prob", 0.1),
                "attention_dropout": h.get("attention_probs_dropout_prob", 0.1)}

    @staticmethod
    def check_hf(h):
        if h.get("hidden_act", "gelu") not in Bert.ACTS:
            raise CheckpointError(f"BERT hidden_act={h['hidden_act']!r}: megalite has GeLU (exact or tanh) only")
        if h.get("position_embedding_type", "absolute") != "absolute":
            raise CheckpointError(f"BERT position_embedding_type={h['position_embedding_type']!r}: megalite's "
                                  "BERT has learned absolute positions")
        if not h.get("tie_word_embeddings", True):
            raise CheckpointError("BERT with tie_word_embeddings=False: megalite ties the MLM output layer")
        for f in ("is_decoder", "add_cross_attention"):
            if h.get(f):
                raise CheckpointError(f"BERT {f}=True: megalite's BERT is a bidirectional encoder without "
                                      "cross-attention")

    @staticmethod
    def table(c):
        a, d = c["num_attention_heads"], c["hidden_size"] // c["num_attention_heads"]
        ident = (lambda x: x)
        rows = [("bert.embeddings.word_embeddings.weight", "embedding.word_embeddings.weight", ident, ident),
                ("bert.embeddings.position_embeddings.weight", "embedding.position_embeddings.weight", ident, ident),
                ("bert.embeddings.token_type_embeddings.weight", "embedding.tokentype_embeddings.weight", ident,
                 ident)]
        rows += _norm_rows("bert.embeddings.LayerNorm.", "embedding.layernorm.")
        for i in range(c["num_layers"]):
            m, h = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}."
            for kind in ("weight", "bias"):
                qkv, q, k, v = (m + f"self_attention.linear_qkv.{kind}",
                                *(h + f"attention.self.{x}.{kind}" for x in ("query", "key", "value")))
                rows += [(q, qkv, lambda w: qkv_split(w, a, a, d)[0], None),
                         (k, qkv, lambda w: qkv_split(w, a, a, d)[1], None),
                         (v, qkv, lambda w: qkv_split(w, a, a, d)[2],
                          ("join", (q, k), lambda q_, k_, v_: qkv_join(q_, k_, v_, a, a, d)))]
            rows += _linear_rows(h + "attention.output.dense.", m + "self_attention.linear_proj.")
            rows += _norm_rows(h + "attention.output.LayerNorm.", m + "post_attention_layernorm.")
            rows += _linear_rows(h + "intermediate.dense.", m + "mlp.linear_fc1.")
            rows += _linear_rows(h + "output.dense.", m + "mlp.linear_fc2.")
            rows += _norm_rows(h + "output.LayerNorm.", m + "post_mlp_layernorm.")
        rows += _linear_rows("bert.pooler.dense.", "pooler.")
        rows += _linear_rows("cls.predictions.transform.dense.", "lm_head.dense.")
        rows += _norm_rows("cls.predictions.transform.LayerNorm.", "lm_head.layernorm.")
        rows.append(("cls.predictions.bias", "output_layer.bias", ident, ident))
        rows += _linear_rows("cls.seq_relationship.", "binary_head.")
        return rows


def _linear_rows(hf, ours):
    ident = (lambda x: x)
    return [(hf + k, ours + k, ident, ident) for k in ("weight", "bias")]


_norm_rows = _linear_rows  # LayerNorm: weight and bias, as they are
