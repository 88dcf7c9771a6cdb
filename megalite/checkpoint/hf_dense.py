"""Hugging Face's dense Llama-family classes beyond Llama itself: Qwen2 (biases on q, k and v), Qwen3 (per-head
RMSNorm of queries and keys) and Mistral (Llama's tensors; a sliding window, refused where it is set). Qwen's
tensors are Llama's with those rows added (hf.attention_rows maps both); their configs are Llama's with the flag
that tells them apart, so a megalite model with --add-qkv-bias exports as Qwen2 and one with --qk-layernorm as
Qwen3. Mistral without a window holds exactly Llama's models (`same_models_as`): a checkpoint imported from it goes
back as it, any other on asking (convert.arch_for)."""

from megalite.checkpoint.hf import Llama, _need, _plain, llama_hf_config, llama_model_config
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
                    use_sliding_window=False, sliding_window=None, attention_dropout=0.0)

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
    """MistralForCausalLM (Mistral 7B v0.3, Nemo, Small): Llama's tensors and function once no sliding window is
    set (v0.1's 4096 is refused by llama_model_config: megalite has no windowed attention yet)."""
    hf_class = "MistralForCausalLM"
    same_models_as = "LlamaForCausalLM"
    table = Llama.table

    @staticmethod
    def check(c):
        _dense_llama_check(c, Mistral.hf_class, add_qkv_bias=False, qk_layernorm=False)

    @staticmethod
    def hf_config(c):
        return dict(llama_hf_config(c, Mistral.hf_class, "mistral"), intermediate_size=c["ffn_hidden_size"],
                    sliding_window=None, attention_dropout=0.0)

    @staticmethod
    def model_config(h):
        return dict(llama_model_config(h), ffn_hidden_size=h["intermediate_size"])

    @staticmethod
    def check_hf(h):
        _silu(h, "Mistral")
