"""Megatron's model flags: --qk-layernorm, --apply-layernorm-1p, --rotary-percent,
--rotary-interleaved, --squared-relu, and the run flags --deterministic-mode / --use-flash-attn. Parity against one
process through the
harness (tests/support/parity.py); the pieces against direct formulas."""

import pytest
import torch

import kernels
import pretrain_gpt
from cli_batch import convert
from dist_util import rel_err
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.models import GPTModel
from megalite.tensor_parallel import model_parallel_manual_seed
from megalite.training import pretrain
from megalite.transformer.norm import LayerNorm, RMSNorm
from megalite.transformer.rope import apply_rotary, rotary_cos_sin
from model_util import batch, tiny_config
from parity import BASE, LLAMA, check_reference, layout, learnable_datasets, reference, run_layouts
from parity_check import assert_parity

NEW = ("--qk-layernorm", "--apply-layernorm-1p", "--rotary-percent", "0.5")
ROPE_LN = ("--position-embedding-type", "rope")


@pytest.fixture(scope="module")
def runs():
    lays = [layout("tp2_sp_pp2_llama_qk_1p_rot50", tp=2, pp=2, sp=True, model=LLAMA + NEW),
            layout("tp2_sp_pp2_layernorm_qk_1p_rot50_interleaved_relu2", tp=2, pp=2, sp=True,
                   model=ROPE_LN + NEW + ("--rotary-interleaved", "--squared-relu",
                                          # (tied: the last stage's output-layer copy drawn as the embedding)
                                          "--embedding-init-method-std", "0.05")),
            # Gemma's options: the embeddings times a multiplier (the first stage's), the gated MLP's tanh GeLU
            layout("tp2_sp_pp2_gemma_geglu_embedding_multiplier", tp=2, pp=2, sp=True,
                   model=LLAMA + ("--geglu", "--embedding-multiplier", "5.0", "--apply-layernorm-1p")),
            # sliding-window attention, the window (3 keys back) under the sequence (16), every 2nd layer global
            layout("tp2_sp_pp2_llama_sliding_window_every_2nd_global", tp=2, pp=2, sp=True,
                   model=LLAMA + ("--window-size", "3,0", "--window-attn-skip-freq", "2"))]
    return lays, run_layouts(lays, 4)


@pytest.mark.parametrize("i", [0, 1], ids=["rmsnorm", "layernorm"])
def test_flags_match_single_process_at_tp2_sp_pp2(runs, i):
    """Every step-1 gradient (q/k norm weights summed over the TP ranks' heads included), grad
    norms, losses and parameters after 6 steps at rel <= 1e-5."""
    lays, results = runs
    ref = reference(lays[i])
    check_reference(ref)
    names = set(ref["grads"])
    assert {"decoder.layers.0.self_attention.q_layernorm.weight",
            "decoder.layers.3.self_attention.k_layernorm.weight"} <= names
    assert float(ref["params"]["decoder.layers.0.self_attention.q_layernorm.weight"].abs().max()) > 0  # it trains
    assert_parity(lays[i], results[i])


@pytest.mark.parametrize("i", [2, 3], ids=["gemma", "sliding_window"])
def test_gemma_and_window_options_match_single_process_at_tp2_sp_pp2(runs, i):
    lays, results = runs
    check_reference(reference(lays[i]))
    assert_parity(lays[i], results[i])


def test_embedding_init_method_std_draws_the_embeddings_only(grid):
    """--embedding-init-method-std (Megatron's): the word and position embeddings drawn at that std, every other
    weight as without it, bit for bit."""
    from megalite.cli.parser import model_config
    plain, wide = (GPTModel(model_config(parse_args(list(BASE) + extra, world_size=1), 128)).state_dict()
                   for extra in ([], ["--embedding-init-method-std", "0.5"]))
    emb = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
    for name in emb:  # (the same draws, scaled: 0.5 / 0.02)
        torch.testing.assert_close(wide[name], plain[name] * 25.0, rtol=1e-6, atol=0)
    assert all(torch.equal(wide[n], p) for n, p in plain.items() if n not in emb)


def test_gemma_options_are_what_they_say(grid):
    """--geglu: fc2(gelu_tanh(gate) * up); --embedding-multiplier: the embedding output scaled, nothing else."""
    from megalite.moe.activation import activation
    from megalite.cli.parser import model_config
    c = model_config(parse_args(list(BASE) + list(LLAMA) + ["--geglu"], world_size=1), 128)
    assert c.swiglu and c.geglu
    h = torch.randn(3, 2, 16)
    gate, up = h.chunk(2, dim=-1)
    assert torch.equal(activation(c, h), torch.nn.functional.gelu(gate, approximate="tanh") * up)
    ids = torch.randint(0, 128, (2, 8))
    plain, scaled = (GPTModel(model_config(parse_args(list(BASE) + list(LLAMA) + extra, world_size=1), 128))
                     for extra in ([], ["--embedding-multiplier", "3.0"]))
    scaled.load_state_dict(plain.state_dict())
    assert torch.equal(scaled.embedding.embed(ids), plain.embedding.embed(ids) * 3.0)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_zero_centered_norm_is_one_plus_weight(cls):
    x = torch.randn(5, 3, 24, dtype=torch.float64)
    w = torch.randn(24, dtype=torch.float64) * 0.1
    one_p = cls(24, fused=False, dtype=torch.float64, zero_centered=True)
    plain = cls(24, fused=False, dtype=torch.float64)
    assert float(one_p.weight.detach().abs().max()) == 0.0  # starts at gamma = 1
    with torch.no_grad():
        one_p.weight.copy_(w)
        plain.weight.copy_(1 + w)
        if cls is LayerNorm:
            plain.bias.copy_(one_p.bias)
    torch.testing.assert_close(one_p(x), plain(x), rtol=0, atol=1e-12)


def test_rotary_percent_on_the_kernel_path():
    """The Triton rotary (interpreter on CPU) gets the whole head and rotates only cos's dims."""
    x = torch.randn(2, 7, 3, 20, requires_grad=True)
    cos, sin = rotary_cos_sin(7, 10, 10000.0, "cpu")
    with kernels.use_backend("triton"):
        out = apply_rotary(x, cos, sin, fused=True)
    ref = apply_rotary(x, cos, sin)
    # x * cos + rot(x) * sin in fp32 both ways; they may differ only by FMA contraction, one
    # rounding of a product (<= u |x| = 2e-7 for |x| < 4)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(out)
    dx, = torch.autograd.grad(out, x, g)
    dref, = torch.autograd.grad(ref, x, g)
    torch.testing.assert_close(dx, dref, rtol=1e-6, atol=1e-6)
    assert torch.equal(dx[..., 10:], g[..., 10:])


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_gpt_triton_path_with_the_flags(flavour):
    """The model's kernel path (norm kernels given 1 + w, q/k norms, partial rotary) against its
    torch path: loss and every gradient."""
    def run(backend):
        ps.initialize_model_parallel(1, 1)
        try:
            model_parallel_manual_seed(3)
            cfg = tiny_config(flavour, hidden_size=64, position_embedding_type="rope", qk_layernorm=True,
                              apply_layernorm_1p=True, rotary_percent=0.5)
            model = GPTModel(cfg)
            with torch.no_grad():  # move the norm weights off 0 so 1 + w is tested, not 1
                for n, p in model.named_parameters():
                    if "layernorm" in n:
                        p.uniform_(-0.5, 0.5)
            ids, labels = batch(cfg)
            with kernels.use_backend(backend):
                loss = model(ids, labels=labels).mean()
                loss.backward()
            return loss.detach(), {n: p.grad for n, p in model.named_parameters()}
        finally:
            ps.destroy_model_parallel()
    ref_loss, ref = run("torch")
    loss, grads = run("triton")
    assert "decoder.layers.1.self_attention.k_layernorm.weight" in grads
    errs = {"loss": rel_err(loss, ref_loss), **{n: rel_err(grads[n], ref[n]) for n in ref}}
    bad = {k: v for k, v in errs.items() if not v <= 1e-5}
    assert not bad, bad


def test_rotary_percent_rotates_the_head_dims_only():
    x = torch.randn(2, 7, 3, 16)
    cos, sin = rotary_cos_sin(7, 8, 10000.0, "cpu")  # 50% of 16 dims
    out = apply_rotary(x, cos, sin)  # fp32 arithmetic
    assert torch.equal(out[..., 8:], x[..., 8:])
    h = x[..., :8].double()
    c, s = cos[None, :, None].double(), sin[None, :, None].double()
    expected = h * c + torch.cat([-h[..., 4:], h[..., :4]], dim=-1) * s
    # fp32 against float64 with the same fp32 cos/sin: two products and a sum, <= 2u (|h| + |r|)
    # = 8e-7 for |x| < 3.5 (randn over 672 values)
    torch.testing.assert_close(out[..., :8].double(), expected, rtol=0, atol=1e-6)


def test_rotary_interleaved_rotates_adjacent_pairs():
    """Dims 2i and 2i+1 turn together by frequency i (Megatron's --rotary-interleaved), float64
    formula against the fp32 path; the fused flag keeps it in torch (the kernel is rotate-half)."""
    x = torch.randn(2, 7, 3, 16)
    cos, sin = rotary_cos_sin(7, 8, 10000.0, "cpu", interleaved=True)  # 50% of 16 dims
    assert torch.equal(cos[:, 0::2], cos[:, 1::2])
    out = apply_rotary(x, cos, sin, fused=True, interleaved=True)
    assert torch.equal(out[..., 8:], x[..., 8:])
    h, c, s = x[..., :8].double(), cos[None, :, None].double(), sin[None, :, None].double()
    expected = torch.empty_like(h)
    expected[..., 0::2] = h[..., 0::2] * c[..., 0::2] - h[..., 1::2] * s[..., 0::2]
    expected[..., 1::2] = h[..., 1::2] * c[..., 1::2] + h[..., 0::2] * s[..., 1::2]
    torch.testing.assert_close(out[..., :8].double(), expected, rtol=0, atol=1e-6)  # bound: see above
    half = apply_rotary(x, *rotary_cos_sin(7, 8, 10000.0, "cpu"))
    assert (half - out).abs().max() > 0.1  # a different rotation, not a relabelling of the same one
    from megalite.checkpoint.hf import _plain
    from megalite.checkpoint.storage import CheckpointError
    with pytest.raises(CheckpointError, match="LlamaForCausalLM cannot represent rotary_interleaved=True"):
        _plain({"rotary_interleaved": True}, "LlamaForCausalLM", ("qk_layernorm", "rotary_interleaved"))


def test_squared_relu_mlp_against_formula():
    """--squared-relu: fc2(relu(fc1(x) + b1)^2) + b2 against float64 (bound: fp32 rounding of
    sums of 32 and 128 terms of O(1) values, far under 1e-5); exclusive with --swiglu; no HF
    class of ours represents it."""
    from megalite.transformer.mlp import MLP
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    try:
        mlp = MLP(tiny_config("gpt2", squared_relu=True, init_method_std=0.3), "decoder.layers.0.mlp")
        x = torch.randn(7, 2, 32)
        out, bias = mlp(x)
        w1, b1 = mlp.linear_fc1.weight.double(), mlp.linear_fc1.bias.double()
        w2 = mlp.linear_fc2.weight.double()
        ref = torch.relu(x.double() @ w1.t() + b1).pow(2) @ w2.t()
        assert float((x.double() @ w1.t() + b1 < 0).float().mean()) > 0.2  # the ReLU cuts some
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        assert bias is not None and torch.equal(bias, mlp.linear_fc2.bias)
    finally:
        ps.destroy_model_parallel()
    from megalite.config import ConfigError
    with pytest.raises(ConfigError, match="--squared-relu and --swiglu are exclusive"):
        tiny_config("gpt2", squared_relu=True, swiglu=True)
    from megalite.checkpoint.hf import _plain
    from megalite.checkpoint.storage import CheckpointError
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel cannot represent squared_relu=True"):
        _plain({"squared_relu": True}, "GPT2LMHeadModel", ("qk_layernorm", "rotary_percent", "squared_relu"))


def test_qk_layernorm_normalizes_each_head(monkeypatch):
    """q and k reach core attention RMS-normalized per head (times 1 + w with 1p)."""
    from megalite.cli.parser import model_config
    from megalite.transformer import attention
    ps.initialize_model_parallel(1, 1)
    try:
        args = parse_args(list(BASE) + ["--normalization", "RMSNorm", "--qk-layernorm", "--apply-layernorm-1p"],
                          world_size=1)
        att = attention.SelfAttention(model_config(args, 128), "decoder.layers.0.self_attention").double()
        with torch.no_grad():
            att.q_layernorm.weight.uniform_(-0.5, 0.5)
        seen = {}
        real = attention.core_attention
        monkeypatch.setattr(attention, "core_attention", lambda q, k, v, *a: seen.update(q=q, k=k) or real(q, k, v, *a))
        x = torch.randn(16, 2, 32, dtype=torch.float64)
        att(x)
        qkv = att.linear_qkv(x).view(16, 2, 4, 3, 8).transpose(0, 1)
        q, k = qkv[:, :, :, 0], qkv[:, :, :, 1]

        def rms(t, w):
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + args.norm_epsilon) * (1 + w)
        torch.testing.assert_close(seen["q"], rms(q, att.q_layernorm.weight.detach()), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(seen["k"], rms(k, att.k_layernorm.weight.detach()), rtol=1e-10, atol=1e-12)
    finally:
        ps.destroy_model_parallel()


def _train(argv, model=LLAMA + NEW):
    args = parse_args(list(BASE) + list(model) + argv, world_size=1)
    try:
        return pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args,
                        return_state=True)
    finally:
        ps.destroy_model_parallel()
        torch.use_deterministic_algorithms(False)  # --deterministic-mode sets it process-wide


def test_checkpoint_round_trip_and_hf_refusal(tmp_path):
    """The new parameters save and load (a resumed run continues exactly), and the HF
    converter refuses what Qwen3 (Llama with q/k norms) cannot represent, in one line."""
    ckpt = str(tmp_path / "ckpt")
    straight = _train(["--train-iters", "4"])[0]
    _train(["--train-iters", "4", "--save", ckpt, "--exit-interval", "2"])
    resumed = _train(["--train-iters", "4", "--load", ckpt])[0]
    assert resumed == straight[2:]
    rc, _, err = convert("--loader", "megalite", "--saver", "hf", "--load-dir", ckpt,
                         "--save-dir", str(tmp_path / "hf"))
    assert rc != 0
    assert "Qwen3ForCausalLM cannot represent apply_layernorm_1p=True" in err, err


def test_deterministic_mode_repeats_bitwise():
    a, chunks_a, _ = _train(["--deterministic-mode", "--train-iters", "3"])
    b, chunks_b, _ = _train(["--deterministic-mode", "--train-iters", "3"])
    assert a == b
    for (n, p), (_, q) in zip(chunks_a[0].named_parameters(), chunks_b[0].named_parameters()):
        assert torch.equal(p, q), n


def test_layernorm_1p_exports_gamma_to_hf(tmp_path):
    """HF stores gamma = 1 + w: the exported model gives the megalite model's logits."""
    from test_checkpoint_hf import _tokens, hf_logits, megalite_logits
    for name, model in (("llama", LLAMA + ("--apply-layernorm-1p",)), ("gpt2", ("--apply-layernorm-1p",))):
        ckpt, hf = str(tmp_path / name), str(tmp_path / (name + "_hf"))
        _train(["--train-iters", "3", "--save", ckpt], model=model)
        rc, _, err = convert("--loader", "megalite", "--saver", "hf", "--load-dir", ckpt, "--save-dir", hf)
        assert rc == 0, err
        tokens = _tokens()
        ours = megalite_logits(ckpt, tokens)
        _, theirs = hf_logits(hf, tokens)
        torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("theta, factor, low, high, original", [(500000.0, 8.0, 1.0, 4.0, 8192),  # Llama 3.1
                                                                (500000.0, 32.0, 1.0, 4.0, 8192),  # Llama 3.2
                                                                (10000.0, 4.0, 2.0, 8.0, 64)])
def test_llama3_rope_scaling_is_transformers_formula(theta, factor, low, high, original):
    """--use-rope-scaling's frequencies against transformers' own llama3 rope (head dim 128): kept above the band,
    divided by the factor below it, blended inside it; fp32 on both sides, the same few operations."""
    transformers = pytest.importorskip("transformers", reason="the formula's reference is transformers' (the "
                                       "[test] extra installs it)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from megalite.transformer.rope import config_inv_freq, rope_inv_freq
    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original}
    hf = transformers.LlamaConfig(hidden_size=1024, num_attention_heads=8, head_dim=128, rope_parameters=rope)
    want, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    args = parse_args(list(BASE) + list(LLAMA) + ["--kv-channels", "128", "--rotary-base", str(theta),
                                                  "--use-rope-scaling", "--rope-scaling-factor", str(factor),
                                                  "--rope-scaling-low-freq-factor", str(low),
                                                  "--rope-scaling-high-freq-factor", str(high),
                                                  "--rope-scaling-original-max-position-embeddings", str(original)],
                      world_size=1)
    from megalite.cli.parser import model_config
    got = config_inv_freq(model_config(args, 128), 128)
    plain = rope_inv_freq(128, theta)
    assert attention_factor == 1.0  # (llama3 leaves the attention's scale alone, as megalite does)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    wavelength = 2 * torch.pi / plain
    short, long = wavelength < original / high, wavelength > original / low
    assert short.any() and long.any() and (~short & ~long).any()  # (every case has all three bands)
    assert torch.equal(got[short], plain[short]) and torch.equal(got[long], plain[long] / factor)


def test_rope_scaling_flags_refuse_in_one_line(capsys):
    for extra, says in ((("--use-rope-scaling",), "--use-rope-scaling (Llama 3.1's) scales rotary embeddings: it "
                                                  "needs --position-embedding-type rope"),
                        (LLAMA + ("--use-rope-scaling", "--rope-scaling-factor", "0.5"),
                         "--use-rope-scaling needs --rope-scaling-factor >= 1 (got 0.5)"),
                        # a band flag without the scaling would change nothing: refused, not ignored
                        (LLAMA + ("--rope-scaling-factor", "32"), "--rope-scaling-factor applies only with "
                                                                  "--use-rope-scaling"),
                        (LLAMA + ("--rope-scaling-original-max-position-embeddings", "4096"),
                         "--rope-scaling-original-max-position-embeddings applies only with --use-rope-scaling")):
        with pytest.raises(SystemExit):
            parse_args(list(BASE) + list(extra), world_size=1)
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
    args = parse_args(list(BASE) + list(LLAMA) + ["--use-rope-scaling"], world_size=1)  # Llama 3.1's defaults
    assert (args.rope_scaling_factor, args.rope_scaling_low_freq_factor, args.rope_scaling_high_freq_factor,
            args.rope_scaling_original_max_position_embeddings) == (8.0, 1.0, 4.0, 8192)
