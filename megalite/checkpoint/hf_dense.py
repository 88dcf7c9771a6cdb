"""Hugging Face's dense Llama-family classes beyond Llama itself: Qwen2 (biases on q, k and v), Qwen3 (per-head
RMSNorm of queries and keys), Mistral (Llama's tensors; a sliding window, refused where it is set), Phi-3 / Phi-4
(Llama's function in fused qkv and gate_up tensors, with a partial rotary) and Gemma (--geglu, an embedding
multiplier, (1 + w) norms). Qwen's tensors are Llama's with those rows added (hf.attention_rows maps both); their
configs are Llama's with the flag that tells them apart, so a megalite model with --add-qkv-bias exports as Qwen2
and one with --qk-layernorm as Qwen3, one with --geglu as Gemma. Mistral without a window and Phi-3 hold Llama's
models (`same_models_as`; Phi-3 those whose head dim is hidden / heads): a checkpoint converted from one goes back
as it, any other (a checkpoint saved by training keeps no source) on asking with --hf-architecture
(hf_convert.arch_for)."""

import torch

from megalite.checkpoint.hf_window import window_hf
from megalite.checkpoint.hf import (Llama, _gamma_rows, _need, _plain, llama_hf_config, llama_model_config, llama_rows,
                                    qkv_join, qkv_split)
from megalite.checkpoint.storage import CheckpointError


def _dense_llama_check(c, arch, plain=(), **want):
    _plain(c, arch, plain + ("rotary_percent", "rotary_interleaved", "squared_relu"))
    if c.get("layernorm_position", "pre") != "pre":
        raise CheckpointError(f"{arch} cannot represent a post-norm model")
    for field, value in want.items():
        if bool(c.get(field)) != value:
            raise CheckpointError(f"{arch} cannot represent {field}={c.get(field)!r} (it needs {value!r})")
    _need(c, arch, position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False)


def _silu(h, arch):
    if h.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{arch} hidden_act={h['hidden_act']!r}: megalite's SwiGLU uses silu")


class Qwen2:
    """Qwen2ForCausalLM (Qwen2, Qwen2.5): Llama with biases on the q, k and v projections."""
    hf_class = "Qwen2ForCausalLM"
    table = Llama.table

    @staticmethod
    def check(c):
        _dense_llama_check(c, Qwen2.hf_class, add_qkv_bias=True, qk_layernorm=False)

    @staticmethod
    def hf_config(c):
        return dict(llama_hf_config(c, Qwen2.hf_class, "qwen2"), intermediate_size=c["ffn_hidden_size"],
                    attention_dropout=0.0, **window_hf(c))

    @staticmethod
    def model_config(h):
        return dict(llama_model_config(h), ffn_hidden_size=h["intermediate_size"], add_qkv_bias=True)

    @staticmethod
    def check_hf(h):
        _silu(h, "Qwen2")


class Qwen3:
    """Qwen3ForCausalLM: Llama with per-head RMSNorm of queries and keys."""
    hf_class = "Qwen3ForCausalLM"
    table = Llama.table

    @staticmethod
    def check(c):
        # (--apply-layernorm-1p: not proven for the q/k norms)
        _dense_llama_check(c, Qwen3.hf_class, ("apply_layernorm_1p",), add_qkv_bias=False, qk_layernorm=True)

    @staticmethod
    def hf_config(c):
        return dict(llama_hf_config(c, Qwen3.hf_class, "qwen3"), intermediate_size=c["ffn_hidden_size"],
                    attention_bias=False, use_sliding_window=False, sliding_window=None, attention_dropout=0.0)

    @staticmethod
    def model_config(h):
        return dict(llama_model_config(h), ffn_hidden_size=h["intermediate_size"], qk_layernorm=True)

    @staticmethod
    def check_hf(h):
        _silu(h, "Qwen3")
        if h.get("attention_bias"):
            raise CheckpointError("Qwen3 attention_bias=True (q/k/v/o biases) has no megalite equivalent")


class Mistral:
    """MistralForCausalLM (Mistral 7B v0.1's sliding window of 4096 too; v0.3, Nemo, Small: none): Llama's tensors;
    its window megalite's --window-size (checkpoint/hf_window.py)."""
    hf_class = "MistralForCausalLM"
    same_models_as = "LlamaForCausalLM"
    table = Llama.table

    @staticmethod
    def check(c):
        _dense_llama_check(c, Mistral.hf_class, add_qkv_bias=False, qk_layernorm=False)

    @staticmethod
    def hf_config(c):
        return dict(llama_hf_config(c, Mistral.hf_class, "mistral"), intermediate_size=c["ffn_hidden_size"],
                    sliding_window=window_hf(c)["sliding_window"], attention_dropout=0.0)

    @staticmethod
    def model_config(h):
        return dict(llama_model_config(h), ffn_hidden_size=h["intermediate_size"])

    @staticmethod
    def check_hf(h):
        _silu(h, "Mistral")


class Phi3:
    """Phi3ForCausalLM (Phi-3, Phi-4): Llama's function in fused tensors, q, k and v in one qkv_proj (rows: q, k,
    v) and gate and up in one gate_up_proj, split on import and fused on export; a partial rotary
    (rope_parameters' partial_rotary_factor: --rotary-percent). Holds the Llama models whose head dim is hidden /
    heads (`same_models_as`; Phi3.check refuses the others)."""
    hf_class = "Phi3ForCausalLM"
    same_models_as = "LlamaForCausalLM"

    @staticmethod
    def check(c):
        _plain(c, Phi3.hf_class, ("qk_layernorm", "rotary_interleaved", "squared_relu", "add_qkv_bias"))
        if c.get("layernorm_position", "pre") != "pre":
            raise CheckpointError(f"{Phi3.hf_class} cannot represent a post-norm model")
        if c["kv_channels"] * c["num_attention_heads"] != c["hidden_size"]:
            raise CheckpointError(f"{Phi3.hf_class} derives its head dim from the hidden size: kv_channels "
                                  f"{c['kv_channels']} x {c['num_attention_heads']} heads != {c['hidden_size']}")
        _need(c, Phi3.hf_class, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
              add_bias_linear=False)

    @staticmethod
    def hf_config(c):
        out = dict(llama_hf_config(c, Phi3.hf_class, "phi3"), intermediate_size=c["ffn_hidden_size"],
                   original_max_position_embeddings=c["max_position_embeddings"], sliding_window=None,
                   resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                   pad_token_id=None)  # (megalite keeps no token ids; Phi3Config's default 32000 is Phi-3's vocabulary)
        out["rope_parameters"] = dict(out["rope_parameters"], partial_rotary_factor=c.get("rotary_percent", 1.0))
        return out

    @staticmethod
    def model_config(h):
        rope = h.get("rope_parameters") or {}
        return dict(llama_model_config(h), ffn_hidden_size=h["intermediate_size"],
                    rotary_percent=float(rope.get("partial_rotary_factor", h.get("partial_rotary_factor", 1.0))))

    @staticmethod
    def check_hf(h):
        _silu(h, "Phi-3")

    @staticmethod
    def inert(h):
        """Its original context matters only to longrope scaling, which llama_model_config refuses."""
        return {"original_max_position_embeddings"}

    @staticmethod
    @_gamma_rows
    def table(c):
        a, g, d = c["num_attention_heads"], c["num_query_groups"], c["kv_channels"]
        ident = (lambda x: x)
        rows = [("model.embed_tokens.weight", "embedding.word_embeddings.weight", ident, ident)]
        for i in range(c["num_layers"]):
            m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
            rows += [(h + "input_layernorm.weight", m + "input_layernorm.weight", ident, ident),
                     (h + "self_attn.qkv_proj.weight", m + "self_attention.linear_qkv.weight",
                      lambda w: torch.cat(qkv_split(w, a, g, d)),
                      lambda t: qkv_join(*t.split([a * d, g * d, g * d]), a, g, d)),
                     (h + "self_attn.o_proj.weight", m + "self_attention.linear_proj.weight", ident, ident),
                     (h + "post_attention_layernorm.weight", m + "pre_mlp_layernorm.weight", ident, ident),
                     (h + "mlp.gate_up_proj.weight", m + "mlp.linear_fc1.weight",
                      lambda w: w.reshape(-1, w.shape[-1]), lambda t: t.reshape(2, -1, t.shape[-1])),
                     (h + "mlp.down_proj.weight", m + "mlp.linear_fc2.weight", ident, ident)]
        rows.append(("model.norm.weight", "decoder.final_layernorm.weight", ident, ident))
        if c["untie_embeddings_and_output_weights"]:
            rows.append(("lm_head.weight", "output_layer.weight", ident, ident))
        return rows


class Gemma:
    """GemmaForCausalLM (Gemma 1, CodeGemma): Llama's tensors with the embeddings times sqrt(hidden)
    (--embedding-multiplier), (1 + w) RMSNorm whose w HF stores as megalite's --apply-layernorm-1p holds it, and a
    tanh-GeLU gated MLP (--geglu)."""
    hf_class = "GemmaForCausalLM"
    table = staticmethod(llama_rows)
    TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")

    @staticmethod
    def check(c):
        _plain(c, Gemma.hf_class, ("qk_layernorm", "rotary_percent", "rotary_interleaved", "squared_relu",
                                   "add_qkv_bias"))
        if c.get("layernorm_position", "pre") != "pre":
            raise CheckpointError(f"{Gemma.hf_class} cannot represent a post-norm model")
        _need(c, Gemma.hf_class, position_embedding_type="rope", normalization="RMSNorm", swiglu=True, geglu=True,
              add_bias_linear=False, apply_layernorm_1p=True, embedding_multiplier=c["hidden_size"] ** 0.5)

    @staticmethod
    def hf_config(c):
        return dict(llama_hf_config(c, Gemma.hf_class, "gemma"), intermediate_size=c["ffn_hidden_size"],
                    hidden_act="gelu_pytorch_tanh", attention_bias=False, attention_dropout=0.0)

    @staticmethod
    def model_config(h):
        return dict(llama_model_config(h), ffn_hidden_size=h["intermediate_size"], swiglu=True, geglu=True,
                    apply_layernorm_1p=True, embedding_multiplier=h["hidden_size"] ** 0.5)

    @staticmethod
    def check_hf(h):
        # (the official releases say hidden_act "gelu" and mean the tanh GeLU, as transformers reads it; older files
        # add hidden_activation, which older transformers preferred)
        act, legacy = h.get("hidden_act") or "gelu_pytorch_tanh", h.get("hidden_activation")
        act = legacy or ("gelu_pytorch_tanh" if act == "gelu" else act)
        if act not in Gemma.TANH:
            raise CheckpointError(f"Gemma hidden_act={act!r}: megalite's GeGLU is the tanh GeLU's (gelu_pytorch_tanh)")
        for field in ("attention_bias", "use_bidirectional_attention"):
            if h.get(field):
                raise CheckpointError(f"Gemma {field}=True has no megalite equivalent")
