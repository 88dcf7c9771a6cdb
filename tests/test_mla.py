"""Multi-latent attention (megalite/transformer/mla.py) and its rotary tables (megalite/transformer/yarn.py).

- YaRN frequencies, correction range and mscale against the formulas in float64; --rope-type rope is
  megalite's interleaved rope;
- one MLA layer (with and without --q-lora-rank and --qk-layernorm, yarn and rope, v_head_dim != the
  qk dims) against a float64 re-implementation that rotates Megatron's way (de-interleave, then rotate
  halves), forward and gradients;
- one spawn of 4 CPU ranks: parity of TP2+SP x DP2, PP2 x DP2 (ZeRO-3, selective recompute; and bf16),
  TP2+SP x PP2 and TP2 x DP2 ZeRO-1 (no SP) against the single process (tests/support/parity.py: DESIGN's fp32
  bound, its measured bf16 bounds), two faults the parity must catch, and the TP2 layout's checkpoint
  loaded at TP1 giving the same logits (and resharded offline).
"""

import math
import os

import pytest
import torch
import torch.distributed as dist

import kernels
import pretrain_gpt
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.checkpoint.convert import Reader, find_checkpoint, reshard
from megalite.checkpoint.hf_convert import export_hf
from megalite.checkpoint.storage import CheckpointError
from megalite.config import ModelConfig
from megalite.tensor_parallel import model_parallel_manual_seed
from megalite.training import pretrain
from megalite.transformer import mla as mla_module
from megalite.transformer.attention import core_attention
from megalite.transformer.mla import MLASelfAttention
from megalite.transformer.rope import rotary_cos_sin
from megalite.transformer.yarn import mla_rotary_cos_sin, mla_softmax_scale, yarn_inv_freq
from parity import BASE, MB2, VOCAB, layout, learnable_datasets, patched, reference, run_layouts
from parity_check import assert_parity, mismatches

SIZES = ("--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "12")
# q latent + its norm, YaRN with a scaling factor and both mscales (concentration and softmax scale != 1)
MLA = MB2 + ("--multi-latent-attention", "--q-lora-rank", "24", *SIZES, "--qk-layernorm", "--normalization", "RMSNorm",
       "--rotary-scaling-factor", "4", "--mscale", "1.0", "--mscale-all-dim", "0.8", "--disable-bias-linear",
       "--untie-embeddings-and-output-weights")
# queries straight from the hidden state, plain rope (no learned positions), biased output projection, tied
MLA_ROPE = MB2 + ("--multi-latent-attention", *SIZES, "--rope-type", "rope", "--position-embedding-type", "rope")


# -- (a) rotary tables -------------------------------------------------------------------------
def _yarn_f64(dim, base, s, l0, fast, slow):
    f = [base ** (-2 * i / dim) for i in range(dim // 2)]
    at = [dim * math.log(l0 / (r * 2 * math.pi)) / (2 * math.log(base)) for r in (fast, slow)]
    lo, hi = max(math.floor(at[0]), 0), min(math.ceil(at[1]), dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = [min(max((i - lo) / (hi - lo), 0.0), 1.0) for i in range(dim // 2)]
    return torch.tensor([fi / s * r + fi * (1 - r) for fi, r in zip(f, ramp)], dtype=torch.float64)


def _m(s, k):
    return 1.0 if s <= 1 else 0.1 * k * math.log(s) + 1.0


@pytest.mark.parametrize("dim,base,s,l0,fast,slow", [(64, 10000, 40, 4096, 32, 1), (8, 10000, 4, 4096, 32, 1),
                                                     (16, 500000, 8, 8192, 16, 2), (4, 10000, 1, 4096, 32, 1)])
def test_yarn_frequencies_match_the_formula(dim, base, s, l0, fast, slow):
    got = yarn_inv_freq(dim, base, s, l0, fast, slow)
    want = _yarn_f64(dim, base, s, l0, fast, slow)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, rtol=1e-6, atol=0), (got, want)
    if s > 1:  # the slowest dims are interpolated by s, the fastest kept
        assert math.isclose(got[-1].item() * s, base ** (-(dim - 2) / dim), rel_tol=1e-5) and got[0] == 1.0


def test_mla_tables_carry_the_concentration_and_the_softmax_scale_its_square():
    c = ModelConfig(multi_latent_attention=True, qk_head_dim=8, qk_pos_emb_head_dim=8, rotary_scaling_factor=40,
                    mscale=1.0, mscale_all_dim=0.5, seq_length=37)
    assert c.rope_type == "yarn"  # Megatron's MLA default when --rope-type is absent
    cos, sin = mla_rotary_cos_sin(c, 37, "cpu")
    angles = torch.outer(torch.arange(37, dtype=torch.float64), _yarn_f64(8, 10000, 40, 4096, 32, 1))
    angles = angles.repeat_interleave(2, dim=-1)  # pairs (2j, 2j+1) turn by frequency j
    conc = _m(40, 1.0) / _m(40, 0.5)
    assert abs(conc - 1) > 0.1
    assert torch.allclose(cos.double(), angles.cos() * conc, atol=2e-5) and \
        torch.allclose(sin.double(), angles.sin() * conc, atol=2e-5)
    assert math.isclose(mla_softmax_scale(c), _m(40, 0.5) ** 2 / math.sqrt(16), rel_tol=1e-12)
    plain = ModelConfig(multi_latent_attention=True, qk_pos_emb_head_dim=8, rope_type="rope", rotary_percent=0.5,
                        rotary_scaling_factor=40, mscale_all_dim=0.5)
    want = rotary_cos_sin(5, 4, 10000.0, "cpu", interleaved=True)  # megalite's rope on the first 4 dims
    assert all(torch.equal(a, b) for a, b in zip(mla_rotary_cos_sin(plain, 5, "cpu"), want))
    assert math.isclose(mla_softmax_scale(plain), _m(40, 0.5) ** 2 / math.sqrt(128 + 8))  # as Megatron: rope too


# -- (b) one layer against float64 formulas ---------------------------------------------------
def _norm64(x, w, b, kind):
    if kind == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, 1e-5)


def _rope_megatron64(t, cos, sin):
    """Megatron's MLA rotation: the rotated dims de-interleaved (evens, odds), then rotate-half."""
    rot = cos.shape[-1]
    r, rest = t[..., :rot], t[..., rot:]
    r = torch.cat([r[..., 0::2], r[..., 1::2]], dim=-1)
    half = torch.cat([-r[..., rot // 2:], r[..., :rot // 2]], dim=-1)
    c, s = (torch.cat([x[:, 0::2], x[:, 0::2]], dim=-1)[:, None] for x in (cos, sin))  # [s, 1, rot]
    return torch.cat([r * c + half * s, rest], dim=-1)


def _mla64(c, p, x, cos, sin):
    """The layer's formulas in float64: x [s, h] (batch 1) -> output before the bias."""
    n, dn, dr, dv = c.num_attention_heads, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
    if c.q_lora_rank is None:
        q = x @ p["linear_q_proj.weight"].T
    else:
        lat = x @ p["linear_q_down_proj.weight"].T
        if c.qk_layernorm:
            lat = _norm64(lat, p["q_layernorm.weight"], p.get("q_layernorm.bias"), c.normalization)
        q = lat @ p["linear_q_up_proj.weight"].T
    ckv = x @ p["linear_kv_down_proj.weight"].T
    lat, kr = ckv[:, :c.kv_lora_rank], ckv[:, c.kv_lora_rank:]
    if c.qk_layernorm:
        lat = _norm64(lat, p["kv_layernorm.weight"], p.get("kv_layernorm.bias"), c.normalization)
    kv = (lat @ p["linear_kv_up_proj.weight"].T).view(-1, n, dn + dv)
    q = q.view(-1, n, dn + dr)
    q = torch.cat([q[..., :dn], _rope_megatron64(q[..., dn:], cos, sin)], dim=-1)
    kr = _rope_megatron64(kr[:, None, :], cos, sin).expand(-1, n, -1)  # one rotary key for every head
    k, v = torch.cat([kv[..., :dn], kr], dim=-1), kv[..., dn:]
    m = _m(c.rotary_scaling_factor, c.mscale_all_dim)  # for rope too (as Megatron)
    scores = torch.einsum("qhd,khd->hqk", q, k) * m * m / math.sqrt(dn + dr)
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    ctx = torch.einsum("hqk,khd->qhd", probs, v).reshape(x.shape[0], n * dv)
    return ctx @ p["linear_proj.weight"].T


def _tables64(c, seq):
    if c.rope_type == "rope":
        rot = int(c.qk_pos_emb_head_dim * c.rotary_percent)
        f = torch.tensor([c.rotary_base ** (-2 * i / rot) for i in range(rot // 2)], dtype=torch.float64)
        conc = 1.0
    else:
        f = _yarn_f64(c.qk_pos_emb_head_dim, c.rotary_base, c.rotary_scaling_factor, 4096, 32, 1)
        conc = _m(c.rotary_scaling_factor, c.mscale) / _m(c.rotary_scaling_factor, c.mscale_all_dim)
    ang = torch.outer(torch.arange(seq, dtype=torch.float64), f).repeat_interleave(2, dim=-1)
    return ang.cos() * conc, ang.sin() * conc


LAYER_CASES = {
    "q_lora_rmsnorm_yarn": dict(q_lora_rank=24, qk_layernorm=True, normalization="RMSNorm", rotary_scaling_factor=4.0,
                                mscale=1.0, mscale_all_dim=0.8),
    "q_lora_layernorm_no_norms": dict(q_lora_rank=20, rotary_scaling_factor=40.0, mscale=0.7, mscale_all_dim=0.7),
    "q_lora_layernorm_latents": dict(q_lora_rank=20, qk_layernorm=True, rotary_scaling_factor=2.0, mscale=0.9),
    "q_proj_rope_half": dict(rope_type="rope", rotary_percent=0.5, qk_pos_emb_head_dim=8, rotary_scaling_factor=3.0,
                             mscale_all_dim=1.0),
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_one_layer_matches_the_formulas_in_float64(case):
    kw = dict(num_layers=2, hidden_size=40, num_attention_heads=5, seq_length=37, multi_latent_attention=True,
              kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=10, add_bias_linear=False,
              hidden_dropout=0.0, attention_dropout=0.0, seed=11)
    c = ModelConfig(**{**kw, **LAYER_CASES[case]})
    ps.initialize_model_parallel(1, 1)
    try:
        model_parallel_manual_seed(3)
        layer = MLASelfAttention(c, "decoder.layers.0.self_attention")
        g = torch.Generator().manual_seed(sum(map(ord, case)))
        with torch.no_grad():
            for name, prm in layer.named_parameters():
                if "layernorm" in name:  # norms away from their initial 1 / 0
                    prm.copy_(torch.randn(prm.shape, generator=g) * 0.3 + (0.0 if name.endswith("bias") else 1.0))
                else:
                    prm.mul_(torch.rand(prm.shape, generator=g) * 30)  # scores of a few units: softmax not flat
        x = torch.randn(37, 1, 40, generator=g, requires_grad=True)
        cos, sin = mla_rotary_cos_sin(c, 37, "cpu")
        out, bias = layer(x, (cos, sin))
        grad_out = torch.randn(out.shape, generator=g)
        (out * grad_out).sum().backward()
        p64 = {n: t.detach().double().requires_grad_(True) for n, t in layer.named_parameters()}
        x64 = x.detach().double()[:, 0].requires_grad_(True)
        want = _mla64(c, p64, x64, *_tables64(c, 37))
        (want * grad_out[:, 0].double()).sum().backward()
    finally:
        ps.destroy_model_parallel()
    assert bias is None
    names = {n for n, _ in layer.named_parameters()}
    assert ("linear_q_proj.weight" in names) == (c.q_lora_rank is None)
    assert ("q_layernorm.weight" in names) == ("kv_layernorm.weight" in names) == c.qk_layernorm
    assert torch.isfinite(out).all() and want.abs().max() > 1
    assert torch.allclose(out[:, 0].double(), want, rtol=0, atol=2e-5 * want.abs().max().item()), \
        (out[:, 0].double() - want).abs().max()
    grads = [("x", x.grad[:, 0], x64.grad)] + [(n, prm.grad, p64[n].grad) for n, prm in layer.named_parameters()]
    for name, got, ref in grads:
        assert ref.abs().max() > 0, name
        assert torch.allclose(got.double(), ref, rtol=0, atol=5e-5 * ref.abs().max().item()), \
            (case, name, (got.double() - ref).abs().max().item(), ref.abs().max().item())


def _refusal(argv, capsys, world_size=2):
    with pytest.raises(SystemExit):
        parse_args(list(BASE) + argv, world_size=world_size)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("megalite: error (rank 0): "), lines
    return lines[0]


@pytest.mark.parametrize("dq,dv", [(12, 8), (8, 12)])
@pytest.mark.parametrize("path", ["flash", "unfused_masked", "sdpa"])
def test_core_attention_takes_another_value_head_dim_and_a_softmax_scale(path, dq, dv):
    """The flash kernel (Triton, interpreted here; zero-padded heads), the unfused softmax (a mask: the
    GPU's path for document masks) and SDPA against float64, forward and backward."""
    g = torch.Generator().manual_seed(dq * 100 + dv)
    b, s, h, scale = 2, 19, 3, 0.41
    q, k = (torch.randn(b, s, h, dq, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(b, s, h, dv, generator=g, requires_grad=True)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None].expand(b, 1, s, s) if path == "unfused_masked" \
        else None
    ps.initialize_model_parallel(1, 1)
    try:
        model_parallel_manual_seed(5)
        with kernels.use_backend("torch" if path == "sdpa" else "triton"):
            out = core_attention(q, k, v, 0.0, True, True, attn_mask=mask, softmax_scale=scale)
    finally:
        ps.destroy_model_parallel()
    grad = torch.randn(out.shape, generator=g)
    (out * grad).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    probs = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    want = torch.einsum("bhqk,bkhd->bqhd", probs, v64)
    (want * grad.double()).sum().backward()
    assert (out.shape == (b, s, h, dv)
            and torch.allclose(out.double(), want, atol=2e-5)), (out.double() - want).abs().max()
    for got, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert torch.allclose(got.double(), ref, atol=5e-5), (got.double() - ref).abs().max()


def test_mla_flags_and_refusals_are_one_line_each(capsys):
    args = parse_args(list(BASE) + list(MLA), world_size=1)
    assert args.multi_latent_attention and args.q_lora_rank == 24 and args.rope_type is None
    plain = parse_args(list(BASE) + ["--multi-latent-attention"], world_size=1)  # Megatron's flag defaults
    assert (plain.q_lora_rank, plain.kv_lora_rank, plain.qk_head_dim, plain.qk_pos_emb_head_dim, plain.v_head_dim,
            plain.rotary_scaling_factor, plain.mscale, plain.mscale_all_dim) == (None, 32, 128, 64, 128, 1.0, 1.0, 0.0)
    for extra, words in ((["--group-query-attention", "--num-query-groups", "2"], "exclusive"),
                         (["--qk-layernorm"], "needs --q-lora-rank"),
                         (["--rotary-interleaved"], "--rotary-interleaved does not work"),
                         (["--qk-pos-emb-head-dim", "3"], "rotary dim of 3"),
                         (["--tensor-model-parallel-size", "2", "--num-attention-heads", "3", "--hidden-size", "33"],
                          "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"),
                         (["--experimental-attention-variant", "gdn"], "gdn is not implemented in megalite")):
        assert words in _refusal(["--multi-latent-attention"] + extra, capsys), extra
    assert "yarn is for --multi-latent-attention" in _refusal(["--rope-type", "yarn"], capsys)


# -- (c) parity and (d) checkpoints, one spawn ------------------------------------------------
def kv_down_proj_grads_not_summed():
    """The replicated down projections left unmarked: under SP each TP rank keeps its sequence slice's
    partial gradient."""
    original = mla_module.DuplicatedLinear.__init__

    def init(self, *a, **k):
        original(self, *a, **k)
        self.weight.sequence_parallel = False
    return patched(mla_module.DuplicatedLinear, "__init__", init)


def shared_key_grads_not_summed():
    """Without SP, the shared rotary key's gradient kept per rank's heads (not summed over TP): what a
    replicated down projection gives when nothing reduces it."""
    original = mla_module.MLASelfAttention._shared_rotary_key

    def plain(self, k_pe):
        return k_pe if not self.config.sequence_parallel else original(self, k_pe)
    return patched(mla_module.MLASelfAttention, "_shared_rotary_key", plain)


LAYOUTS = [
    layout("tp2_sp_dp2", tp=2, sp=True, dp=2, model=MLA),
    layout("pp2_dp2_zero3_selective_recompute", pp=2, dp=2, zero=3, recompute="selective", model=MLA),
    layout("tp2_sp_pp2", tp=2, sp=True, pp=2, model=MLA),
    layout("tp2_dp2_zero1_rope", tp=2, dp=2, zero=1, model=MLA_ROPE),
    layout("pp2_dp2_bf16", pp=2, dp=2, dtype="bf16", model=MLA),  # the functional configs' dtype (PP: exact bound)
]
FAULTS = [
    layout("fault_down_proj_unmarked", tp=2, sp=True, dp=2, model=MLA, fault=kv_down_proj_grads_not_summed),
    layout("fault_shared_key_not_summed", tp=2, dp=2, model=MLA_ROPE, fault=shared_key_grads_not_summed),
]
PROBE = torch.arange(2 * 16).reshape(2, 16) % VOCAB  # the ids the logits are compared on


def _logits(chunks, opt):
    """Full-vocabulary logits of PROBE after training, where one chunk holds the whole model (PP 1)."""
    if ps.get_pipeline_model_parallel_world_size() > 1:
        return None
    model = chunks[0].module
    model.eval()
    with torch.no_grad():
        local = model(PROBE)
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., :VOCAB]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("mla") / "tp2")
    saving = layout("tp2_sp_dp2", tp=2, sp=True, dp=2, model=MLA, flags=("--save", save))
    lays = [saving] + LAYOUTS[1:] + FAULTS
    return save, dict(zip([lay.name for lay in lays], run_layouts(lays, 4, collect=_logits, timeout=300)))


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.name)
def test_mla_layouts_match_the_single_process(world, lay):
    assert_parity(lay, world[1][lay.name])


@pytest.mark.parametrize("lay", FAULTS, ids=lambda lay: lay.name)
def test_faults_are_caught(world, lay):
    bad = mismatches(lay, world[1][lay.name], reference(lay))
    assert any("grad" in m for m in bad), f"{lay.name} went unseen"


def test_tp2_checkpoint_loads_at_tp1_with_the_same_logits(world, tmp_path, capsys):
    """The TP2 + SP checkpoint of the trained model: loaded by a single process (TP1), the logits are the
    TP2 model's; resharded offline to TP2 the up projections are split in two, the replicated down
    projections and latent norms stored whole, and every tensor is unchanged."""
    save, ranks = world
    want = ranks["tp2_sp_dp2"][0]["collected"]
    args = parse_args(list(BASE) + list(MLA) + ["--load", save, "--use-checkpoint-opt_param-scheduler"], world_size=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        losses, chunks, _ = pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args,
                                     return_state=True)
        assert losses == []  # loaded at the last iteration: nothing trained
        model = chunks[0].module
        model.eval()
        with torch.no_grad():
            got = model(PROBE)[..., :VOCAB]
    finally:
        ps.destroy_model_parallel()
        torch.set_num_threads(threads)
    assert want.abs().max() > 1 and (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
    with pytest.raises(SystemExit):  # the MLA sizes are checked against the checkpoint's, in one line
        other = parse_args(list(BASE) + list(MLA) + ["--load", save, "--kv-lora-rank", "8"], world_size=1)
        try:
            pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, other)
        finally:
            ps.destroy_model_parallel()
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "kv_lora_rank=16" in err[0] and "kv_lora_rank=8" in err[0], err
    with pytest.raises(CheckpointError, match="DeepseekV3ForCausalLM cannot represent"):  # (a dense MLA GPT)
        export_hf(save, str(tmp_path / "hf"))
    out = str(tmp_path / "resharded")
    reshard(save, out, tp=2, pp=1)
    a, b = Reader(find_checkpoint(save)[0]), Reader(find_checkpoint(out)[0])
    layer = "decoder.layers.1.self_attention."
    chunks_of = {n: len(b.index[n]["chunks"]) for n in b.names() if n.startswith(layer)}
    assert chunks_of == {layer + "linear_q_down_proj.weight": 1, layer + "q_layernorm.weight": 1,
                         layer + "linear_q_up_proj.weight": 2, layer + "linear_kv_down_proj.weight": 1,
                         layer + "kv_layernorm.weight": 1, layer + "linear_kv_up_proj.weight": 2,
                         layer + "linear_proj.weight": 2}, chunks_of
    assert sorted(a.names()) == sorted(b.names())
    for n in a.names():
        assert torch.equal(a.get(n), b.get(n)), n


def test_generation_with_the_kv_cache_equals_full_recompute(world):
    """Incremental decoding (rotary tables sliced at each step's positions, keys of dn + dr dims and values
    of dv cached) samples what recomputing the whole sequence samples, from the TP2 checkpoint at TP1."""
    import importlib.util
    from megalite.models.generation import generate
    spec = importlib.util.spec_from_file_location("generate_tool", os.path.join(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))), "tools", "generate.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    model, _ = tool.load_model(world[0], 1)
    try:
        prompt = torch.tensor([[3, 9, 14, 1], [1, 14, 9, 3]])
        cached, full = (generate(model, prompt, 10, VOCAB, use_cache=c, greedy=True).tolist() for c in (True, False))
    finally:
        ps.destroy_model_parallel()
    assert cached == full and len(cached[0]) == 14, (cached, full)
