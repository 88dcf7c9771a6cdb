"""RNG streams across TP ranks, and recomputation that reproduces dropout exactly."""

import pytest
import torch

from dist_util import run_on_ranks
from megalite import parallel_state as ps
from megalite.models import GPTModel
from megalite.tensor_parallel import get_rng_tracker, model_parallel_manual_seed
from model_util import batch, tiny_config


def _streams():
    ps.initialize_model_parallel(2, 1)
    model_parallel_manual_seed(42)
    outside = torch.rand(8)
    with get_rng_tracker().fork():
        inside = torch.rand(8)
    after = torch.rand(8)  # the fork must not disturb the default stream
    model_parallel_manual_seed(42)
    outside_again = torch.rand(8)
    return outside, inside, after, outside_again


def test_tp_rng_streams():
    (o0, i0, a0, r0), (o1, i1, a1, r1) = run_on_ranks(_streams, 2)
    assert torch.equal(o0, o1), "dropout outside TP regions must be identical on all TP ranks"
    assert torch.equal(a0, a1)
    assert not torch.equal(i0, i1), "dropout inside TP regions must differ between TP ranks"
    assert torch.equal(o0, r0) and not torch.equal(o0, a0)


def _grads(recompute, method=None, k=None):
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(5)
    cfg = tiny_config("gpt2", hidden_dropout=0.2, attention_dropout=0.2, num_layers=3,
                      recompute_granularity=recompute, recompute_method=method, recompute_num_layers=k)
    model = GPTModel(cfg)
    ids, labels = batch(cfg)
    torch.manual_seed(99)
    loss = model(ids, labels=labels).mean()
    loss.backward()
    ps.destroy_model_parallel()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recompute,method,k", [("full", "uniform", 1), ("full", "uniform", 2),
                                                ("full", "block", 2), ("selective", None, None)])
def test_recomputation_reproduces_dropout(recompute, method, k):
    ref_loss, ref = _grads(None)
    loss, grads = _grads(recompute, method, k)
    assert loss == ref_loss
    for n in ref:
        assert torch.equal(grads[n], ref[n]), f"{recompute}/{method}/{k}: gradient of {n} differs"


def test_dropout_is_active_in_that_test():
    # Guard against the recompute test passing only because dropout did nothing.
    a, _ = _grads(None)
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(5)
    cfg = tiny_config("gpt2", num_layers=3)
    model = GPTModel(cfg)
    ids, labels = batch(cfg)
    b = model(ids, labels=labels).mean().item()
    ps.destroy_model_parallel()
    assert a != b


def _tp_sp_recompute_matches():
    """TP=2 with sequence parallelism and dropout: full and selective recomputation give the
    gradients of the plain run bit for bit (the per-rank dropout streams are restored)."""
    ps.initialize_model_parallel(2, 1)
    out = {}
    for recompute in (None, "full", "selective"):
        model_parallel_manual_seed(5)
        cfg = tiny_config("llama", hidden_dropout=0.2, attention_dropout=0.2, sequence_parallel=True,
                          recompute_granularity=recompute)
        model = GPTModel(cfg)
        ids, labels = batch(cfg)
        torch.manual_seed(99)
        model(ids, labels=labels).mean().backward()
        out[recompute] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {r: all(torch.equal(out[r][n], out[None][n]) for n in out[None]) for r in ("full", "selective")}


def test_recomputation_with_tp_and_sequence_parallel_dropout():
    for rank, same in enumerate(run_on_ranks(_tp_sp_recompute_matches, 2)):
        assert same == {"full": True, "selective": True}, f"rank {rank}: {same}"
