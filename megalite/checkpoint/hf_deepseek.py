"""Hugging Face DeepseekV3ForCausalLM <-> megalite: multi-latent attention (low-rank q with its norm, the
compressed kv with its norm and the shared rotary key), YaRN, the first layers dense
(`first_k_dense_replace`), then MoE layers with routed experts and a shared expert, sigmoid scores with
the expert bias (`e_score_correction_bias`: it steers the choice, not the weights), group-limited routing
(`n_group` / `topk_group`), the weights renormalised over the k chosen (`norm_topk_prob`) and scaled
(`routed_scaling_factor`).

The tensors map one to one: megalite's MLA projections are laid out as DeepSeek's (q_b_proj's rows per head
[nope; rope], kv_a_proj_with_mqa's [latent; rope], kv_b_proj's per head [k nope; v]) and both rotate the
rope dims in interleaved pairs (transformers' `rope_interleave`).

Multi-token prediction: written as DeepSeek's own checkpoints hold it, depth k as layer `num_hidden_layers + k`
(a decoder layer's tensors plus enorm, hnorm, eh_proj, shared_head.norm and copies of the embedding and the
output head), with `num_nextn_predict_layers`; transformers' class builds no MTP and skips those tensors when
it loads. They are read back on import; a directory without them (what transformers' save_pretrained writes,
whatever `num_nextn_predict_layers` says) imports without MTP."""

from megalite.checkpoint.hf import EXPORT_ONLY, swiglu_rows
from megalite.checkpoint.hf_moe import _expert_rows, moe_layers
from megalite.checkpoint.storage import CheckpointError

ARCH = "DeepseekV3ForCausalLM"


def _ident(x):
    return x


def _first_dense(c):
    """k of first_k_dense_replace: the layers are k dense, then MoE."""
    layers = moe_layers(c)
    k = layers.index(True) if True in layers else len(layers)
    if not all(layers[k:]) or k == len(layers):
        raise CheckpointError(f"{ARCH} has its first layers dense and the rest MoE (first_k_dense_replace); this "
                              f"model's MoE layers are {[int(x) for x in layers]}")
    return k


class DeepseekV3:
    hf_class = ARCH
    holds_mtp = True

    @staticmethod
    def check(c):
        want = {"multi_latent_attention": True, "normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False,
                "moe_router_score_function": "sigmoid", "qk_layernorm": True}
        for field, value in want.items():
            if c.get(field) != value:
                raise CheckpointError(f"{ARCH} cannot represent {field}={c.get(field)!r} (it needs {value!r})")
        if not c.get("num_moe_experts"):
            raise CheckpointError(f"{ARCH} needs MoE layers: a dense multi-latent-attention model has no "
                                  "transformers class here")
        if c.get("q_lora_rank") is None:
            raise CheckpointError(f"{ARCH}: megalite's MLA without --q-lora-rank has no latent norms to map")
        if c.get("position_embedding_type") == "learned_absolute":
            raise CheckpointError(f"{ARCH} has no learned positions: train with --position-embedding-type rope")
        for field, default in (("layernorm_position", "pre"), ("moe_shared_expert_gate", False),
                               ("experimental_attention_variant", None), ("apply_layernorm_1p", False),
                               ("moe_router_pre_softmax", False), ("squared_relu", False)):
            if c.get(field, default) != default:
                raise CheckpointError(f"{ARCH} cannot represent {field}={c[field]!r}")
        shared, ffn = c.get("moe_shared_expert_intermediate_size") or 0, c["moe_ffn_hidden_size"]
        if shared % ffn:
            raise CheckpointError(f"{ARCH} holds n_shared_experts x moe_intermediate_size: the shared expert's "
                                  f"{shared} is not a multiple of --moe-ffn-hidden-size {ffn}")
        if c.get("rope_type", "yarn") == "yarn" and not c.get("mscale_all_dim") and c.get("mscale", 1.0) != 1.0:
            raise CheckpointError(f"{ARCH}'s YaRN reads --mscale only with --mscale-all-dim set")
        _first_dense(c)

    @staticmethod
    def hf_config(c):
        theta, k = c["rotary_base"], c["moe_router_topk"]
        rope = {"rope_type": "default", "rope_theta": theta}
        if c.get("rope_type", "yarn") == "yarn":
            rope = {"rope_type": "yarn", "rope_theta": theta, "factor": c["rotary_scaling_factor"],
                    "original_max_position_embeddings": c["original_max_position_embeddings"],
                    "beta_fast": c["beta_fast"], "beta_slow": c["beta_slow"], "mscale": c["mscale"],
                    "mscale_all_dim": c["mscale_all_dim"]}
        return {"architectures": [ARCH], "model_type": "deepseek_v3", "vocab_size": c["vocab_size"],
                "hidden_size": c["hidden_size"], "intermediate_size": c["ffn_hidden_size"],
                "moe_intermediate_size": c["moe_ffn_hidden_size"], "num_hidden_layers": c["num_layers"],
                "num_attention_heads": c["num_attention_heads"], "num_key_value_heads": c["num_attention_heads"],
                "n_shared_experts": (c.get("moe_shared_expert_intermediate_size") or 0) // c["moe_ffn_hidden_size"],
                "n_routed_experts": c["num_moe_experts"], "num_experts_per_tok": k,
                "routed_scaling_factor": c.get("moe_router_topk_scaling_factor") or 1.0,
                "n_group": c.get("moe_router_num_groups") or 1, "topk_group": c.get("moe_router_group_topk") or 1,
                "norm_topk_prob": k > 1,  # megalite renormalises sigmoid weights over k > 1 chosen
                "first_k_dense_replace": _first_dense(c), "kv_lora_rank": c["kv_lora_rank"],
                "q_lora_rank": c["q_lora_rank"], "qk_nope_head_dim": c["qk_head_dim"],
                "qk_rope_head_dim": c["qk_pos_emb_head_dim"], "v_head_dim": c["v_head_dim"], "hidden_act": "silu",
                "max_position_embeddings": c["max_position_embeddings"], "rms_norm_eps": c["layernorm_epsilon"],
                "rope_theta": theta, "rope_parameters": rope, "rope_interleave": True, "attention_bias": False,
                "attention_dropout": 0.0, "num_nextn_predict_layers": c.get("mtp_num_layers") or 0,
                "tie_word_embeddings": not c["untie_embeddings_and_output_weights"], "torch_dtype": c["params_dtype"]}

    @staticmethod
    def check_hf(h):
        if h.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{ARCH} hidden_act={h['hidden_act']!r}: megalite's SwiGLU uses silu")
        for field, ok in (("rope_interleave", h.get("rope_interleave", True)), ("q_lora_rank", h.get("q_lora_rank")),
                          ("attention_bias=False", not h.get("attention_bias")),
                          ("norm_topk_prob (with num_experts_per_tok > 1)",
                           h.get("norm_topk_prob", True) or h["num_experts_per_tok"] == 1)):
            if not ok:
                raise CheckpointError(f"{ARCH} without {field} is not implemented in megalite")
        nope, pe, heads = h["qk_nope_head_dim"], h["qk_rope_head_dim"], h["num_attention_heads"]
        # fields transformers derives from others (a file that disagrees is not DeepSeek's attention)
        for field, want in (("head_dim", pe), ("qk_head_dim", nope + pe), ("num_key_value_heads", heads)):
            if h.get(field) not in (None, want):
                raise CheckpointError(f"{ARCH} {field}={h[field]!r}: its multi-latent attention has {want}")
        rope = h.get("rope_parameters") or h.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "yarn") or rope.get("attention_factor") is not None:
            raise CheckpointError(f"{ARCH} rope {kind!r} (attention_factor {rope.get('attention_factor')}) is not "
                                  "implemented in megalite (default and YaRN are)")

    @staticmethod
    def model_config(h):
        rope = h.get("rope_parameters") or h.get("rope_scaling") or {}
        yarn = rope.get("rope_type", rope.get("type", "default")) == "yarn"
        k, layers, dense = h["num_experts_per_tok"], h["num_hidden_layers"], h.get("first_k_dense_replace", 0)
        out = {"num_layers": layers, "hidden_size": h["hidden_size"], "num_attention_heads": h["num_attention_heads"],
               "num_query_groups": h["num_attention_heads"], "vocab_size": h["vocab_size"],
               "max_position_embeddings": h["max_position_embeddings"], "seq_length": h["max_position_embeddings"],
               "position_embedding_type": "rope", "normalization": "RMSNorm",
               "layernorm_epsilon": h.get("rms_norm_eps", 1e-6), "swiglu": True, "add_bias_linear": False,
               "untie_embeddings_and_output_weights": not h.get("tie_word_embeddings", False),
               "ffn_hidden_size": h["intermediate_size"], "multi_latent_attention": True, "qk_layernorm": True,
               "q_lora_rank": h["q_lora_rank"], "kv_lora_rank": h["kv_lora_rank"],
               "qk_head_dim": h["qk_nope_head_dim"], "qk_pos_emb_head_dim": h["qk_rope_head_dim"],
               "v_head_dim": h["v_head_dim"], "rotary_base": float(rope.get("rope_theta", h.get("rope_theta", 1e4))),
               "rope_type": "yarn" if yarn else "rope", "num_moe_experts": h["n_routed_experts"],
               "moe_router_topk": k, "moe_ffn_hidden_size": h["moe_intermediate_size"],
               "moe_layer_freq": [0] * min(dense, layers) + [1] * max(layers - dense, 0),
               "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
               "moe_shared_expert_intermediate_size": (h.get("n_shared_experts") or 0) * h["moe_intermediate_size"]
               or None}
        if h.get("num_nextn_predict_layers"):  # (dropped by import_hf where the weights are missing)
            out["mtp_num_layers"] = h["num_nextn_predict_layers"]
        if (h.get("n_group") or 1) > 1:
            out.update(moe_router_num_groups=h["n_group"], moe_router_group_topk=h["topk_group"])
        if h.get("routed_scaling_factor", 1.0) != 1.0:
            out["moe_router_topk_scaling_factor"] = h["routed_scaling_factor"]
        if yarn:
            out.update(rotary_scaling_factor=rope["factor"], mscale=rope.get("mscale") or 1.0,
                       mscale_all_dim=rope.get("mscale_all_dim") or 0.0, beta_fast=rope.get("beta_fast") or 32.0,
                       beta_slow=rope.get("beta_slow") or 1.0,
                       original_max_position_embeddings=rope["original_max_position_embeddings"])
        return out

    @staticmethod
    def inert(h):
        """topk_group chooses among n_group groups: with one group there is nothing to choose."""
        return {"topk_group"} if (h.get("n_group") or 1) <= 1 else set()

    @staticmethod
    def mtp_probe(c):
        """An HF tensor every MTP depth has: present only where the directory holds MTP."""
        return f"model.layers.{c['num_layers']}.eh_proj.weight"

    @staticmethod
    def table(c):
        rows = [("model.embed_tokens.weight", "embedding.word_embeddings.weight", _ident, _ident)]
        moe = moe_layers(c)
        for i in range(c["num_layers"]):
            rows += _layer_rows(c, f"decoder.layers.{i}.", f"model.layers.{i}.", moe[i])
        rows.append(("model.norm.weight", "decoder.final_layernorm.weight", _ident, _ident))
        head = "output_layer.weight" if c["untie_embeddings_and_output_weights"] else "embedding.word_embeddings.weight"
        if c["untie_embeddings_and_output_weights"]:
            rows.append(("lm_head.weight", head, _ident, _ident))
        for k in range(c.get("mtp_num_layers") or 0):  # DeepSeek's layout: layer num_layers + k
            m, h = f"mtp.layers.{k}.", f"model.layers.{c['num_layers'] + k}."
            rows += [(h + n + ".weight", m + n + ".weight", _ident, _ident) for n in ("enorm", "hnorm", "eh_proj")]
            rows += _layer_rows(c, m + "transformer_layer.", h, moe[-1])
            rows += [(h + "shared_head.norm.weight", m + "final_layernorm.weight", _ident, _ident),
                     (h + "embed_tokens.weight", "embedding.word_embeddings.weight", _ident, EXPORT_ONLY),
                     (h + "shared_head.head.weight", head, _ident, EXPORT_ONLY)]
        return rows


def _layer_rows(c, m, h, moe):
    """One decoder layer's rows: megalite prefix m, HF prefix h."""
    a, s = m + "self_attention.", h + "self_attn."
    rows = [(h + "input_layernorm.weight", m + "input_layernorm.weight", _ident, _ident)]
    rows += [(s + hf + ".weight", a + ours + ".weight", _ident, _ident) for hf, ours in (
        ("q_a_proj", "linear_q_down_proj"), ("q_a_layernorm", "q_layernorm"), ("q_b_proj", "linear_q_up_proj"),
        ("kv_a_proj_with_mqa", "linear_kv_down_proj"), ("kv_a_layernorm", "kv_layernorm"),
        ("kv_b_proj", "linear_kv_up_proj"), ("o_proj", "linear_proj"))]
    rows.append((h + "post_attention_layernorm.weight", m + "pre_mlp_layernorm.weight", _ident, _ident))
    mlp = h + "mlp."
    if not moe:
        return rows + swiglu_rows(m + "mlp.", mlp + "gate_proj.weight", mlp + "up_proj.weight",
                                  mlp + "down_proj.weight")
    rows.append((mlp + "gate.weight", m + "mlp.router.weight", _ident, _ident))
    if c.get("moe_router_enable_expert_bias"):
        rows.append((mlp + "gate.e_score_correction_bias", m + "mlp.router.expert_bias", _ident, _ident))
    rows += _expert_rows(c, m + "mlp.", lambda e: f"{mlp}experts.{e}.", ("gate_proj", "up_proj", "down_proj"))
    if c.get("moe_shared_expert_intermediate_size"):
        sh = mlp + "shared_experts."
        rows += swiglu_rows(m + "mlp.shared_experts.", sh + "gate_proj.weight", sh + "up_proj.weight",
                            sh + "down_proj.weight")
    return rows
