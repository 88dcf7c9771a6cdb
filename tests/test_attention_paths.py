"""Which attention implementation the model runs, and where its dropout randomness comes from.

The GPU path is forced on CPU (Triton interpreter): with the default attention dropout (0.1)
the GPT must run flash attention (in-kernel dropout), never the unfused softmax; with
--no-fused-kernels it runs neither kernel. Flash attention's dropout seed comes from the
per-TP-rank tracker stream (so the default stream, shared by all TP ranks, is untouched),
and activation recomputation reproduces the mask.
"""
import pytest
import torch

import kernels
from megalite import parallel_state as ps
from megalite.models import GPTModel
from megalite.tensor_parallel import checkpoint, get_rng_tracker, model_parallel_manual_seed
from megalite.transformer.attention import core_attention
from model_util import batch, tiny_config


@pytest.fixture
def tp1():
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(11)
    yield
    ps.destroy_model_parallel()


def _count_calls(monkeypatch):
    calls = {"flash_attention": 0, "softmax": 0}
    for name in calls:
        real = getattr(kernels, name)

        def wrapped(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(kernels, name, wrapped)
    return calls


@pytest.mark.parametrize("fused", [True, False])
def test_default_dropout_runs_flash_attention(tp1, monkeypatch, fused):
    cfg = tiny_config("gpt2", hidden_size=64, attention_dropout=0.1, fused_kernels=fused)
    assert cfg.attention_dropout == 0.1
    model = GPTModel(cfg).train()
    calls = _count_calls(monkeypatch)
    ids, labels = batch(cfg)
    with kernels.use_backend("triton"):
        loss = model(ids, labels=labels).mean()
        loss.backward()
    assert torch.isfinite(loss)
    if fused:
        assert calls == {"flash_attention": cfg.num_layers, "softmax": 0}, calls
    else:
        assert calls == {"flash_attention": 0, "softmax": 0}, calls


def test_flash_dropout_seed_from_tracker_and_recompute(tp1):
    q, k, v = (torch.randn(2, 24, h, 16, requires_grad=True) for h in (4, 2, 2))
    with kernels.use_backend("triton"):
        default_before = torch.get_rng_state()
        tracker_before = get_rng_tracker().get_states()
        o1 = core_attention(q, k, v, 0.3, True, True)
        assert torch.equal(torch.get_rng_state(), default_before), "dropout must not draw from the default stream"
        get_rng_tracker().set_states(tracker_before)
        o2 = core_attention(q, k, v, 0.3, True, True)
        assert torch.equal(o1, o2), "same tracker state, same mask"
        o3 = core_attention(q, k, v, 0.3, True, True)
        assert not torch.equal(o2, o3), "the tracker stream advances between calls"
        o_eval = core_attention(q, k, v, 0.3, True, False)
        assert not torch.equal(o_eval, o3)
        # recomputation replays the tracker state: gradients equal those of the plain run
        get_rng_tracker().set_states(tracker_before)
        g_plain = torch.autograd.grad(core_attention(q, k, v, 0.3, True, True).sum(), (q, k, v))
        get_rng_tracker().set_states(tracker_before)
        g_ckpt = torch.autograd.grad(checkpoint(core_attention, q, k, v, 0.3, True, True).sum(), (q, k, v))
    for a, b in zip(g_plain, g_ckpt):
        assert torch.equal(a, b)
