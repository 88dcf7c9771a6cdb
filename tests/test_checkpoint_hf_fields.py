"""`--loader hf` reads a config.json field by field (megalite/checkpoint/hf_fields.py): tiny random models built by
transformers' own config classes import with every field of the class accounted for, and a field megalite does not
represent is one line naming it, never a different model. Two imports that once were silently another model: a
GPT-2 with an untied lm_head (now mapped: logits equal transformers') and a Mixtral with a sliding window
(refused)."""

import dataclasses
import json
import os

import pytest
import torch

from cli_batch import convert
from test_checkpoint_hf import hf_logits, megalite_logits, tensors

transformers = pytest.importorskip("transformers", reason="the HF field checks need transformers (the [test] extra "
                                   "installs it)")

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, max_position_embeddings=32)
MOE = dict(SMALL, num_experts_per_tok=2, moe_intermediate_size=16)
LLAMA3_1 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# Each a config class's own defaults except its sizes: every field the class writes must be accounted for.
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32),
    "gpt2_untied": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                                   tie_word_embeddings=False),
    "llama": lambda: transformers.LlamaConfig(**SMALL, head_dim=8),
    # Llama 3.1's rope scaling, its band moved down to this context (an original context of 16 positions) so that
    # it scales the frequencies 12 tokens reach; Llama 3.1's own values are checked against transformers' formula
    # in tests/test_model_flags.py
    "llama3_1": lambda: transformers.LlamaConfig(**SMALL, head_dim=8, rope_parameters=LLAMA3_1),
    "mixtral": lambda: transformers.MixtralConfig(**dict(SMALL, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**MOE, num_experts=4, shared_expert_intermediate_size=24),
    "mistral": lambda: transformers.MistralConfig(**SMALL, head_dim=8, sliding_window=None),  # (v0.3, Nemo, Small)
    # sliding windows (4 keys, the 12-token test sequence longer): Mistral v0.1's, Mixtral's, Qwen2's switched on
    # for every layer, and alternating with full attention (Gemma 2's and gpt-oss's pattern, as Qwen2 layer types)
    "mistral_window": lambda: transformers.MistralConfig(**SMALL, head_dim=8, sliding_window=4),
    "mixtral_window": lambda: transformers.MixtralConfig(**dict(SMALL, num_local_experts=4, num_experts_per_tok=2),
                                                         sliding_window=4),
    "qwen2_window": lambda: transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4,
                                                     max_window_layers=0),
    "qwen2_alternating": lambda: transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4,
                                                          layer_types=["sliding_attention", "full_attention"]),
    # Phi-3 / Phi-4: fused qkv and gate_up tensors; a partial rotary (3 of each head's 4 rotary pairs), tied
    "phi3": lambda: transformers.Phi3Config(**SMALL, tie_word_embeddings=True, pad_token_id=0,
                                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.75}),
    # Gemma: the embeddings times sqrt(hidden), (1 + w) RMSNorm, tanh-GeLU GLU; random norm weights (HF starts them
    # at 0, where (1 + w) and w would agree)
    "gemma": lambda: transformers.GemmaConfig(**SMALL, head_dim=8),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=8),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**MOE, num_experts=4, head_dim=8),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **dict(MOE, num_key_value_heads=4), n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
        n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, num_nextn_predict_layers=0),
}


def _save(config, path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # (norms away from their initial 1 or 0: a norm's weight mapped wrongly shows)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _edit(path, **changes):
    f = os.path.join(path, "config.json")
    with open(f) as fh:
        h = json.load(fh)
    for k, v in changes.items():
        if isinstance(v, dict) and isinstance(h.get(k), dict):
            h[k].update(v)
        else:
            h[k] = v
    with open(f, "w") as fh:
        json.dump(h, fh)


def _import(src, dst):
    return convert("--loader", "hf", "--saver", "megalite", "--load-dir", src, "--save-dir", dst)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf_fields")
    return {name: _save(make(), str(base / name)) for name, make in CONFIGS.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_config_class_of_its_defaults_imports_as_the_same_model(name, saved, tmp_path):
    rc, out, err = _import(saved[name], str(tmp_path / "m"))
    assert rc == 0, err
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    _, ref = hf_logits(saved[name], tokens)
    ours = megalite_logits(str(tmp_path / "m"), tokens)
    # fp32 both sides, the same products summed in another order: rounding of a few ulps of logits near 1
    assert (ours - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item()), name


@pytest.mark.parametrize("name", ["mistral_window", "qwen2_alternating"])
def test_a_windowed_import_at_tp2_pp2_is_the_same_model(name, saved, tmp_path):
    """The window and the alternating layers, imported into a TP2 x PP2 checkpoint and read back whole:
    transformers' logits (a window run at TP2 + SP x PP2 itself, each stage windowing by global layer number:
    tests/test_model_flags.py's parity)."""
    rc, _, err = convert("--loader", "hf", "--saver", "megalite", "--load-dir", saved[name], "--save-dir",
                         str(tmp_path / "m"), "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size",
                         "2")
    assert rc == 0, err
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    _, ref = hf_logits(saved[name], tokens)
    ours = megalite_logits(str(tmp_path / "m"), tokens)
    assert (ours - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item()), name


def test_a_bert_config_of_its_defaults_imports(tmp_path):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.BertForPreTraining(config).save_pretrained(str(tmp_path / "bert"), safe_serialization=True)
    rc, _, err = _import(str(tmp_path / "bert"), str(tmp_path / "m"))
    assert rc == 0, err


@pytest.mark.parametrize("name, cls", [("gpt2_untied", "GPT2LMHeadModel"), ("qwen2", "Qwen2ForCausalLM"),
                                       ("qwen3", "Qwen3ForCausalLM"), ("llama3_1", "LlamaForCausalLM"),
                                       ("mistral", "MistralForCausalLM"), ("phi3", "Phi3ForCausalLM"),
                                       ("mistral_window", "MistralForCausalLM"), ("qwen2_window", "Qwen2ForCausalLM"),
                                       ("gemma", "GemmaForCausalLM")])
def test_hf_to_megalite_to_hf_is_the_same_class_bit_for_bit(name, cls, saved, tmp_path):
    """An untied GPT-2 keeps its lm_head; dense Qwen2 (q/k/v biases) and Qwen3 (q/k norms) come back as themselves."""
    src, mine, back = saved[name], str(tmp_path / "m"), str(tmp_path / "back")
    assert _import(src, mine)[0] == 0
    assert convert("--loader", "megalite", "--saver", "hf", "--load-dir", mine, "--save-dir", back)[0] == 0
    a, b = tensors(src), tensors(back)
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), f"HF round trip changed {k}"
    model, _ = hf_logits(back, torch.zeros(1, 2, dtype=torch.long))
    assert type(model).__name__ == cls
    if name == "llama3_1":  # (the scaling written back as transformers reads it)
        assert {k: model.config.rope_parameters[k] for k in LLAMA3_1} == LLAMA3_1, model.config.rope_parameters
    if name.endswith("_window"):  # (the window written back as transformers reads it)
        types = getattr(model.config, "layer_types", None) or ["sliding_attention"]  # (Mistral has none: all)
        assert model.config.sliding_window == 4 and set(types) == {"sliding_attention"}, model.config
    if name == "gpt2_untied":
        assert model.config.tie_word_embeddings is False
        assert not torch.equal(a["lm_head.weight"], a["transformer.wte.weight"])


def _refused(src, tmp_path, **changes):
    """Import after editing src's config.json (put back after): its (exit status, stderr)."""
    with open(os.path.join(src, "config.json")) as f:
        original = f.read()
    try:
        _edit(src, **changes)
        rc, _, err = _import(src, str(tmp_path / "x"))
    finally:
        with open(os.path.join(src, "config.json"), "w") as f:
            f.write(original)
    return rc, err


@pytest.mark.parametrize("name, changes, message", [
    # a window on some layers only, in no pattern megalite has (every layer, or all but every N-th)
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=8, layer_types=["full_attention", "sliding_attention"]),
     "qwen2_moe sliding_window=8 on layers [1] only: megalite windows every layer or all but every N-th"),
    ("qwen2_moe", dict(layer_types=["sliding_attention", "full_attention"]),
     "qwen2_moe layer_types ['full_attention', 'sliding_attention'] without a sliding_window megalite can read"),
    ("gpt2", dict(scale_attn_weights=False), "GPT-2 scale_attn_weights=False"),
    ("gpt2", dict(add_cross_attention=True), "GPT-2 add_cross_attention=True"),
    ("llama", dict(logit_softcapping=30.0), "field logit_softcapping=30.0 not represented"),
    ("llama", dict(rope_parameters={"partial_rotary_factor": 0.5}), "rope_parameters.partial_rotary_factor=0.5"),
    ("llama", dict(quantization_config={"quant_method": "fp8"}), "quantization_config.quant_method='fp8'"),
    ("llama", dict(rope_parameters={"rope_type": "longrope"}), "llama rope scaling 'longrope' is not implemented"),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}),
     "llama rope scaling 'llama3' without low_freq_factor, high_freq_factor, original_max_position_embeddings"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias=True"),
    ("qwen3", dict(attention_bias=True), "Qwen3 attention_bias=True"),
    ("llama", dict(model_type="olmo2"), "'olmo2' (LlamaForCausalLM) is not one megalite converts; the nearest it "
                                        "has is qwen3"),
    ("gemma", dict(hidden_act="relu"), "Gemma hidden_act='relu': megalite's GeGLU is the tanh GeLU's"),
    ("phi3", dict(rope_parameters={"rope_type": "longrope"}), "phi3 rope scaling 'longrope' is not implemented"),
])
def test_a_field_megalite_does_not_represent_is_one_line_naming_it(name, changes, message, saved, tmp_path):
    rc, err = _refused(saved[name], tmp_path, **changes)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_gemmas_released_configs_say_gelu_and_mean_tanh(saved, tmp_path):
    """The official Gemma files carry hidden_act "gelu" (and older ones hidden_activation "gelu_pytorch_tanh"):
    transformers reads the tanh GeLU, and so does the import (the same logits)."""
    src = saved["gemma"]
    with open(os.path.join(src, "config.json")) as f:
        original = f.read()
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    _, ref = hf_logits(src, tokens)
    try:
        for n, changes in enumerate((dict(hidden_act="gelu"), dict(hidden_act="gelu",
                                                                   hidden_activation="gelu_pytorch_tanh"))):
            _edit(src, **changes)
            rc, _, err = _import(src, str(tmp_path / f"m{n}"))
            assert rc == 0, err
            ours = megalite_logits(str(tmp_path / f"m{n}"), tokens)
            assert (ours - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item()), changes
    finally:
        with open(os.path.join(src, "config.json"), "w") as f:
            f.write(original)


def test_llama3_rope_scaling_is_what_the_logits_need(saved, tmp_path):
    """The imported model without its rope scaling is another model (the check above can see it), and Megatron,
    whose band and original context are fixed (1, 4, 8192), is not written this one."""
    import test_checkpoint_hf
    mine = str(tmp_path / "m")
    assert _import(saved["llama3_1"], mine)[0] == 0
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    _, ref = hf_logits(saved["llama3_1"], tokens)
    original = test_checkpoint_hf.config_for_one_process
    unscaled = (lambda cfg: dataclasses.replace(original(cfg), use_rope_scaling=False))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_checkpoint_hf, "config_for_one_process", unscaled)
        off = megalite_logits(mine, tokens)
    assert (off - ref).abs().max().item() > 1e-3 * ref.abs().max().item()
    rc, _, err = convert("--loader", "megalite", "--saver", "megatron", "--load-dir", mine,
                         "--save-dir", str(tmp_path / "mg"))
    assert rc != 0 and "Megatron's are fixed at (1.0, 4.0, 8192)" in err, err


def test_a_llama_exports_as_mistral_on_asking_and_nothing_else(saved, tmp_path):
    """--hf-architecture: a class that holds the same models (Mistral without a window holds Llama's), with
    transformers' logits; one that does not, one line."""
    mine, out = str(tmp_path / "m"), str(tmp_path / "mistral")
    assert _import(saved["llama"], mine)[0] == 0
    assert convert("--loader", "megalite", "--saver", "hf", "--load-dir", mine, "--save-dir", out,
                   "--hf-architecture", "MistralForCausalLM")[0] == 0
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    model, got = hf_logits(out, tokens)
    _, ref = hf_logits(saved["llama"], tokens)
    assert type(model).__name__ == "MistralForCausalLM" and torch.equal(got, ref)
    for asked, says in (("Qwen2ForCausalLM", "--hf-architecture Qwen2ForCausalLM cannot hold this model: it is a "
                                             "LlamaForCausalLM (or MistralForCausalLM)"),):
        rc, _, err = convert("--loader", "megalite", "--saver", "hf", "--load-dir", mine, "--save-dir",
                             str(tmp_path / "x"), "--hf-architecture", asked)
        assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err
    rc, _, err = convert("--loader", "megalite", "--saver", "megalite", "--load-dir", mine, "--save-dir",
                         str(tmp_path / "y"), "--hf-architecture", "MistralForCausalLM")
    assert rc == 2 and "--hf-architecture is --saver hf's; drop it for --saver megalite" in err, err


def test_a_training_setting_is_named_not_carried(saved, tmp_path):
    src = saved["llama"]
    with open(os.path.join(src, "config.json")) as f:
        original = f.read()
    try:
        _edit(src, attention_dropout=0.1)
        rc, out, err = _import(src, str(tmp_path / "m"))
    finally:
        with open(os.path.join(src, "config.json"), "w") as f:
            f.write(original)
    assert rc == 0, err
    assert "attention_dropout=0.1 (set --attention-dropout)" in out


def test_a_bf16_run_exports_its_fp32_main_weights_on_asking(tmp_path):
    """A --bf16 run's checkpoint holds bf16 model weights and the optimizer's fp32 main weights: by default the
    export writes the bf16 ones and says so; --hf-dtype float32 writes the fp32 main weights, bit for bit."""
    from megalite.checkpoint.convert import Reader, find_checkpoint
    from test_checkpoint import _train
    ckpt = str(tmp_path / "bf16")
    _train(["--bf16", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
            "--disable-bias-linear", "--save", ckpt, "--train-iters", "2"])
    rc, out, _ = convert("--loader", "megalite", "--saver", "hf", "--load-dir", ckpt, "--save-dir",
                         str(tmp_path / "half"))
    assert rc == 0 and "wrote the model's bfloat16 weights; --hf-dtype float32 writes the fp32 main weights" in out
    assert {t.dtype for t in tensors(str(tmp_path / "half")).values()} == {torch.bfloat16}
    rc, out, err = convert("--loader", "megalite", "--saver", "hf", "--load-dir", ckpt, "--save-dir",
                           str(tmp_path / "full"), "--hf-dtype", "float32")
    assert rc == 0 and "wrote float32 weights from the optimizer's fp32 main weights" in out, err
    main = Reader(find_checkpoint(ckpt)[0])
    got = tensors(str(tmp_path / "full"))
    assert torch.equal(got["model.norm.weight"], main.get("optimizer.main_param.decoder.final_layernorm.weight"))
    assert torch.equal(got["model.embed_tokens.weight"], main.get("optimizer.main_param.embedding.word_embeddings."
                                                                  "weight"))  # (the parity model's 128: no padding)
    with open(os.path.join(str(tmp_path / "full"), "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "float32"


def test_a_trained_import_exports_back_as_its_class(saved, tmp_path):
    """A Mistral imported, trained (its checkpoints carry the class it came from, read from --load's) and trained
    again from those: exported without --hf-architecture, it goes back as MistralForCausalLM, not Llama."""
    from test_checkpoint import _train
    ck, first, second = (str(tmp_path / n) for n in ("imported", "first", "second"))
    assert _import(saved["mistral"], ck)[0] == 0
    flags = ["--use-checkpoint-args", "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "1"]
    _train(["--load", ck, "--finetune", "--save", first, "--train-iters", "2", "--exit-interval", "1"] + flags)
    _train(["--load", first, "--save", second, "--train-iters", "2"] + flags)
    rc, _, err = convert("--loader", "megalite", "--saver", "hf", "--load-dir", second, "--save-dir",
                         str(tmp_path / "hf"))
    assert rc == 0, err
    with open(os.path.join(str(tmp_path / "hf"), "config.json")) as f:
        assert json.load(f)["architectures"] == ["MistralForCausalLM"]
