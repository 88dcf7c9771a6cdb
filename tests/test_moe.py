"""Mixture of Experts (megalite/moe/), expert-parallel size 1: the router's formulas against
hand-written float64 ones, the layer against a dense reference, and MoE GPTs through pretrain()
against the single process (tests/support/parity.py), aux and z losses included."""

import math

import pytest
import torch

from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.config import ModelConfig
from megalite.moe.layer import MoELayer
from megalite.moe.aux_losses import set_aux_loss_scale
from megalite.moe.router import TopKRouter, sinkhorn, sinkhorn_routing, topk_routing
from megalite.transformer.mlp import MLP
from parity import MB2, MOE, layout, patched, reference, run_layouts
from parity_check import assert_parity, mismatches

E, K = 4, 2


def _cfg(**kw):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=6, vocab_size=32, num_moe_experts=E,
                moe_router_topk=K, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                params_dtype=torch.float64, moe_ffn_hidden_size=24, moe_router_dtype="fp64")
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("score,pre", [("softmax", False), ("softmax", True), ("sigmoid", False)])
def test_topk_routing_matches_its_definition(score, pre):
    logits = torch.randn(37, E, dtype=torch.float64)
    probs, rmap = topk_routing(logits, K, score, pre, scaling_factor=2.5)
    top = logits.topk(K, dim=1).indices
    for t in range(37):
        chosen = set(top[t].tolist())
        assert set(rmap[t].nonzero().squeeze(1).tolist()) == chosen
        sel = sorted(chosen)
        if score == "softmax":
            want = torch.softmax(logits[t], 0)[sel] if pre else torch.softmax(logits[t, sel], 0)
        else:
            s = torch.sigmoid(logits[t, sel])
            want = s / s.sum()
        assert torch.allclose(probs[t, sel], 2.5 * want, rtol=1e-12)
        assert probs[t].count_nonzero() == K


def test_expert_bias_chooses_but_does_not_weigh_and_moves_towards_the_mean(grid):
    logits = torch.randn(37, E, dtype=torch.float64)
    bias = torch.tensor([0.3, -0.2, 0.0, 0.1])
    probs, rmap = topk_routing(logits, K, "sigmoid", expert_bias=bias)
    s = torch.sigmoid(logits)
    chosen = (s + bias.double()).topk(K, dim=1).indices
    assert torch.equal(rmap, torch.zeros_like(rmap).scatter(1, chosen, True))
    want = s.gather(1, chosen) / s.gather(1, chosen).sum(1, keepdim=True)
    assert torch.allclose(probs.gather(1, chosen), want, rtol=1e-12)
    router = TopKRouter(_cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                             moe_router_bias_update_rate=0.25), "decoder.layers.0.mlp.router", 1)
    router(torch.randn(8, 16, dtype=torch.float64))
    assert router.local_tokens_per_expert.sum() == 8 * K and router.local_tokens_per_expert.dtype == torch.int64
    with torch.no_grad():  # evaluation / a recompute's first forward: not counted
        router(torch.randn(8, 16, dtype=torch.float64))
    assert router.local_tokens_per_expert.sum() == 8 * K
    router.update_expert_bias(torch.tensor([9, 1, 3, 3]))  # mean 4: over-loaded down, under-loaded up
    assert router.expert_bias.tolist() == [-0.25, 0.25, 0.25, 0.25] and router.local_tokens_per_expert.sum() == 0
    assert not router.expert_bias.requires_grad


def test_sinkhorn_balances_and_routes_as_megatron():
    """Sinkhorn: its last rescaling makes every expert's column sum 1/E (up to its eps 1e-8 against
    column sums of ~1e-2 before it), hence balanced top-1 choices where plain top-1 piles onto one
    expert; probabilities are the unrenormalised scores; evaluation routes by the scores."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, E, dtype=torch.float64, generator=g) + torch.tensor([2.0, 0, 0, 0], dtype=torch.float64)
    p = sinkhorn(logits)
    assert torch.allclose(p.sum(0), torch.full((E,), 1 / E, dtype=torch.float64), rtol=1e-5)
    plain = torch.bincount(logits.argmax(1), minlength=E)
    balanced = torch.bincount(p.argmax(1), minlength=E)
    assert plain.max() > 40 and balanced.max() < plain.max() - 15, (plain, balanced)
    for k, act in ((1, torch.sigmoid(logits)), (2, torch.softmax(logits, -1))):
        probs, rmap = sinkhorn_routing(logits, k, training=True)
        chosen = torch.topk(sinkhorn(logits.float()), k, dim=1).indices
        assert torch.equal(rmap, torch.zeros_like(rmap).scatter(1, chosen, True))
        assert torch.equal(probs, act * rmap)
        probs, rmap = sinkhorn_routing(logits, k, training=False)
        assert torch.equal(rmap, torch.zeros_like(rmap).scatter(1, act.topk(k, dim=1).indices, True))


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_aux_and_z_losses_are_megatrons_formulas_and_reach_the_router_scaled(grid, kind):
    s, b, coeff, zc, scale = 6, 3, 0.01, 0.001, 0.25
    cfg = _cfg(moe_aux_loss_coeff=coeff, moe_z_loss_coeff=zc, moe_router_load_balancing_type=kind)
    router = TopKRouter(cfg, "decoder.layers.0.mlp.router", 1)
    x = torch.randn(s * b, cfg.hidden_size, dtype=torch.float64)
    set_aux_loss_scale([router], scale)
    probs, rmap = router(x, seq_length=s)
    (probs * 0).sum().backward()  # only the auxiliary losses' gradients flow
    got_grad = router.weight.grad.clone()

    w = router.weight.detach().clone().requires_grad_(True)
    logits = x @ w.t()
    p_all = torch.softmax(logits, -1)
    counts = torch.zeros_like(logits).scatter(1, logits.topk(K, 1).indices, 1.0)

    def switch(p, c, tokens):  # E * sum_e f_e P_e with f_e = c_e / (k T), P_e = mean_t p_te
        return E * ((c.sum(0) / (K * tokens)) * (p.sum(0) / tokens)).sum() * coeff
    if kind == "aux_loss":
        aux = switch(p_all, counts, s * b)
    else:  # rows are [s, b] flattened: sequence j is rows j, j + b, ...
        aux = sum(switch(p_all[j::b], counts[j::b], s) for j in range(b)) / b
    z = (torch.logsumexp(logits, -1) ** 2).mean() * zc
    ((aux + z) * scale).backward()
    assert torch.allclose(got_grad, w.grad, rtol=1e-10, atol=1e-14)
    logged = {n: v[1].item() for n, v in router.aux_tracker.values.items()}  # in fp32: rounding <= 2^-24 relative
    assert math.isclose(logged["load_balancing_loss"], aux.item() / coeff, rel_tol=1e-7)
    assert math.isclose(logged["z_loss"], z.item() / zc, rel_tol=1e-7)


def _layer_run(cfg):
    """(layer, tokens [15, h], its output [15, h], the routed experts' dense weighted sum)."""
    layer = MoELayer(cfg, "decoder.layers.0.mlp", 1, MLP)
    x = torch.randn(5, 3, cfg.hidden_size, dtype=torch.float64)
    out, bias = layer(x)
    assert bias is None
    tokens = x.reshape(15, -1)
    probs, _ = layer.router(tokens, seq_length=5)
    dense = sum(probs[:, e:e + 1] * layer.experts.local_experts[str(e)](tokens)[0] for e in range(E))
    return layer, tokens, out.reshape(15, -1), dense


def test_moe_layer_is_the_weighted_sum_of_its_experts(grid):
    layer, _, out, dense = _layer_run(_cfg(swiglu=True, ffn_hidden_size=32))
    assert torch.allclose(out, dense, rtol=1e-12, atol=1e-14)
    names = [n for n, _ in layer.named_parameters()]
    assert "experts.local_experts.3.linear_fc2.weight" in names and "router.weight" in names


def aux_loss_not_divided_by_microbatches():
    """Fault: the auxiliary losses' gradient scale ignores the micro-batch count."""
    import megalite.pipeline.run as micro_run
    return patched(micro_run, "set_aux_loss_scale", lambda chunks, scale: set_aux_loss_scale(chunks, 1.0))


LAYOUTS = [
    layout("moe_dp2", dp=2, model=MB2 + MOE),
    layout("fault_moe_dp2_aux_not_divided", dp=2, model=MB2 + MOE, fault=aux_loss_not_divided_by_microbatches),
    layout("moe_pp2_seq_aux_sigmoid_pattern", pp=2, model=MB2 + MOE + (
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-score-function", "sigmoid",
        "--moe-layer-freq", "[1,0,1,1]")),
    layout("moe_dp2_zero3_recompute", dp=2, zero=3, recompute="full", model=MB2 + MOE),
    layout("moe_pp2_interleaved", pp=2, vp=1, model=MB2 + MOE),
    layout("moe_dp2_zero2", dp=2, zero=2, model=MB2 + MOE),
    layout("moe_dp2_capacity_shared_gate", dp=2, model=MB2 + MOE + (
        "--moe-expert-capacity-factor", "1.0", "--moe-token-drop-policy", "position",
        "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate", "--moe-router-pre-softmax")),
]


@pytest.fixture(scope="module")
def moe_runs():
    return run_layouts(LAYOUTS, 2)


@pytest.mark.parametrize("i", [i for i, lay in enumerate(LAYOUTS) if not lay.name.startswith("fault")],
                         ids=[lay.name for lay in LAYOUTS if not lay.name.startswith("fault")])
def test_moe_layouts_match_single_process(moe_runs, i):
    """Losses, every gradient before clipping (router and experts, through the aux and z losses),
    grad norms and parameters after 6 steps, at DESIGN's fp32 bound."""
    assert_parity(LAYOUTS[i], moe_runs[i])


def test_aux_loss_scale_fault_is_caught(moe_runs):
    """Without the 1/M scale the aux-loss gradients are summed over micro-batches: 4 per DP rank
    here against 8 in the single process, so the router's gradient differs."""
    i = [lay.name for lay in LAYOUTS].index("fault_moe_dp2_aux_not_divided")
    assert mismatches(LAYOUTS[i], moe_runs[i], reference(LAYOUTS[i]))


def test_moe_flags_refused_in_one_line(capsys):
    req = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 8 --micro-batch-size 1 --lr 1e-3 " \
          "--train-iters 1 --mock-data --num-experts 4".split()
    for bad, msg in (([], "add --disable-bias-linear"),
                     (["--disable-bias-linear", "--moe-router-topk", "1"], "needs --moe-router-pre-softmax"),
                     (["--disable-bias-linear", "--moe-router-topk", "5"], "between 1 and --num-experts 4"),
                     (["--disable-bias-linear", "--moe-layer-freq", "[1,0,1]"], "3 entries for --num-layers 2"),
                     (["--disable-bias-linear", "--moe-layer-freq", "__import__('os')"], "an int or a pattern"),
                     (["--disable-bias-linear", "--tensor-model-parallel-size", "2"], "needs --sequence-parallel"),
                     (["--disable-bias-linear", "--expert-model-parallel-size", "3"], "divisible by --expert-model"),
                     (["--disable-bias-linear", "--expert-model-parallel-size", "4"], "must divide the 2 ranks"),
                     (["--disable-bias-linear", "--expert-model-parallel-size", "2", "--fp16"], "use --bf16"),
                     (["--disable-bias-linear", "--moe-router-enable-expert-bias"], "needs --moe-router-score-function "
                                                                                     "sigmoid"),
                     (["--disable-bias-linear", "--moe-router-load-balancing-type", "sinkhorn",
                       "--moe-aux-loss-coeff", "0.01"], "sinkhorn has no auxiliary loss"),
                     (["--disable-bias-linear", "--moe-input-jitter-eps", "0.01"], "Mixture of Experts option")):
        with pytest.raises(SystemExit):
            parse_args(req + bad, world_size=2)
        assert msg in capsys.readouterr().err, bad
    parse_args(req + ["--disable-bias-linear", "--moe-router-topk", "1", "--moe-router-load-balancing-type",
                      "sinkhorn"], world_size=1)  # top-1 sinkhorn scores by sigmoid: no pre-softmax needed
    args = parse_args(req + ["--disable-bias-linear", "--moe-layer-freq", "([1]*1+[0])*1", "--moe-grouped-gemm"],
                      world_size=1)
    assert args.moe_layer_freq == [1, 0]
    assert "--moe-grouped-gemm: on CPU the experts run one after the other" in capsys.readouterr().out


def test_moe_checkpoint_resumes_exactly_and_hf_export_names_what_it_lacks(tmp_path, capsys):
    """One process: 6 iterations straight vs 3 + save + 3 resumed (expert and router weights
    under global names, Adam states); the log line shows the routers' losses (Megatron's names);
    the HF converter names what it cannot represent (a GPT-2-style MoE: no HF MoE class has learned
    positions; tests/test_checkpoint_hf_moe.py converts the Llama-style ones)."""
    import re
    import pretrain_gpt
    from cli_batch import convert
    from megalite.training import pretrain
    from parity import BASE, learnable_datasets

    def run(extra):
        args = parse_args(list(BASE) + list(MOE) + extra, world_size=1)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
        finally:
            torch.set_num_threads(threads)
            ps.destroy_model_parallel()
    d = str(tmp_path / "ckpt")
    straight = run([])
    line = [ln for ln in capsys.readouterr().out.splitlines() if "lm loss:" in ln][-1]
    lb, z = (float(re.search(rf"{n}: ([-0-9.E+]+)", line).group(1)) for n in ("load_balancing_loss", "z_loss"))
    assert 0.5 < lb < 4 and 0 <= z < 100, line  # the Switch loss is 1 at a uniform routing
    first = run(["--save", d, "--exit-interval", "3"])
    second = run(["--load", d])
    assert first == straight[:3] and second == straight[3:], (straight, first, second)
    rc, _, err = convert("--loader", "megalite", "--saver", "hf", "--load-dir", d, "--save-dir", str(tmp_path / "hf"))
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "MixtralForCausalLM cannot represent position_embedding_type='learned_absolute'" in err, err


@pytest.mark.parametrize("policy,pad", [("probs", False), ("position", False), ("probs", True), ("position", True)])
def test_capacity_drops_what_exceeds_each_expert(policy, pad):
    from megalite.moe.router import drop_over_capacity
    logits = torch.randn(29, E, dtype=torch.float64)
    probs, rmap = topk_routing(logits, K)
    cap = math.ceil(29 * K / E * 0.5)
    p2, m2 = drop_over_capacity(probs, rmap, K, 0.5, policy, pad)
    for e in range(E):
        routed = rmap[:, e].nonzero().squeeze(1).tolist()
        if policy == "probs":
            want = sorted(routed, key=lambda t: -probs[t, e].item())[:cap]
        else:
            want = routed[:cap]
        kept = [t for t in m2[:, e].nonzero().squeeze(1).tolist() if t in routed]
        assert sorted(kept) == sorted(want), (e, kept, want)
        assert int(m2[:, e].sum()) == (cap if pad else min(cap, len(routed)))
        assert torch.equal(p2[:, e], probs[:, e] * m2[:, e])  # padded slots carry probability 0


def test_shared_expert_with_gate_adds_to_the_routed_output(grid):
    layer, tokens, out, routed = _layer_run(_cfg(moe_shared_expert_intermediate_size=20, moe_shared_expert_gate=True))
    shared = layer.shared_experts(tokens)[0] * torch.sigmoid(tokens @ layer.shared_experts.gate_weight.t())
    assert torch.allclose(out, routed + shared, rtol=1e-12, atol=1e-14)
    assert "shared_experts.gate_weight" in dict(layer.named_parameters())


# -- group-limited routing (DeepSeek-V3's: --moe-router-num-groups / --moe-router-group-topk) -------------
def _group_limited_reference(scores, k, groups, group_topk):
    """The definition, token by token in float64: a group's score is the sum of its best k // group_topk
    expert scores; the token keeps its best group_topk groups and takes its k best experts among theirs."""
    out = []
    per = scores.shape[1] // groups
    for row in scores.double().tolist():
        group_score = [sum(sorted(row[g * per:(g + 1) * per], reverse=True)[:k // group_topk]) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -group_score[g])[:group_topk]
        allowed = [i for g in best for i in range(g * per, (g + 1) * per)]
        out.append(sorted(sorted(allowed, key=lambda i: -row[i])[:k]))
    return out


@pytest.mark.parametrize("score, bias", [("sigmoid", True), ("sigmoid", False), ("softmax", False)])
def test_group_limited_routing_is_its_definition(score, bias):
    from megalite.moe.router import topk_routing
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 16, generator=g, dtype=torch.float64)
    expert_bias = torch.randn(16, generator=g, dtype=torch.float64) * 0.5 if bias else None
    probs, routing_map = topk_routing(logits, 4, score, expert_bias=expert_bias, groups=4, group_topk=2)
    chosen_by = torch.sigmoid(logits) + (expert_bias if bias else 0) if score == "sigmoid" else logits
    want = _group_limited_reference(chosen_by, 4, 4, 2)
    got = [sorted(torch.nonzero(r).flatten().tolist()) for r in routing_map]
    assert got == want
    plain = topk_routing(logits, 4, score, expert_bias=expert_bias)[1]
    assert (plain != routing_map).any()  # the groups do change the choice here
    # the probabilities are the chosen experts' (normalised) scores, as without groups
    if score == "sigmoid":
        s = torch.sigmoid(logits) * routing_map
        assert torch.allclose(probs, s / s.sum(dim=-1, keepdim=True), rtol=0, atol=1e-15)


@pytest.mark.parametrize("extra, message", [
    (["--moe-router-num-groups", "4"], "go together"),
    (["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], "must divide --num-experts 8"),
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "5"], "must be between 1 and"),
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "3"], "must be >= --moe-router-group-topk 3"),
])
def test_group_limited_routing_flags_are_checked(extra, message):
    from megalite.cli.parser import _parse
    from megalite.config import ConfigError
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "1", "--vocab-size",
            "64", "--lr", "1e-3", "--train-iters", "1", "--num-experts", "8", "--moe-router-topk", "2",
            "--disable-bias-linear"]
    with pytest.raises(ConfigError) as e:
        _parse(argv + extra, world_size=1)
    assert message in str(e.value) and "\n" not in str(e.value)
    ok = _parse(argv + ["--moe-router-num-groups", "4", "--moe-router-group-topk", "2"], world_size=1)
    assert (ok.moe_router_num_groups, ok.moe_router_group_topk) == (4, 2)
