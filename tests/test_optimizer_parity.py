"""--optimizer muon / sgd / lion at parallel layouts against the single process (tests/support/parity.py: losses,
step-1 gradients, grad norms, every parameter after 6 steps, DESIGN's fp32 bound 1e-5), and Muon's
whole-matrix bookkeeping: under ZeRO each matrix is orthogonalised by exactly one rank of its sharding
group, the Newton-Schulz work balanced over them.

Muon runs its Newton-Schulz steps in fp32 here (--muon-fp32-matmul-prec high: the bf16 default rounds
at 2^-8, which no parity bound can hold) on the Llama-shaped model (GQA QKV split into q, k, v; SwiGLU's
fused fc1 gathered blockwise under TP), with --muon-scale-mode shape_scaling. Why not the default
spectral scale: Newton-Schulz maps a small singular value s to about (a_1 ... a_5) s, 494 s for the
quintic set, so the rounding differences of sums taken in another order (1e-7 of the momentum) reach
the orthogonalised update 494 times larger, and the update is lr x scale of it. Spectral's scale
sqrt(max(out, in)) is 5.7-11 on these matrices, shape_scaling's 1-2: measured after 6 steps, the
largest parameter error is 1.2-1.3e-5 with spectral (beyond DESIGN's 1e-5) and 5.4-6.2e-6 with
shape_scaling. The scale itself is a constant factor per matrix, checked on one process
(tests/test_optimizers.py). Two spawned worlds: two ranks (TP2 + SP with each TP mode, PP2,
DP2 with ZeRO-1/2/3, CP2, EP2, MLA at TP2 + SP) and four (TP2 x DP2 with ZeRO-1: Muon, SGD, Lion;
Muon with the TP-distributed Newton-Schulz under ZeRO-2 and Lion for the scalar parameters).
"""

import os

import pytest

import pretrain_gpt
from dist_util import start_on_ranks
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.checkpoint.convert import Reader, find_checkpoint
from megalite.optimizer.newton_schulz import flops
from megalite.training import pretrain
from parity import BASE, LLAMA, MB2, MOE, layout, learnable_datasets, patched, reference, start_layouts
from parity_check import assert_parity, mismatches

MUON_FLAGS = MB2 + ("--optimizer", "muon", "--muon-fp32-matmul-prec", "high", "--muon-nesterov", "--muon-scale-mode",
              "shape_scaling")
MUON = LLAMA + MUON_FLAGS
MUON_MOE = MUON_FLAGS + MOE  # (the GPT-2-shaped MoE every MoE parity test shares)
# MuonClip at a threshold the model's logits pass from step 2 on (its largest: 0.055 at step 1, up to 0.086)
CLIP = MUON + ("--qk-clip", "--qk-clip-threshold", "0.06", "--qk-clip-alpha", "0.3")
MLA = ("--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "12", "--normalization", "RMSNorm", "--disable-bias-linear")


def shard_only():
    """Fault: Newton-Schulz on each TP shard instead of the whole matrix (what blockwise does)."""
    from megalite.optimizer import muon
    return patched(muon.MuonMatrices, "_global_shape", lambda self, p, shape: tuple(shape))


def twice():
    """Fault: every matrix orthogonalised twice (the update of the update)."""
    from megalite.optimizer import muon
    once = muon.MuonMatrices.orthogonalise
    return patched(muon.MuonMatrices, "orthogonalise", lambda self, p, m: once(self, p, once(self, p, m)))


TWO = [layout("muon_tp2_sp", tp=2, sp=True, model=MUON),
       layout("muon_tp2_sp_distributed", tp=2, sp=True, model=MUON, flags=("--muon-tp-mode", "distributed")),
       layout("muon_pp2", pp=2, model=MUON),
       layout("muon_pp2_interleaved_recompute", pp=2, vp=1, recompute="full", model=MUON),
       layout("muon_dp2_zero1", dp=2, zero=1, model=MUON),
       layout("muon_dp2_zero2", dp=2, zero=2, model=MUON),
       layout("muon_dp2_zero3", dp=2, zero=3, model=MUON),
       layout("muon_cp2", cp=2, model=MUON),
       layout("muon_ep2_zero1", dp=2, zero=1, model=MUON_MOE, flags=("--expert-model-parallel-size", "2")),
       layout("muon_mla_tp2_sp", tp=2, sp=True, model=MUON_FLAGS + MLA),  # MLA's projections: a matrix each
       layout("qk_clip_tp2_sp", tp=2, sp=True, model=CLIP),
       layout("qk_clip_cp2", cp=2, model=CLIP),
       layout("qk_clip_dp2_zero1", dp=2, zero=1, model=CLIP),
       layout("qk_clip_pp2_interleaved", pp=2, vp=1, model=CLIP),  # (the stages decide to publish together)
       ]
FAULTS = [layout("muon_tp2_sp_fault_shard_only", tp=2, sp=True, model=MUON, fault=shard_only),
          layout("muon_dp2_zero1_fault_twice", dp=2, zero=1, model=MUON, fault=twice)]
FOUR = [layout("muon_tp2_dp2_zero1", tp=2, dp=2, zero=1, model=MUON),
        layout("muon_tp2_dp2_zero2_distributed_lion", tp=2, dp=2, zero=2, sp=True,
               model=MUON + ("--muon-scalar-optimizer", "lion"), flags=("--muon-tp-mode", "distributed")),
        layout("sgd_tp2_dp2_zero1", tp=2, dp=2, zero=1, model=MB2 + LLAMA + ("--optimizer", "sgd", "--lr", "0.3")),
        layout("lion_tp2_dp2_zero1", tp=2, dp=2, zero=1, model=MB2 + LLAMA + ("--optimizer", "lion", "--lr", "3e-3"))]


def collect(chunks, optimizer):
    m = getattr(optimizer, "_muon", None)
    return None if m is None else dict(m.stats)


def _pretrain(argv):
    args = parse_args(list(BASE) + list(MUON) + list(argv), world_size=max(1, ps.world_size()))
    try:
        return pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
    finally:
        ps.destroy_model_parallel()


Z3 = ("--use-distributed-optimizer", "--zero-stage", "3")
TP2_DP2 = ("--tensor-model-parallel-size", "2", "--use-distributed-optimizer")


def _checkpoints(root):
    """Muon at ZeRO-3 DP4: straight, then stopped at 3 and resumed; at TP2 x DP2 ZeRO-1: saved at 3."""
    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    return {"straight": _pretrain(Z3), "first": _pretrain(Z3 + ("--save", a, "--exit-interval", "3")),
            "resumed": _pretrain(Z3 + ("--load", a)),
            "tp2_dp2": _pretrain(TP2_DP2 + ("--save", b, "--exit-interval", "3"))}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("muon_ckpt"))
    ckpt = start_on_ranks(_checkpoints, 4, root, timeout=420)
    two = start_layouts(TWO + FAULTS, 2, collect)
    four = start_layouts(FOUR, 4, collect)
    lays = TWO + FAULTS + FOUR
    out = dict(zip([lay.name for lay in lays], two.result() + four.result()))
    ranks = ckpt.result()
    return {**out, "root": root, **{k: [r[k] for r in ranks] for k in ranks[0]}}


@pytest.mark.parametrize("lay", TWO + FOUR, ids=lambda lay: lay.name)
def test_optimizer_layouts_match_the_single_process(worlds, lay):
    assert_parity(lay, worlds[lay.name])


@pytest.mark.parametrize("lay", FAULTS, ids=lambda lay: lay.name)
def test_the_checks_catch_muon_faults(worlds, lay):
    assert mismatches(lay, worlds[lay.name], reference(lay)), f"{lay.name}: the fault went unnoticed"


def test_zero_orthogonalises_each_matrix_once_balanced(worlds):
    """Under ZeRO the ranks of a sharding group split the matrices: their counts add up to the single
    process's (each matrix once: 4 layers x (q, k, v, proj, fc1, fc2)) and each rank's Newton-Schulz FLOPs
    equal the formula's share, within 10% of the mean."""
    ref = 4 * 6 * 6  # matrices per step x 6 steps
    for name in ("muon_dp2_zero1", "muon_dp2_zero2", "muon_dp2_zero3"):
        stats = [r["collected"] for r in worlds[name]]
        assert sum(s["matrices"] for s in stats) == ref, (name, stats)
        per_step = [s["ns_flops"] / 6 for s in stats]
        # the model's matrices (hidden 32, 8 heads of 4, 4 groups, SwiGLU ffn 64): q 32x32, k and v 16x32
        # each, proj 32x32, fc1 128x32, fc2 32x64
        shapes = [(32, 32), (16, 32), (16, 32), (32, 32), (128, 32), (32, 64)] * 4
        assert sum(per_step) == sum(flops(r, c, 5) for r, c in shapes), (name, per_step)
        assert max(per_step) <= 1.1 * sum(per_step) / 2, (name, per_step)
    plain = [r["collected"] for r in worlds["muon_tp2_dp2_zero1"]]
    assert sum(s["matrices"] for s in plain) == 2 * ref  # over 2 DP ranks, on each of 2 TP ranks (duplicated)


def test_muon_resumes_exactly_at_zero3_dp4(worlds):
    straight, first, resumed = worlds["straight"][-1], worlds["first"][-1], worlds["resumed"][-1]
    assert first == straight[:3] and resumed == straight[3:], (straight, first, resumed)


def test_muon_state_saved_at_tp2_dp2_continues_at_one_process(worlds):
    """The momenta are saved under global names (momentum_buffer for Muon's matrices, Adam's exp_avg and
    exp_avg_sq for the rest) and a single process continues from them: its 3 further steps' losses are
    the straight single-process run's (within DESIGN's bound: the first 3 ran at another layout)."""
    b = os.path.join(worlds["root"], "b")
    names = Reader(find_checkpoint(b)[0]).names()
    assert "optimizer.momentum_buffer.decoder.layers.0.self_attention.linear_qkv.weight" in names
    assert "optimizer.exp_avg_sq.embedding.word_embeddings.weight" in names
    assert not any(n.startswith("optimizer.exp_avg.decoder.layers.0.mlp.linear_fc1") for n in names)
    continued = _pretrain(("--load", b))
    straight = reference(layout("muon", model=MUON))["losses"]
    assert len(continued) == 3
    for x, y in zip(continued, straight[3:]):
        assert abs(x - y) <= 1e-5 * abs(y), (continued, straight)


def test_switching_optimizers_needs_no_load_optim(worlds, capsys):
    b = os.path.join(worlds["root"], "b")
    args = parse_args(list(BASE) + list(LLAMA) + ["--load", b], world_size=1)
    with pytest.raises(SystemExit):
        try:
            pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
        finally:
            ps.destroy_model_parallel()
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "--optimizer muon+adam" in err[0] and "--no-load-optim" in err[0], err
    args = parse_args(list(BASE) + list(LLAMA) + ["--load", b, "--no-load-optim"], world_size=1)
    try:  # AdamW from the Muon run's weights
        assert len(pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)) == 3
    finally:
        ps.destroy_model_parallel()


def test_qk_clip_engages_in_the_reference():
    """The clip layouts test something: the single process's weights with --qk-clip differ from without."""
    clipped, plain = reference(TWO[-1])["params"], reference(layout("muon", model=MUON))["params"]
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert not (clipped[name] - plain[name]).abs().max() < 1e-4 * plain[name].abs().max()


def test_the_largest_attention_logit_is_logged(capsys):
    """--log-max-attention-logit prints each step's largest logit (every layer and head, before that step's
    clip): the first step's is the same with --qk-clip (nothing was clipped before it), and clipping at a
    threshold the logits pass holds the later maxima lower than without it."""
    def logged(extra):
        _pretrain(("--log-max-attention-logit", "--train-iters", "4", "--log-interval", "1") + extra)
        lines = [ln for ln in capsys.readouterr().out.splitlines() if "max attention logit:" in ln]
        return [float(ln.split("max attention logit:")[1].split("|")[0]) for ln in lines]
    plain = logged(())
    assert len(plain) == 4 and all(0 < v < 10 for v in plain), plain
    clipped = logged(("--qk-clip", "--qk-clip-threshold", "0.06"))
    assert len(clipped) == 4 and clipped[0] == plain[0] and clipped[-1] < plain[-1], (plain, clipped)
