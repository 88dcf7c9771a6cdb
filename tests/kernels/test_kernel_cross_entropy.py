import importlib

import pytest
import torch

import kernels

from kernel_testutil import TOL32, backend, check, cuda_relerr_ok, relerr  # noqa: F401

ce_mod = importlib.import_module("kernels.cross_entropy")


def _ref(logits, target, ls, vocab_size):
    x = logits[..., :vocab_size]
    logp = x - torch.logsumexp(x, dim=-1, keepdim=True)
    nll = -logp.gather(-1, target[..., None]).squeeze(-1)
    return (1 - ls) * nll - ls * logp.mean(-1)


@pytest.fixture(autouse=True)
def small_block(monkeypatch):
    monkeypatch.setattr(ce_mod, "BLOCK_V", 256)  # several chunks per row under the interpreter


@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_cross_entropy_single_rank(backend, ls):
    logits = (torch.randn(3, 37, 1000) * 4).requires_grad_()
    target = torch.randint(0, 1000, (3, 37))
    check(lambda x: kernels.cross_entropy(x, target, label_smoothing=ls),
          lambda x: _ref(x, target, ls, 1000), [logits])


@pytest.mark.parametrize("v", [200, 1000])
def test_cross_entropy_chunks_and_edges(backend, v):
    """One chunk (no loop to pipeline) and four (the last partial: 1000 = 3 * 256 + 232); targets at the first
    and last column (the target logit is one load at its index)."""
    logits = (torch.randn(37, v) * 4).requires_grad_()
    target = torch.randint(0, v, (37,))
    target[:3], target[3:6] = 0, v - 1
    check(lambda x: kernels.cross_entropy(x, target), lambda x: _ref(x, target, 0.0, v), [logits])


def test_cross_entropy_padded_vocab_inplace(backend):
    """Columns past vocab_size are padding; in-place backward overwrites the logits with the grad."""
    logits = (torch.randn(37, 1000) * 4)
    target = torch.randint(0, 997, (37,))
    x = logits.clone().requires_grad_()
    y = x * 1.0  # a non-leaf, like a matmul output
    loss = kernels.cross_entropy(y, target, label_smoothing=0.1, vocab_size=997, inplace_backward=True)
    xr = logits.double().requires_grad_()
    ref = _ref(xr, target, 0.1, 997)
    assert relerr(loss, ref) <= TOL32
    dy = torch.randn(37, dtype=torch.float64)
    loss.backward(dy.float())
    (gr,) = torch.autograd.grad(ref, xr, dy)
    assert relerr(x.grad, gr) <= TOL32
    assert (x.grad[:, 997:] == 0).all()
    assert relerr(y, gr) <= TOL32, "inplace_backward must leave the gradient in the logits storage"


class _TwoRanks:
    """Drives the per-rank protocol of a 2-way vocab split in one process: the max all-reduce is
    answered with the true global max, and each rank's sum all-reduce sees the other rank's
    contribution recorded in a first pass."""

    def __init__(self):
        self.parts = {}
        self.sum_calls = []

    def run(self, shards, target, ls, vocab_size, global_max):
        losses = []
        for phase in (0, 1):
            losses = []
            for r, shard in enumerate(shards):
                def amax(t):
                    t.copy_(global_max)

                def asum(t, r=r, phase=phase):
                    self.sum_calls.append(tuple(t.shape))
                    if phase == 0:
                        self.parts[r] = t.clone()
                    else:
                        t.copy_(self.parts[0] + self.parts[1])
                losses.append(kernels.cross_entropy(shard, target, ls, r * shard.shape[-1], vocab_size,
                                                    allreduce_max=amax, allreduce_sum=asum))
        return losses


@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_cross_entropy_vocab_parallel(backend, ls):
    vocab, per_rank = 997, 500  # rank 1 holds 3 padded columns
    full = torch.randn(37, 2 * per_rank) * 4
    target = torch.randint(0, vocab, (37,))
    target[:5] = torch.arange(495, 500)  # targets right at the shard boundary
    target[5:10] = torch.arange(500, 505)
    shards = [full[:, :per_rank].clone().requires_grad_(), full[:, per_rank:].clone().requires_grad_()]
    gmax = full[:, :vocab].max(-1).values
    drv = _TwoRanks()
    losses = drv.run(shards, target, ls, vocab, gmax)
    assert drv.sum_calls == [(3 if ls else 2, 37)] * 4, drv.sum_calls  # one fused all-reduce per call
    xr = full.double().requires_grad_()
    ref = _ref(xr, target, ls, vocab)
    dy = torch.randn(37, dtype=torch.float64)
    (gr,) = torch.autograd.grad(ref, xr, dy)
    for r, (loss, shard) in enumerate(zip(losses, shards)):
        assert relerr(loss, ref) <= TOL32
        (g,) = torch.autograd.grad(loss, shard, dy.float())
        assert relerr(g, gr[:, r * per_rank:(r + 1) * per_rank]) <= TOL32


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_cross_entropy_cuda(dtype, tol):
    torch.manual_seed(0)
    n, v = 4096, 131072
    logits = (torch.randn(n, v, device="cuda") * 3).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda")
    loss = kernels.cross_entropy(logits, target, label_smoothing=0.1)
    dy = torch.randn_like(loss)
    (g,) = torch.autograd.grad(loss, logits, dy)
    xr = logits.detach().float().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xr, target, reduction="none", label_smoothing=0.1)
    (gr,) = torch.autograd.grad(ref, xr, dy)
    cuda_relerr_ok(loss, ref, 1e-3)  # fp32 math on low-precision inputs: only the input rounding differs
    cuda_relerr_ok(g, gr, tol)
    # int64 offsets: a tensor with more than 2**31 elements (about 4.3 GB in bf16)
    big = torch.zeros(16448, v, device="cuda", dtype=torch.bfloat16)
    big[-1, -1] = 30.0
    t = torch.full((16448,), v - 1, device="cuda")
    out = kernels.cross_entropy(big, t)
    assert out[-1].item() < 1e-3 and abs(out[0].item() - torch.log(torch.tensor(float(v))).item()) < 1e-2
