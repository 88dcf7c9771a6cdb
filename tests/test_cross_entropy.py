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


def _run(n, ls, seed, V=V, divisor=2, inplace=False):
    ps.initialize_model_parallel(n, 1)
    r = ps.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(seed)
    padded = padded_vocab_size(V, divisor, n)
    logits = torch.randn(37, padded, generator=g, dtype=torch.float32) * 3
    target = torch.randint(0, V, (37,), generator=g)
    upstream = torch.rand(37, generator=g, dtype=torch.float32)
    ref_in = logits[:, :V].double().requires_grad_(True)
    ref = _reference(ref_in, target, ls)
    ref.backward(upstream.double())
    shard = logits.chunk(n, -1)[r].clone().requires_grad_(True)
    x = shard * 1.0  # a non-leaf, like the output layer's result (in-place grad lands here)
    loss = vocab_parallel_cross_entropy(x, target, label_smoothing=ls, vocab_size=V, inplace_backward=inplace)
    loss.backward(upstream)
    ref_grad = torch.cat([ref_in.grad, torch.zeros(37, padded - V, dtype=torch.float64)], -1).chunk(n, -1)[r]
    return rel_err(loss.detach(), ref.detach()), rel_err(shard.grad, ref_grad)


@pytest.mark.parametrize("ls", [0.0, 0.1])
@pytest.mark.parametrize("inplace", [False, True])  # True: the vocab-parallel algorithm, as on GPUs
# fp32 against float64 (u = 6e-8): exp of max-shifted logits (1 rounding each), a pairwise sum of
# <= 256 terms (<= 8 levels) and, over TP, a sum of <= 4 partial sums: <= ~13u = 8e-7 relative on
# the sum, so on log-sum-exp and on each softmax probability; both relative to the largest
# loss / gradient element they are smaller still. Hence 1e-6.
def test_single_rank_matches_torch(ls, inplace):
    try:
        e_loss, e_grad = _run(1, ls, 0, inplace=inplace)
    finally:
        ps.destroy_model_parallel()
    assert e_loss <= 1e-6 and e_grad <= 1e-6, (e_loss, e_grad)


# (2, 0.1, 100, 128): vocab 100 padded to 256, so rank 1's shard is padding only.
@pytest.mark.parametrize("n,ls,vocab,divisor", [(2, 0.0, V, 2), (4, 0.1, V, 2), (2, 0.1, 100, 128)])
def test_vocab_parallel_matches_torch(n, ls, vocab, divisor):
    for rank, (e_loss, e_grad) in enumerate(run_on_ranks(_run, n, n, ls, 1, vocab, divisor)):
        assert e_loss <= 1e-6 and e_grad <= 1e-6, f"rank {rank}: loss err {e_loss}, grad err {e_grad}"
