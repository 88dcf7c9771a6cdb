"""Sliding-window attention (Megatron's --window-size L,0 and --window-attn-skip-freq N; megalite/transformer/
attention.py): a query at i attends to keys i - L .. i, against the softmax written out, on the SDPA and the
explicit-scores paths and under a KV cache; every N-th layer attends to all keys; the model's loss differs from
full attention's once the window is shorter than the sequence and equals it once it is not; what it does not
compose with yet is one line (parity at TP2 + SP x PP2: tests/test_model_flags.py)."""

import pytest
import torch

from megalite.cli.parser import parse_args
from megalite.transformer.attention import core_attention

ARGV = ("--mock-data --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
        "--train-iters 1 --lr 1e-3").split()


def _written_out(q, k, v, window):
    """softmax(q k^T / sqrt(d) over keys i - window .. i) v, in float64, per head (GQA: k, v shared by groups)."""
    b, s, hq, d = q.shape
    sk, g = k.shape[1], hq // k.shape[2]
    out = torch.zeros(b, s, hq, v.shape[-1], dtype=torch.float64)
    for i in range(s):
        pos = sk - s + i
        lo = 0 if window is None else max(0, pos - window)
        for h in range(hq):
            scores = torch.einsum("bd,bkd->bk", q[:, i, h].double(), k[:, lo:pos + 1, h // g].double()) / d ** 0.5
            out[:, i, h] = torch.einsum("bk,bkd->bd", scores.softmax(-1), v[:, lo:pos + 1, h // g].double())
    return out


@pytest.mark.parametrize("window", [0, 1, 3, 15, None])
@pytest.mark.parametrize("path", ["sdpa", "explicit"])
def test_the_window_is_the_softmax_written_out(grid, window, path):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 12, 4, 8), torch.randn(2, 12, 2, 8), torch.randn(2, 12, 2, 8)
    got = core_attention(q, k, v, 0.0, False, False, window=window, layer_scale=3 if path == "explicit" else None)
    if path == "explicit":  # (--apply-query-key-layer-scaling's path runs only in fp16: call it as fp32 here)
        from megalite.transformer.attention import _explicit_scores_attention, sliding_window_mask
        mask = sliding_window_mask(12, 12, window, q.device) if window is not None else None
        got = _explicit_scores_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, mask, 1,
                                         False)
    torch.testing.assert_close(got.double(), _written_out(q, k, v, window), rtol=1e-5, atol=1e-6)


def test_a_kv_cache_step_sees_the_window_of_its_position(grid):
    """Decoding (a KV cache: 3 new queries after 9 cached keys): each query's window ends at its own position."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 3, 2, 8), torch.randn(1, 12, 2, 8), torch.randn(1, 12, 2, 8)
    cache_mask = (torch.arange(12)[None, :] > torch.arange(9, 12)[:, None])[None, None]  # (kv_cache.py's)
    got = core_attention(q, k, v, 0.0, False, False, attn_mask=cache_mask, window=4)
    torch.testing.assert_close(got.double(), _written_out(q, k, v, 4), rtol=1e-5, atol=1e-6)


def test_every_nth_layer_attends_to_all_keys(grid):
    from megalite.config.from_flags import model_config
    from megalite.transformer.attention import SelfAttention
    args = parse_args(ARGV + ["--window-size", "5", "--window-attn-skip-freq", "2"], world_size=1)
    cfg = model_config(args)
    windows = [SelfAttention(cfg, f"l{n}", layer_number=n).window for n in range(1, 5)]
    assert windows == [5, None, 5, None]


def _loss(extra):
    import pretrain_gpt
    from megalite import parallel_state as ps
    from megalite.training import pretrain
    from parity import BASE, learnable_datasets
    args = parse_args(list(BASE) + ["--train-iters", "1", "--position-embedding-type", "rope"] + extra, world_size=1)
    try:
        return pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)[0]
    finally:
        ps.destroy_model_parallel()


def test_a_window_shorter_than_the_sequence_changes_the_model_and_one_as_long_does_not():
    """(The whole-sequence window runs SDPA with an explicit mask instead of is_causal: the same sums, rounded by
    another kernel: DESIGN's fp32 bound; the short window moves the loss ten times farther than that.)"""
    full, short, whole = _loss([]), _loss(["--window-size", "2,0"]), _loss(["--window-size", "15,0"])
    assert abs(short - full) > 10 * 1e-5 * full and abs(whole - full) <= 1e-5 * full, (full, short, whole)


@pytest.mark.parametrize("extra,says", [
    ("--window-size 4,2", "--window-size '4,2': a causal model takes 'L,0'"),
    ("--window-attn-skip-freq 2", "--window-attn-skip-freq 2 needs --window-size"),
    ("--window-size 4 --context-parallel-size 2", "--window-size with --context-parallel-size > 1 is not built yet"),
    ("--window-size 4 --multi-latent-attention", "--window-size with --multi-latent-attention is not built yet"),
])
def test_refusals_are_one_line(capsys, extra, says):
    with pytest.raises(SystemExit):
        parse_args(ARGV + extra.split(), world_size=2)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and says in err[0], err


def test_the_flops_count_the_window():
    """Megatron's FLOPs formula with the scores' term scaled by the causal pairs a window keeps: a window of the
    whole sequence counts as full attention; window 0 (each query its own key) counts s of s(s + 1)/2 pairs; every
    2nd layer global averages the two."""
    from megalite.config.from_flags import model_config
    from megalite.planner.flops import num_floating_point_operations, window_share
    cfg = {w: model_config(parse_args(ARGV + (["--window-size", w] if w else []), world_size=1))
           for w in ("", "15", "0")}
    assert window_share(cfg[""]) == window_share(cfg["15"]) == 1.0
    assert window_share(cfg["0"]) == pytest.approx(16 / (16 * 17 / 2))
    half = model_config(parse_args(ARGV + ["--window-size", "0", "--window-attn-skip-freq", "2"], world_size=1))
    assert window_share(half) == pytest.approx((1 + 16 / (16 * 17 / 2)) / 2)
    f = {w: num_floating_point_operations(c, 8, 1024) for w, c in cfg.items()}
    c, s, h, L = cfg[""], 16, 32, 4
    scores = 12 * 8 * s * L * h * h * (s / h) * (c.kv_channels * c.num_attention_heads / h)  # the full scores' term
    assert f["15"] == f[""] and f[""] - f["0"] == pytest.approx(scores * (1 - 16 / 136))


def test_megatrons_window_pair_goes_both_ways():
    """A Megatron checkpoint's window_size is the pair (keys before, 0): read as --window-size, written back so."""
    from megalite.checkpoint.manager import config_json
    from megalite.checkpoint.to_megatron import megatron_namespace
    from megalite.cli.megatron_args import model_flags
    from megalite.config.from_flags import model_config
    cfg = config_json(model_config(parse_args(ARGV + ["--window-size", "5", "--vocab-size", "64"], world_size=1)))
    ns = megatron_namespace(cfg, 1, 1, (0, 0))
    assert ns.window_size == (5, 0)
    back = parse_args(model_flags(ns, 64) + ["--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1"],
                      world_size=1)
    assert back.window_size == 5 and back.window_attn_skip_freq is None
