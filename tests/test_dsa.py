"""DeepSeek sparse attention (megalite/transformer/dsa.py) on multi-latent attention.

- (a) one MLA + DSA layer against a float64 re-implementation of the formulas: the indexer's scores, the
  top-k set (topk < length: really sparse; topk >= length: the mask is causal and the output is dense
  MLA's, tests/test_mla.py's float64 layer), the indexer's KL loss and the layer's output;
- (b) gradients: the indexer loss reaches the indexer's parameters (= float64 autograd) and nothing else
  (x, the query latent and MLA's q, k are detached), and the main output's gradient does not reach the
  indexer; the flags, Megatron's defaults and the refusals, one line each;
- (c) one spawn of 4 CPU ranks: TP2+SP x DP2 and PP2 x DP2 training with DSA (topk 5 of 16 tokens)
  against the single process, and (d) two injected faults the parity must catch.
"""

import math

import pytest
import torch

from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.config import ModelConfig
from megalite.moe.aux_losses import set_aux_loss_scale
from megalite.tensor_parallel import model_parallel_manual_seed
from megalite.transformer import dsa as dsa_module
from megalite.transformer.dsa import index_scores
from megalite.transformer.mla import MLASelfAttention
from megalite.transformer.yarn import mla_rotary_cos_sin
from parity import BASE, MB2, layout, patched, reference, run_layouts
from parity_check import assert_parity, mismatches
from test_mla import MLA, _m, _mla64, _norm64, _tables64, _yarn_f64

DSA = ("--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "8", "--dsa-indexer-head-dim", "8",
       "--dsa-indexer-topk", "5", "--dsa-indexer-loss-coeff", "1")


# -- (a), (b) one layer against float64 formulas -----------------------------------------------
def _half_tables64(c, seq):
    """The indexer's rotary: MLA's frequencies and concentration, rotate-half layout."""
    if c.rope_type == "rope":
        rot = int(c.qk_pos_emb_head_dim * c.rotary_percent)
        f, conc = torch.tensor([c.rotary_base ** (-2 * i / rot) for i in range(rot // 2)], dtype=torch.float64), 1.0
    else:
        f = _yarn_f64(c.qk_pos_emb_head_dim, c.rotary_base, c.rotary_scaling_factor, 4096, 32, 1)
        conc = _m(c.rotary_scaling_factor, c.mscale) / _m(c.rotary_scaling_factor, c.mscale_all_dim)
    ang = torch.outer(torch.arange(seq, dtype=torch.float64), f)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos() * conc, ang.sin() * conc


def _rope_half64(t, cos, sin):
    rot = cos.shape[-1]
    r, rest = t[..., :rot], t[..., rot:]
    half = torch.cat([-r[..., rot // 2:], r[..., :rot // 2]], dim=-1)
    shape = (-1,) + (1,) * (t.dim() - 2) + (rot,)
    return torch.cat([r * cos.view(shape) + half * sin.view(shape), rest], dim=-1)


def _indexer64(c, p, x, lat, seq):
    """x [s, h], lat: the query latent [s, r] (x without --q-lora-rank) -> I [s, s]."""
    pre = "core_attention.indexer."
    H, d = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
    cos, sin = _half_tables64(c, seq)
    q = _rope_half64((lat @ p[pre + "linear_wq_b.weight"].T).view(seq, H, d), cos, sin)
    k = torch.nn.functional.layer_norm(x @ p[pre + "linear_wk.weight"].T, (d,), p[pre + "k_norm.weight"],
                                       p[pre + "k_norm.bias"], 1e-5)
    k = _rope_half64(k, cos, sin)
    w = (x @ p[pre + "linear_weights_proj.weight"].T) / math.sqrt(H * d)
    s = torch.einsum("qhd,kd->qhk", q, k)
    s = s.relu() if c.dsa_indexer_scoring_relu else s
    return (s * w[..., None]).sum(dim=1)


def _qk64(c, p, x, seq):
    """MLA's q, k per head [s, n, dq] in float64 (tests/test_mla.py's formulas) and the query latent."""
    n, dn = c.num_attention_heads, c.qk_head_dim
    lat = x
    if c.q_lora_rank is not None:
        lat = x @ p["linear_q_down_proj.weight"].T
        if c.qk_layernorm:
            lat = _norm64(lat, p["q_layernorm.weight"], p.get("q_layernorm.bias"), c.normalization)
    q = (lat @ p["linear_q_up_proj.weight" if c.q_lora_rank is not None else "linear_q_proj.weight"].T).view(seq, n, -1)
    ckv = x @ p["linear_kv_down_proj.weight"].T
    kl = ckv[:, :c.kv_lora_rank]
    if c.qk_layernorm:
        kl = _norm64(kl, p["kv_layernorm.weight"], p.get("kv_layernorm.bias"), c.normalization)
    kv = (kl @ p["linear_kv_up_proj.weight"].T).view(seq, n, -1)
    cos, sin = _tables64(c, seq)
    from test_mla import _rope_megatron64
    q = torch.cat([q[..., :dn], _rope_megatron64(q[..., dn:], cos, sin)], dim=-1)
    kr = _rope_megatron64(ckv[:, None, c.kv_lora_rank:], cos, sin).expand(-1, n, -1)
    return q, torch.cat([kv[..., :dn], kr], dim=-1), kv[..., dn:], lat


def _dsa64(c, p, x, seq):
    """-> (I, selected [s, s] bool, loss, output) in float64."""
    q, k, v, lat = _qk64(c, p, x, seq)
    scores = _indexer64(c, p, x, lat, seq)
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    order = scores.detach().masked_fill(causal, float("-inf")).argsort(dim=-1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(seq).expand(seq, -1))
    selected = (rank < c.dsa_indexer_topk) & ~causal
    invalid = causal | ~selected if c.dsa_indexer_use_sparse_loss else causal
    scale = _m(c.rotary_scaling_factor, c.mscale_all_dim) ** 2 / math.sqrt(c.qk_head_dim + c.qk_pos_emb_head_dim)
    att = (torch.einsum("qhd,khd->hqk", q, k) * scale).detach()
    tgt = att.masked_fill(invalid, float("-inf")).softmax(-1).sum(0)
    tgt = tgt / tgt.sum(-1, keepdim=True)
    logp = scores.masked_fill(invalid, float("-inf")).log_softmax(-1)
    kl = torch.where(invalid, 0.0, tgt * (tgt.clamp_min(1e-300).log() - logp)).sum(-1)
    loss = c.dsa_indexer_loss_coeff * kl.mean()
    probs = (torch.einsum("qhd,khd->hqk", q, k) * scale).masked_fill(~selected, float("-inf")).softmax(-1)
    out = torch.einsum("hqk,khd->qhd", probs, v).reshape(seq, -1) @ p["linear_proj.weight"].T
    return scores, selected, loss, out


SEQ = 29
CASES = {  # topk < SEQ: sparse; topk >= SEQ: dense causal MLA
    "sparse_q_lora_rmsnorm_yarn": dict(q_lora_rank=24, qk_layernorm=True, normalization="RMSNorm",
                                       rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=0.8, dsa_indexer_topk=6),
    "sparse_loss_q_proj_rope_no_relu": dict(rope_type="rope", rotary_percent=0.5, qk_pos_emb_head_dim=8,
                                            dsa_indexer_topk=9, dsa_indexer_use_sparse_loss=True,
                                            dsa_indexer_scoring_relu=False),
    "dense_topk_over_length": dict(q_lora_rank=20, qk_layernorm=True, rotary_scaling_factor=2.0, mscale=0.9,
                                   dsa_indexer_topk=64),
}


def _layer(case):
    kw = dict(num_layers=2, hidden_size=40, num_attention_heads=5, seq_length=SEQ, multi_latent_attention=True,
              kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=10, add_bias_linear=False,
              hidden_dropout=0.0, attention_dropout=0.0, seed=11, experimental_attention_variant="dsa",
              dsa_indexer_n_heads=6, dsa_indexer_head_dim=10, dsa_indexer_loss_coeff=0.3)
    c = ModelConfig(**{**kw, **CASES[case]})
    model_parallel_manual_seed(3)
    layer = MLASelfAttention(c, "decoder.layers.0.self_attention", layer_number=1)
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    with torch.no_grad():
        for name, prm in layer.named_parameters():
            if "norm" in name:
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.3 + (0.0 if name.endswith("bias") else 1.0))
            else:
                prm.mul_(torch.rand(prm.shape, generator=g) * 30)
    return c, layer, g


@pytest.mark.parametrize("case", list(CASES))
def test_one_layer_matches_the_formulas_in_float64(case):
    ps.initialize_model_parallel(1, 1)
    try:
        c, layer, g = _layer(case)
        x = torch.randn(SEQ, 1, 40, generator=g, requires_grad=True)
        rot = mla_rotary_cos_sin(c, SEQ, "cpu")
        q, k, v, lat = layer.qkv(x, rot, latent=True)
        iq, ik, iw = layer.core_attention.indexer(x, lat, rot)
        got_scores = index_scores(iq, ik, iw, c.dsa_indexer_scoring_relu)[0]
        mask, loss = layer.core_attention(x, lat, q, k, rot)
        # (b) the indexer loss reaches the indexer's parameters only
        loss.backward()
        idx_grads = {n: prm.grad.clone() for n, prm in layer.named_parameters() if "indexer" in n}
        others = [n for n, prm in layer.named_parameters() if "indexer" not in n and prm.grad is not None]
        assert x.grad is None and not others, others
        layer.zero_grad()
        tracker = layer.core_attention.aux_tracker
        tracker.clear()
        out, _ = layer(x, rot)
        grad_out = torch.randn(out.shape, generator=g)
        set_aux_loss_scale([layer], 1.0)  # the indexer loss joins with gradient 1 (no schedule here)
        (out * grad_out).sum().backward()
        both = {n: prm.grad.clone() for n, prm in layer.named_parameters()}
        assert set(tracker.values["indexer loss"]) == {1}  # recorded for the log line, per layer
        tracker.clear()
        layer.zero_grad()
        with torch.no_grad():  # eval / no grad: no indexer loss, the same mask
            assert layer.core_attention(x, lat, q, k, rot)[1] is None and not tracker.values
    finally:
        ps.destroy_model_parallel()
    p64 = {n: t.detach().double().requires_grad_(True) for n, t in layer.named_parameters()}
    x64 = x.detach().double()[:, 0]
    scores, selected, loss64, out64 = _dsa64(c, p64, x64, SEQ)
    assert torch.allclose(got_scores.double(), scores, rtol=0, atol=2e-5 * scores.abs().max().item()), \
        (got_scores.double() - scores).abs().max()
    assert torch.equal(~mask[0, 0], selected)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    if c.dsa_indexer_topk < SEQ:
        assert (selected.sum(-1) == torch.arange(1, SEQ + 1).clamp(max=c.dsa_indexer_topk)).all()
        assert (selected != ~causal).any()  # really sparse
    else:  # dense: MLA's own float64 layer
        assert torch.equal(selected, ~causal)
        assert torch.allclose(out64, _mla64(c, p64, x64, *_tables64(c, SEQ)), atol=1e-9)
    assert loss64 > 1e-3 and math.isclose(loss.item(), loss64.item(), rel_tol=1e-4), (loss.item(), loss64.item())
    assert torch.allclose(out[:, 0].double(), out64, rtol=0, atol=2e-5 * out64.abs().max().item())
    ref = torch.autograd.grad(loss64, [p64[n] for n in idx_grads])
    ref_out = torch.autograd.grad((out64 * grad_out[:, 0].double()).sum(), list(p64.values()), allow_unused=True)
    for (name, got), want in zip(idx_grads.items(), ref):
        assert want.abs().max() > 0, name
        assert torch.allclose(got.double(), want, rtol=0, atol=5e-5 * want.abs().max().item()), \
            (case, name, (got.double() - want).abs().max().item())
        assert torch.allclose(both[name], got, rtol=0, atol=1e-6 * got.abs().max().item()), name  # only the loss
    for name, want in zip(p64, ref_out):
        if "indexer" in name:
            assert want is None, name  # the main output does not reach the indexer (top-k: no gradient)
        else:
            assert torch.allclose(both[name].double(), want, rtol=0, atol=5e-5 * want.abs().max().item()), name


def _refusal(argv, capsys, world_size=1):
    with pytest.raises(SystemExit):
        parse_args(list(BASE) + argv, world_size=world_size)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("megalite: error (rank 0): "), lines
    return lines[0]


def test_dsa_flags_defaults_and_refusals(capsys):
    args = parse_args(list(BASE) + list(MLA) + list(DSA), world_size=1)
    assert (args.experimental_attention_variant, args.dsa_indexer_n_heads, args.dsa_indexer_head_dim,
            args.dsa_indexer_topk, args.dsa_indexer_loss_coeff) == ("dsa", 8, 8, 5, 1.0)
    # Megatron's defaults
    assert (args.dsa_indexer_topk_freq, args.dsa_indexer_skip_topk_offset, args.dsa_indexer_use_sparse_loss,
            args.dsa_indexer_rope_interleaved, args.dsa_indexer_scoring_relu, args.dsa_indexer_k_norm_epsilon,
            args.dsa_indexer_k_norm_fp32) == (1, 0, False, False, True, None, False)
    off = parse_args(list(BASE) + list(MLA) + list(DSA) + ["--no-dsa-indexer-scoring-relu",
                                                           "--dsa-kernel-backend", "tilelang"], world_size=1)
    assert not off.dsa_indexer_scoring_relu
    for extra, words in ((["--experimental-attention-variant", "gdn"], "gdn is not implemented"),
                         (["--disable-bias-linear", "--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads",
                           "2", "--dsa-indexer-head-dim", "8", "--dsa-indexer-topk", "4"], "needs --multi-latent"),
                         (list(MLA) + ["--experimental-attention-variant", "dsa"], "needs --dsa-indexer-n-heads, "
                          "--dsa-indexer-head-dim, --dsa-indexer-topk >= 1"),
                         (list(MLA[:-2]) + list(DSA), "needs --disable-bias-linear"),
                         (list(MLA) + list(DSA) + ["--dsa-indexer-topk-freq", "2"], "across layers is not implemented"),
                         (list(MLA) + list(DSA) + ["--dsa-indexer-head-dim", "2"], "must be >= --qk-pos-emb-head-dim")):
        assert words in _refusal(extra, capsys), extra


# -- (c) parity and (d) faults, one spawn ------------------------------------------------------
def topk_without_causal_mask():
    """The top-k picked over every key, future ones included (and then masked by nothing)."""
    original = dsa_module.select_topk

    def select(scores, masked, topk):
        return original(scores, torch.zeros_like(masked), topk)
    return patched(dsa_module, "select_topk", select)


def indexer_grads_summed_over_tp():
    """The indexer's replicated weights marked as partial under SP: their whole gradients summed over TP."""
    original = dsa_module._replicated

    def replicated(*a):
        lin = original(*a)
        lin.weight.sequence_parallel = True
        return lin
    return patched(dsa_module, "_replicated", replicated)


# Scores of a few units: the indexer loss and top-k matter. No ReLU on the scores here: its kink at 0 is a
# discrete decision too (whether a score's gradient passes), taken on values a rounding apart; the ReLU's
# formula and gradient are tested above against float64.
MODEL = MB2 + MLA + DSA + ("--init-method-std", "0.1", "--no-dsa-indexer-scoring-relu")
# The top-k choice is discrete, and the layouts' index scores differ from the single process's by a
# rounding (ReLU also makes exact ties at 0): the world takes the single process's choice where its own is
# a tie within that rounding (tests/support/decision_replay.py), so every layout is held to DESIGN's bound over all
# six steps. Faults are O(1) at step 1: STEP_ONE holds them to the bound there only.
STEP_ONE = {"losses@1": 1e-5, "norms@1": 1e-5, "grads": 1e-5, "embedding grads": 1e-5,
            "losses": math.inf, "norms": math.inf, "params": math.inf}
LAYOUTS = [layout("tp2_sp_dp2", tp=2, sp=True, dp=2, model=MODEL), layout("pp2_dp2", pp=2, dp=2, model=MODEL)]
FAULTS = [layout("fault_topk_not_causal", pp=2, dp=2, model=MODEL, fault=topk_without_causal_mask),
          layout("fault_indexer_grads_summed", tp=2, sp=True, dp=2, model=MODEL, fault=indexer_grads_summed_over_tp)]


@pytest.fixture(scope="module")
def world():
    lays = LAYOUTS + FAULTS
    return dict(zip([lay.name for lay in lays], run_layouts(lays, 4, timeout=300)))


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.name)
def test_dsa_layouts_match_the_single_process(world, lay):
    assert_parity(lay, world[lay.name])


@pytest.mark.parametrize("lay", FAULTS, ids=lambda lay: lay.name)
def test_faults_are_caught(world, lay):
    bad = mismatches(lay, world[lay.name], reference(lay), tol=STEP_ONE)
    assert any("grad" in m for m in bad), f"{lay.name} went unseen"
