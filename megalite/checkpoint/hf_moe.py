"""Hugging Face Mixture-of-Experts models <-> megalite: MixtralForCausalLM, Qwen2MoeForCausalLM
(shared expert with its sigmoid gate, QKV bias) and Qwen3MoeForCausalLM (q/k norms, dense layers).

The router is the same function in both: HF's softmax over all experts, top-k, renormalised over
the k (Mixtral; Qwen's norm_topk_prob) is megalite's softmax over the k chosen logits; Qwen
without norm_topk_prob is --moe-router-pre-softmax. Experts are written as transformers writes
them (one tensor per expert and projection); both that layout and the fused one
(`mlp.experts.gate_up_proj` [E, 2 ffn, h], `mlp.experts.down_proj` [E, h, ffn], how transformers
5 holds them in memory) are read (`fused_expert_tensor`). Capacity factors and auxiliary
losses are training-time choices: the HF model runs dropless.
"""

import re

from megalite.checkpoint.hf_window import window_hf
from megalite.checkpoint.hf import _need, attention_rows, llama_hf_config, llama_model_config, swiglu_rows
from megalite.checkpoint.storage import CheckpointError

_LLAMA_LIKE = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False)


def moe_layers(c):
    """[bool per layer]: which layers are MoE (megalite's --moe-layer-freq)."""
    f = c.get("moe_layer_freq", 1)
    if isinstance(f, list):
        return [bool(x) for x in f]
    return [i % int(f) == 0 for i in range(c["num_layers"])]


def _check_moe(c, arch):
    _need(c, arch, **_LLAMA_LIKE)
    if c.get("layernorm_position", "pre") != "pre":
        raise CheckpointError(f"{arch} cannot represent a post-norm model")
    for field, default in (("rotary_percent", 1.0), ("rotary_interleaved", False), ("squared_relu", False),
                           ("moe_router_score_function", "softmax"), ("moe_router_topk_scaling_factor", None),
                           ("moe_router_enable_expert_bias", False)):
        if c.get(field, default) != default:
            raise CheckpointError(f"{arch} cannot represent {field}={c[field]!r}")


def _router_hf(c):
    return {"num_experts_per_tok": c["moe_router_topk"], "router_aux_loss_coef": c.get("moe_aux_loss_coeff", 0.0),
            "output_router_logits": False}


def _llama_like_hf(c, arch, model_type):
    w = window_hf(c)
    return dict(llama_hf_config(c, arch, model_type), attention_dropout=0.0, use_sliding_window=w["use_sliding_window"],
                sliding_window=w["sliding_window"])


def _llama_like_config(h):
    if h.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act={h['hidden_act']!r}: megalite's SwiGLU uses silu")
    return dict(llama_model_config(h), moe_router_topk=h["num_experts_per_tok"])


def _num_experts(h):
    """Mixtral writes num_local_experts, Qwen num_experts (transformers 5 maps one to the other)."""
    n = h.get("num_local_experts", h.get("num_experts"))
    if not n:
        raise CheckpointError("the config names no experts (num_local_experts / num_experts)")
    return n


def _qwen_layers(h):
    """Qwen's decoder_sparse_step and mlp_only_layers -> megalite's per-layer MoE list."""
    step, dense = h.get("decoder_sparse_step", 1), set(h.get("mlp_only_layers") or [])
    layers = [i not in dense and (i + 1) % step == 0 for i in range(h["num_hidden_layers"])]
    return 1 if all(layers) else [int(x) for x in layers]


def _model_rows(c, layer_rows):
    ident = (lambda x: x)
    rows = [("model.embed_tokens.weight", "embedding.word_embeddings.weight", ident, ident)]
    for i, moe in enumerate(moe_layers(c)):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        rows += attention_rows(c, m, h) + layer_rows(c, m + "mlp.", h, moe)
    rows.append(("model.norm.weight", "decoder.final_layernorm.weight", ident, ident))
    if c["untie_embeddings_and_output_weights"]:
        rows.append(("lm_head.weight", "output_layer.weight", ident, ident))
    return rows


def _expert_rows(c, m, hf_expert, names):
    """Every expert's SwiGLU rows; hf_expert(e) is its HF prefix, names its (gate, up, down)."""
    rows = []
    for e in range(c["num_moe_experts"]):
        p = hf_expert(e)
        rows += swiglu_rows(f"{m}experts.local_experts.{e}.", *(p + n + ".weight" for n in names))
    return rows


class Mixtral:
    """MixtralForCausalLM: every layer MoE, softmax top-k renormalised, no shared expert."""
    hf_class = "MixtralForCausalLM"

    @staticmethod
    def check(c):
        _check_moe(c, "MixtralForCausalLM")
        for field in ("qk_layernorm", "add_qkv_bias", "apply_layernorm_1p", "moe_router_pre_softmax"):
            if c.get(field):
                raise CheckpointError(f"MixtralForCausalLM cannot represent {field}=True")
        if c.get("moe_shared_expert_intermediate_size"):
            raise CheckpointError("MixtralForCausalLM has no shared expert (Qwen2MoeForCausalLM does, with "
                                  "--moe-shared-expert-gate)")
        if not all(moe_layers(c)):
            raise CheckpointError("MixtralForCausalLM has every layer MoE; a model with dense layers "
                                  "(--moe-layer-freq) converts as Qwen3MoeForCausalLM (with --qk-layernorm)")

    @staticmethod
    def hf_config(c):
        return dict(_llama_like_hf(c, "MixtralForCausalLM", "mixtral"), **_router_hf(c),
                    intermediate_size=c["moe_ffn_hidden_size"], num_local_experts=c["num_moe_experts"],
                    router_jitter_noise=0.0)

    @staticmethod
    def model_config(h):
        return dict(_llama_like_config(h), ffn_hidden_size=h["intermediate_size"],
                    num_moe_experts=_num_experts(h), moe_ffn_hidden_size=h["intermediate_size"])

    @staticmethod
    def check_hf(h):
        if h.get("router_jitter_noise"):
            raise CheckpointError("Mixtral router_jitter_noise is not implemented in megalite")

    @staticmethod
    def table(c):
        def layer(c, m, h, moe):
            ident = (lambda x: x)
            b = h + "block_sparse_moe."
            return [(b + "gate.weight", m + "router.weight", ident, ident)] + _expert_rows(
                c, m, lambda e: f"{b}experts.{e}.", ("w1", "w3", "w2"))
        return _model_rows(c, layer)


class _Qwen:
    """Qwen's MoE layers (mlp.gate, mlp.experts.<e>.{gate,up,down}_proj) and dense layers."""

    @staticmethod
    def hf_common(c):
        return dict(**_router_hf(c), moe_intermediate_size=c["moe_ffn_hidden_size"],
                    intermediate_size=c["ffn_hidden_size"], num_experts=c["num_moe_experts"],
                    norm_topk_prob=not c.get("moe_router_pre_softmax", False), decoder_sparse_step=1,
                    mlp_only_layers=[i for i, moe in enumerate(moe_layers(c)) if not moe])

    @staticmethod
    def config_common(h):
        return dict(_llama_like_config(h), ffn_hidden_size=h["intermediate_size"], num_moe_experts=_num_experts(h),
                    moe_ffn_hidden_size=h["moe_intermediate_size"], moe_layer_freq=_qwen_layers(h),
                    moe_router_pre_softmax=not h.get("norm_topk_prob", False))

    @staticmethod
    def layer(c, m, h, moe):
        ident = (lambda x: x)
        p = h + "mlp."
        if not moe:
            return swiglu_rows(m, p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight")
        rows = [(p + "gate.weight", m + "router.weight", ident, ident)]
        rows += _expert_rows(c, m, lambda e: f"{p}experts.{e}.", ("gate_proj", "up_proj", "down_proj"))
        if c.get("moe_shared_expert_intermediate_size"):
            s = p + "shared_expert."
            rows += swiglu_rows(m + "shared_experts.", s + "gate_proj.weight", s + "up_proj.weight",
                                s + "down_proj.weight")
            rows.append((p + "shared_expert_gate.weight", m + "shared_experts.gate_weight", ident, ident))
        return rows


class Qwen2Moe(_Qwen):
    """Qwen2MoeForCausalLM: a shared expert scaled by sigmoid(x · g) in every MoE layer, QKV bias."""
    hf_class = "Qwen2MoeForCausalLM"

    @staticmethod
    def check(c):
        _check_moe(c, "Qwen2MoeForCausalLM")
        for field in ("qk_layernorm", "apply_layernorm_1p"):
            if c.get(field):
                raise CheckpointError(f"Qwen2MoeForCausalLM cannot represent {field}=True")
        if not (c.get("moe_shared_expert_intermediate_size") and c.get("moe_shared_expert_gate")):
            raise CheckpointError("Qwen2MoeForCausalLM's shared expert always has a gate: train with "
                                  "--moe-shared-expert-gate")

    @staticmethod
    def hf_config(c):
        return dict(_llama_like_hf(c, "Qwen2MoeForCausalLM", "qwen2_moe"), **_Qwen.hf_common(c),
                    shared_expert_intermediate_size=c["moe_shared_expert_intermediate_size"],
                    qkv_bias=bool(c.get("add_qkv_bias")))

    @staticmethod
    def model_config(h):
        return dict(_Qwen.config_common(h), add_qkv_bias=bool(h.get("qkv_bias", True)),
                    moe_shared_expert_intermediate_size=h["shared_expert_intermediate_size"],
                    moe_shared_expert_gate=True)

    @staticmethod
    def check_hf(h):
        if not h.get("shared_expert_intermediate_size"):
            raise CheckpointError("Qwen2-MoE without a shared expert (shared_expert_intermediate_size=0) is not "
                                  "converted; megalite's shared expert needs a size")

    @staticmethod
    def table(c):
        return _model_rows(c, _Qwen.layer)


class Qwen3Moe(_Qwen):
    """Qwen3MoeForCausalLM: per-head RMSNorm of queries and keys, no shared expert, no biases."""
    hf_class = "Qwen3MoeForCausalLM"

    @staticmethod
    def check(c):
        _check_moe(c, "Qwen3MoeForCausalLM")
        if not c.get("qk_layernorm"):
            raise CheckpointError("Qwen3MoeForCausalLM normalizes queries and keys: train with --qk-layernorm")
        for field in ("add_qkv_bias", "apply_layernorm_1p"):
            if c.get(field):
                raise CheckpointError(f"Qwen3MoeForCausalLM cannot represent {field}=True")
        if c.get("moe_shared_expert_intermediate_size"):
            raise CheckpointError("Qwen3MoeForCausalLM has no shared expert (Qwen2MoeForCausalLM does)")

    @staticmethod
    def hf_config(c):
        return dict(_llama_like_hf(c, "Qwen3MoeForCausalLM", "qwen3_moe"), **_Qwen.hf_common(c),
                    attention_bias=False)

    @staticmethod
    def model_config(h):
        return dict(_Qwen.config_common(h), qk_layernorm=True)

    @staticmethod
    def check_hf(h):
        if h.get("attention_bias"):
            raise CheckpointError("Qwen3-MoE attention_bias=True (q/k/v/o biases) has no megalite equivalent")

    @staticmethod
    def table(c):
        return _model_rows(c, _Qwen.layer)


def moe_arch_for(c):
    """The HF class a megalite MoE config maps to: a shared expert -> Qwen2-MoE; q/k norms ->
    Qwen3-MoE; otherwise Mixtral."""
    if c.get("moe_shared_expert_intermediate_size"):
        return Qwen2Moe
    return Qwen3Moe if c.get("qk_layernorm") else Mixtral


# an expert's tensor in transformers' per-expert layout -> the fused tensor that may hold it instead
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.)(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                         r"(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
_MIXTRAL_GATE = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.gate\.weight$")


def fused_expert_tensor(name, get_slice):
    """The tensor `name` (per-expert layout) read from the fused layout, or None when `name` is
    not an expert's or router's tensor. get_slice(fused name) -> a safetensors slice or None."""
    m = _MIXTRAL_GATE.match(name)
    if m:
        s = get_slice(m.group(1) + "mlp.gate.weight")
        return None if s is None else s[:]
    m = _PER_EXPERT.match(name)
    if not m:
        return None
    layer, e, proj = m.group(1), int(m.group(2)), m.group(3)
    gate_up, down = get_slice(layer + "mlp.experts.gate_up_proj"), get_slice(layer + "mlp.experts.down_proj")
    if gate_up is None or down is None:
        return None
    gu, dn = gate_up.get_shape(), down.get_shape()
    # transformers 5: gate_up [E, 2 ffn, h] (gate rows first), down [E, h, ffn]
    if len(gu) != 3 or len(dn) != 3 or gu[0] != dn[0] or gu[1] != 2 * dn[2] or gu[2] != dn[1]:
        raise CheckpointError(f"{layer}mlp.experts: gate_up_proj {gu} and down_proj {dn} are not "
                              "[experts, 2 x ffn, hidden] and [experts, hidden, ffn]")
    if proj in ("w2", "down_proj"):
        return down[e]
    return gate_up[e, :dn[2]] if proj in ("w1", "gate_proj") else gate_up[e, dn[2]:]
