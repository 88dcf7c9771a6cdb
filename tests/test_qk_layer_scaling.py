"""--apply-query-key-layer-scaling (Megatron's DotProductAttention): in fp16 the attention
scores are computed as q.k / (sqrt(d) * layer_number) (one GEMM, fp32 accumulation, rounded to
fp16), and the fp32 softmax multiplies them back by layer_number. The function is unchanged;
scores too large for fp16 no longer overflow.

Bounds (u = 2^-11, fp16's unit roundoff): rounding a score z to fp16 moves it by <= u|z| and
so a softmax row by <= 2u max|z| in L1; the fp16 probabilities and the output add one rounding
each. So |out - exact| <= max|v| (2 zmax + 1) u + u max|out| against the formula (where the
only freedom is the GEMM's summation order, which can flip a score's rounding), and the same
plus the fp32 reference's own rounding against fp32 attention; we assert the looser
(4 zmax + 3) u max|v| there."""

import pytest
import torch

from megalite import parallel_state as ps
from megalite.cli.parser import model_config, parse_args
from megalite.models import GPTModel
from megalite.tensor_parallel import model_parallel_manual_seed
from megalite.transformer import attention
from model_util import batch

U16 = 2.0 ** -11


@pytest.fixture
def tp1():
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(5)
    yield
    ps.destroy_model_parallel()


def _inputs(scale, seed, b=2, s=13, hq=4, hkv=2, d=16):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for h in (hq, hkv, hkv))
    return (q * scale).half(), (k * scale).half(), v.half()


def _megatron_formula(q, k, v, layer):
    """Megatron's fp16 op order written out in fp32 with explicit roundings to fp16."""
    hq, hkv, d = q.shape[2], k.shape[2], q.shape[3]
    qt = q.float().transpose(1, 2)
    kt, vt = (t.float().transpose(1, 2).repeat_interleave(hq // hkv, 1) for t in (k, v))
    scores = (qt @ kt.transpose(-1, -2) * (d ** -0.5 / layer)).half()  # baddbmm(alpha), fp16 out
    s = q.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = torch.softmax((scores.float() * layer).masked_fill(causal, -10000.0), -1).half()
    return (probs.float() @ vt).half().transpose(1, 2)


def _fp32_attention(q, k, v):
    hq, hkv, d = q.shape[2], k.shape[2], q.shape[3]
    qt = q.float().transpose(1, 2)
    kt, vt = (t.float().transpose(1, 2).repeat_interleave(hq // hkv, 1) for t in (k, v))
    z = qt @ kt.transpose(-1, -2) * d ** -0.5
    s = q.shape[1]
    probs = torch.softmax(z.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")), -1)
    return (probs @ vt).transpose(1, 2), z.abs().max().item()


@pytest.mark.parametrize("scale,layer", [(1.0, 5), (3.0, 24)])
def test_fp16_follows_megatrons_formula_and_fp32_attention(tp1, scale, layer):
    q, k, v = _inputs(scale, seed=layer)
    out = attention.core_attention(q, k, v, 0.0, False, False, layer_scale=layer)
    assert out.dtype == torch.float16
    exact, zmax = _fp32_attention(q, k, v)
    vmax = v.float().abs().max().item()
    formula = _megatron_formula(q, k, v, layer)
    err = (out.float() - formula.float()).abs().max().item()
    assert err <= vmax * (2 * zmax + 1) * U16 + U16 * formula.float().abs().max().item(), err
    err32 = (out.float() - exact).abs().max().item()
    assert err32 <= (4 * zmax + 3) * U16 * vmax, (err32, zmax)


def test_scores_beyond_fp16_range_stay_finite(tp1):
    """q_i = k_i = +-200: q_i.k_i / sqrt(16) = 160000 > 65504. Unscaled fp16 scores overflow
    (NaN attention); divided by layer 24 they fit, and each query attends to itself only, as in
    fp32."""
    g = torch.Generator().manual_seed(0)
    b, s, h, d = 1, 9, 2, 16
    sign = torch.randint(0, 2, (b, s, h, d), generator=g).float() * 2 - 1
    q = k = (200 * sign).half()
    v = torch.randn(b, s, h, d, generator=g).half()
    plain = attention._explicit_scores_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0,
                                                 None, 1, False)
    assert not torch.isfinite(plain).all(), "the unscaled fp16 scores were meant to overflow"
    out = attention.core_attention(q, k, v, 0.0, False, False, layer_scale=24)
    exact, _ = _fp32_attention(q, k, v)
    assert torch.isfinite(out).all()
    assert torch.equal(out.float(), exact) and torch.equal(out, v)


def test_every_layer_passes_its_global_number_and_fp16_takes_the_scaled_path(tp1, monkeypatch):
    """bf16 (and fp32) never hold scores in fp16: the flag leaves them on the fast path."""
    seen, explicit = [], []
    real, real_explicit = attention.core_attention, attention._explicit_scores_attention

    def spy(*a):
        seen.append(a[8])  # (core_attention's layer_scale: q, k, v, dropout, fused, training, mask, flash, it)
        return real(*a)

    def spy_explicit(*a, **kw):
        explicit.append(a[-2])  # the layer scale it applies
        return real_explicit(*a, **kw)
    monkeypatch.setattr(attention, "core_attention", spy)
    monkeypatch.setattr(attention, "_explicit_scores_attention", spy_explicit)
    base = ("--num-layers 3 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 --lr 1e-3 "
            "--train-iters 1 --mock-data --apply-query-key-layer-scaling").split()
    for dtype, want in (("--fp16", [1, 2, 3]), ("--bf16", [])):
        args = parse_args(base + [dtype], world_size=1)
        cfg = model_config(args, 64)
        assert cfg.apply_query_key_layer_scaling
        model = GPTModel(cfg)
        ids, labels = batch(cfg)
        seen.clear()
        explicit.clear()
        loss = model(ids, labels=labels).float().mean()
        loss.backward()
        assert torch.isfinite(loss)
        assert seen == [1, 2, 3] and explicit == want, (dtype, seen, explicit)
    assert parse_args(base[:-1], world_size=1).apply_query_key_layer_scaling is False
