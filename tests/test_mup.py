"""muP (--use-mup, megalite/mup.py) against hand-computed values of its formulas, the plain model
at the base width, and the single process at TP2+SP, PP2 and DP2 ZeRO-2 (tests/support/parity.py).

Width 64 over base 32 (m = 2), --init-method-std 0.02, 2 layers, head dim 16:
  hidden matrices N(0, 0.02 / sqrt 2 = 0.014142), residual writers N(0, 0.02 / (sqrt 4 sqrt 2) = 0.0070711),
  embeddings and output layer N(0, 0.02); attention scale 1/16; logits x 1/2; Adam LR and eps of
  the hidden matrices x 1/2, all else x 1."""

import json
import math
import os

import pytest
import torch

from megalite import mup, parallel_state as ps
from megalite.cli.parser import model_config, parse_args, training_config
from megalite.checkpoint.hf_convert import export_hf

from megalite.checkpoint.manager import META, TRACKER, config_json
from megalite.models import GPTModel
from megalite.optimizer import LRScheduler, MixedPrecisionOptimizer
from megalite.tensor_parallel import model_parallel_manual_seed
from megalite.transformer.attention import SelfAttention
from model_util import batch
from parity import BASE, check_reference, layout, reference, run_layouts
from parity_check import assert_parity

SIZES = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
         "--lr 1e-2 --min-lr 1e-3 --train-iters 10 --mock-data --hidden-dropout 0 --attention-dropout 0 "
         "--adam-eps 1e-6 --untie-embeddings-and-output-weights").split()
MUP = ("--use-mup", "--mup-base-hidden-size", "32")
HIDDEN = ("linear_qkv.weight", "linear_fc1.weight")  # read the residual stream
WRITERS = ("linear_proj.weight", "linear_fc2.weight")  # write into it
EMBEDDING_CLASS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "output_layer.weight")


@pytest.fixture
def grid():
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(1234)
    yield
    ps.destroy_model_parallel()


def build(extra=(), vocab=128):
    args = parse_args(SIZES + list(extra), world_size=1)
    return args, model_config(args, vocab)


def test_derived_values_and_init_std_of_each_weight_class(grid):
    _, cfg = build(MUP)
    assert (cfg.mup_width_mult, cfg.mup_output_mult, cfg.mup_embedding_mult) == (2.0, 0.5, 1.0)
    assert mup.hidden_std(cfg) == pytest.approx(0.014142135623731, rel=1e-9)
    assert mup.output_std(cfg) == pytest.approx(0.0070710678118655, rel=1e-9)
    _, plain_cfg = build()
    plain, scaled = dict(GPTModel(plain_cfg).named_parameters()), dict(GPTModel(cfg).named_parameters())
    assert set(plain) == set(scaled)
    seen = set()
    for name, w in scaled.items():
        w, p = w.detach(), plain[name].detach()
        if name.endswith(HIDDEN + WRITERS):
            # the same draws (seeds and tiles are the plain model's), times 1/sqrt(m)
            torch.testing.assert_close(w, p / math.sqrt(2.0), rtol=1e-6, atol=0)
            want = 0.014142135623731 if name.endswith(HIDDEN) else 0.0070710678118655
            assert float(w.std()) == pytest.approx(want, rel=0.05), name
            seen.add(name.rsplit(".", 2)[-2])
        else:  # embedding class, norms and biases: as without muP
            assert torch.equal(w, p), name
            if name in EMBEDDING_CLASS:
                rows = w[:cfg.vocab_size] if "position" not in name else w
                assert float(rows.std()) == pytest.approx(0.02, rel=0.05), name
                seen.add(name)
    assert seen == {"linear_qkv", "linear_fc1", "linear_proj", "linear_fc2", *EMBEDDING_CLASS}


@pytest.mark.parametrize("extra,scale", [((), 1 / 16), (("--mup-base-head-dim", "4"), 2 / 16),
                                         (("--mup-attn-scale-power", "0.5"), 1 / 4)],
                         ids=["default", "base_head_dim_4", "power_0.5"])
def test_attention_softmax_scale(grid, extra, scale):
    """softmax(q.k * scale) v by hand, scale = sqrt(base head dim or 1) / 16 ** power."""
    _, cfg = build(MUP + extra)
    assert mup.softmax_scale(cfg) == pytest.approx(scale, rel=1e-12)
    att = SelfAttention(cfg, "decoder.layers.0.self_attention").double()
    x = torch.randn(16, 2, 64, dtype=torch.float64)
    out, bias = att(x)
    qkv = att.linear_qkv(x).view(16, 2, 4, 3, 16)  # [s, b, groups, (q, k, v), d]
    q, k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))  # [b, h, s, d]
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    ctx = (torch.softmax(scores, -1) @ v).permute(2, 0, 1, 3).reshape(16, 2, 64)
    want = ctx @ att.linear_proj.weight.t()
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)


def test_embedding_and_logit_multipliers(grid):
    _, cfg = build(MUP + ("--mup-embedding-mult", "3.0"))
    model = GPTModel(cfg)
    seen = {}
    model.embedding.word_embeddings.register_forward_hook(lambda m, i, o: seen.update(word=o))
    model.embedding.position_embeddings.register_forward_hook(lambda m, i, o: seen.update(pos=o))
    model.decoder.register_forward_pre_hook(lambda m, args: seen.update(decoder_in=args[0]))
    model.output_layer.register_forward_hook(lambda m, i, o: seen.update(logits=o))
    ids, _ = batch(cfg)
    logits = model(ids)  # [b, s, V]
    torch.testing.assert_close(seen["decoder_in"], (seen["word"] + seen["pos"]) * 3.0, rtol=0, atol=0)
    torch.testing.assert_close(logits, seen["logits"].transpose(0, 1) * 0.5, rtol=0, atol=0)
    # an explicit --mup-output-mult stands
    assert build(MUP + ("--mup-output-mult", "0.25"))[1].mup_output_mult == 0.25


def test_learning_rate_and_eps_of_each_group(grid):
    """Hidden matrices: peak 1e-2 / 2, floor 1e-3 / 2, eps 1e-6 / 2, warm-up from --lr-warmup-init;
    embeddings, output layer, norms and biases: the base values."""
    args, cfg = build(MUP + ("--lr-warmup-iters", "4", "--lr-warmup-init", "1e-3", "--lr-decay-iters", "8",
                             "--lr-decay-style", "linear"))
    model = GPTModel(cfg)
    tcfg = training_config(args)
    opt = MixedPrecisionOptimizer([model], tcfg)
    sched = LRScheduler(opt, tcfg.lr, tcfg.min_lr, 4, 8, "linear", tcfg.lr_warmup_init)
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    names = dict(model.named_parameters())
    hidden = {n for n in names if n.endswith(HIDDEN + WRITERS)}
    assert len(hidden) == 8 and len(names) > len(hidden) + 3

    def expect(step, peak, floor):  # Megatron's linear warm-up and decay, by hand
        if step <= 4:
            return 1e-3 + (peak - 1e-3) * step / 4
        return floor + (1 - (step - 4) / 4) * (peak - floor) if step <= 8 else floor
    for step in (0, 2, 4, 6, 9):
        if step:
            sched.step(step - sched.num_steps)
        for n, p in names.items():
            g = group_of[id(p)]
            if n in hidden:
                assert (g["lr"], g["eps"]) == (pytest.approx(expect(step, 5e-3, 5e-4), rel=1e-12), 5e-7), (n, step)
            else:
                assert (g["lr"], g["eps"]) == (pytest.approx(expect(step, 1e-2, 1e-3), rel=1e-12), 1e-6), (n, step)
    assert sched.lr == pytest.approx(1e-3)  # the logged LR is the base schedule's


@pytest.mark.parametrize("flags,line", [
    (("--mup-base-hidden-size", "32"), "--mup-base-hidden-size has no effect without --use-mup"),
    (("--use-mup", "--mup-base-hidden-size", "0"), "--mup-base-hidden-size 0 must be positive"),
    (("--use-mup", "--mup-base-head-dim", "-4"), "--mup-base-head-dim -4.0 must be positive"),
    (MUP + ("--mup-width-mult", "4"), "--mup-width-mult 4.0 is derived as --hidden-size / --mup-base-hidden-size = 2"),
])
def test_flag_errors_are_one_line(flags, line, capsys):
    with pytest.raises(SystemExit):
        parse_args(SIZES + list(flags), world_size=1)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err


def test_bert_and_hf_export_refuse_mup(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(SIZES + list(MUP), world_size=1, defaults={"model_type": "bert"})
    assert "--use-mup is implemented for GPT models only" in capsys.readouterr().err
    _, cfg = build(MUP)
    it = tmp_path / "iter_0000001"
    it.mkdir()
    (tmp_path / TRACKER).write_text("1")
    (it / META).write_text(json.dumps({"format": "megalite-checkpoint", "version": 1,
                                       "model_config": config_json(cfg)}))
    with pytest.raises(Exception, match="cannot represent a muP model"):
        export_hf(str(tmp_path), str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf" / "config.json")


def test_base_width_is_the_plain_model():
    """m = 1 with --mup-base-head-dim = head dim (8): init, multipliers, attention scale and Adam
    groups all reduce to the plain model's: the same losses and parameters, bit for bit. Without
    it the attention scale is 1/8, not 1/sqrt 8, and the runs part."""
    plain = reference(layout("plain"))
    same = reference(layout("mup_base", model=("--use-mup", "--mup-base-head-dim", "8")))
    assert same["losses"] == plain["losses"]
    assert all(torch.equal(same["params"][n], t) for n, t in plain["params"].items())
    assert all(torch.equal(same["grads"][n], t) for n, t in plain["grads"].items())
    other = reference(layout("mup_base_1_over_d", model=("--use-mup",)))
    assert other["losses"][0] != plain["losses"][0]


MUP_PARITY = ("--use-mup", "--mup-base-hidden-size", "16", "--mup-embedding-mult", "2.0")
LAYOUTS = [layout("mup_tp2_sp", tp=2, sp=True, model=MUP_PARITY),
           layout("mup_pp2_tied", pp=2, model=MUP_PARITY),
           layout("mup_dp2_zero3", dp=2, zero=3, model=MUP_PARITY),
           layout("mup_cp2", cp=2, model=MUP_PARITY)]


def test_parallel_layouts_match_the_single_process():
    """TP2+SP (sums reordered), PP2 (the tied embedding's last-stage copy must stay in the embedding
    class), DP2 ZeRO-3 (weights made from their init recipes on the meta device, Adam groups split
    over ranks) and CP2 (ring attention with muP's scale) against one process: losses, step-1
    grads, grad norms and parameters after 6 steps within DESIGN's 1e-5, in one spawn of 2 ranks.
    Measured (seed 1234): params 2.8e-6 at TP2+SP, <= 5.4e-7 elsewhere."""
    assert "--hidden-size" in BASE and BASE[BASE.index("--hidden-size") + 1] == "32"  # m = 2
    results = run_layouts(LAYOUTS, 2)
    ref = reference(LAYOUTS[0])
    check_reference(ref)
    for lay, ranks in zip(LAYOUTS, results):
        assert_parity(lay, ranks)
