"""vocab_parallel_cross_entropy against torch.nn.functional.cross_entropy (float64)."""

import pytest
import torch
import torch.nn.functional as F

from dist_util import rel_err, run_on_ranks
from megalite import parallel_state as ps
from megalite.tensor_parallel import padded_vocab_size, vocab_parallel_cross_entropy

V = 250  # real vocabulary, not divisible by 4 (padded to 252 / 256)


def _reference(logits, target, ls):
    loss = F.cross_entropy(logits.double(), target, label_smoothing=ls, reduction="none")
    return loss


def _run(n, ls, seed):
    ps.initialize_model_parallel(n, 1)
    r = ps.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(seed)
    padded = padded_vocab_size(V, 2, n)
    logits = torch.randn(37, padded, generator=g, dtype=torch.float32) * 3
    target = torch.randint(0, V, (37,), generator=g)
    upstream = torch.rand(37, generator=g, dtype=torch.float32)
    ref_in = logits[:, :V].double().requires_grad_(True)
    ref = _reference(ref_in, target, ls)
    ref.backward(upstream.double())
    shard = logits.chunk(n, -1)[r].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(shard, target, label_smoothing=ls, vocab_size=V)
    loss.backward(upstream)
    ref_grad = torch.cat([ref_in.grad, torch.zeros(37, padded - V, dtype=torch.float64)], -1).chunk(n, -1)[r]
    return rel_err(loss.detach(), ref.detach()), rel_err(shard.grad, ref_grad)


@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_single_rank_matches_torch(ls):
    try:
        e_loss, e_grad = _run(1, ls, 0)
    finally:
        ps.destroy_model_parallel()
    assert e_loss <= 1e-6 and e_grad <= 1e-6, (e_loss, e_grad)


@pytest.mark.parametrize("n,ls", [(2, 0.0), (4, 0.1)])
def test_vocab_parallel_matches_torch(n, ls):
    for rank, (e_loss, e_grad) in enumerate(run_on_ranks(_run, n, n, ls, 1)):
        assert e_loss <= 1e-6 and e_grad <= 1e-6, f"rank {rank}: loss err {e_loss}, grad err {e_grad}"
