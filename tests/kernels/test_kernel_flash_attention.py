import importlib

import pytest
import torch

import kernels

from kernel_testutil import backend, check, cuda_relerr_ok, relerr  # noqa: F401

fa_mod = importlib.import_module("kernels.flash_attention")


def _ref(q, k, v, causal, scale, kpm):
    h, hk = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    sq, sk = q.shape[1], k.shape[1]
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        ok = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
    ok = ok[None, None]
    if kpm is not None:
        ok = ok & kpm[:, None, None, :]
    p = torch.softmax(s.masked_fill(~ok, float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _qkv(b, sq, sk, h, hk, d):
    return (torch.randn(b, sq, h, d).requires_grad_(), torch.randn(b, sk, hk, d).requires_grad_(),
            torch.randn(b, sk, hk, d).requires_grad_())


@pytest.mark.parametrize("causal,shape,padded", [
    (True, (3, 100, 100, 4, 1, 64), False),    # GQA 4:1, causal, masked tails
    (False, (2, 100, 100, 2, 2, 128), False),  # MHA, head dim 128
    (False, (3, 100, 100, 4, 2, 64), True),    # BERT-style key padding, GQA 2:1
])
def test_flash_attention(backend, causal, shape, padded):
    b, sq, sk, h, hk, d = shape
    q, k, v = _qkv(*shape)
    kpm = None
    if padded:
        lengths = torch.tensor([100, 61, 7])
        kpm = torch.arange(sk)[None, :] < lengths[:, None]
    scale = 0.7 / d ** 0.5
    check(lambda q, k, v: kernels.flash_attention(q, k, v, causal, scale, key_padding_mask=kpm),
          lambda q, k, v: _ref(q, k, v, causal, scale, kpm), [q, k, v])


def test_flash_attention_small_blocks_rect(backend, monkeypatch):
    """BLOCK_M != BLOCK_N, sq != sk (bottom-right causal), strided q from a fused projection."""
    monkeypatch.setattr(fa_mod, "FWD_BLOCKS", (32, 16))
    monkeypatch.setattr(fa_mod, "BWD_BLOCKS", (16, 32))
    b, sq, sk, h, hk, d = 3, 37, 100, 4, 1, 64
    q = torch.randn(b, sq, h, 2 * d)[..., :d].requires_grad_()
    _, k, v = _qkv(b, sq, sk, h, hk, d)
    check(lambda q, k, v: kernels.flash_attention(q, k, v, causal=True),
          lambda q, k, v: _ref(q, k, v, True, d ** -0.5, None), [q, k, v])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("causal,s,h,hk,d,padded", [
    (True, 2048, 32, 8, 128, False), (True, 1000, 16, 16, 64, False), (False, 512, 12, 12, 64, True)])
def test_flash_attention_cuda(dtype, tol, causal, s, h, hk, d, padded):
    torch.manual_seed(0)
    q = torch.randn(2, s, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(2, s, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, s, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    kpm = (torch.arange(s, device="cuda")[None] < torch.tensor([[s], [s // 3]], device="cuda")) if padded else None
    o = kernels.flash_attention(q, k, v, causal, None, key_padding_mask=kpm)
    do = torch.randn_like(o)
    g = torch.autograd.grad(o, (q, k, v), do)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with kernels.use_backend("torch"):
        orf = kernels.flash_attention(*ref_in, causal, None, key_padding_mask=kpm)
    gr = torch.autograd.grad(orf, ref_in, do.float())
    cuda_relerr_ok(o, orf, tol)
    for a, r in zip(g, gr):
        cuda_relerr_ok(a, r, tol)


def _close(x, ref, tol):
    assert torch.isfinite(x).all() and relerr(x, ref) <= tol, relerr(x, ref)


@pytest.mark.parametrize("causal,shape", [(True, (2, 37, 37, 4, 2, 16)), (False, (1, 20, 45, 2, 1, 32))])
def test_flash_attention_block_lse_and_merged_backward(backend, causal, shape):
    """Ring attention's pieces: a block's output and natural-log LSE, and the gradients of a
    block for a given (merged) output and LSE, against float64 (Triton in the interpreter and
    the torch fallback). Two key blocks merged through their LSEs equal attention over both."""
    b, sq, sk, h, hk, d = shape
    q, k, v = (t.detach() for t in _qkv(b, sq, sk, h, hk, d))
    scale = d ** -0.5
    half = sk // 2
    # keys [0, half) fully visible; keys [half, sk) causal (bottom-right) when causal
    o1, l1 = kernels.flash_attention_block(q, k[:, :half], v[:, :half], causal=False)
    o2, l2 = kernels.flash_attention_block(q, k[:, half:], v[:, half:], causal=causal)
    lse = torch.logaddexp(l1, l2)
    out = (o1.float() * torch.exp(l1 - lse).transpose(1, 2)[..., None] +
           o2.float() * torch.exp(l2 - lse).transpose(1, 2)[..., None])
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        ok[:, half:] = torch.ones(sq, sk - half, dtype=torch.bool).tril_(sk - half - sq)
    rep = h // hk
    s = torch.einsum("bqhd,bkhd->bhqk", qr, kr.repeat_interleave(rep, 2)) * scale
    s = s.masked_fill(~ok, float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vr.repeat_interleave(rep, 2))
    dout = torch.randn_like(ref)
    ref.backward(dout)
    _close(out, ref.detach(), 1e-5)
    _close(lse, torch.logsumexp(s.detach(), -1), 1e-5)
    grads = [kernels.flash_attention_block_backward(dout.float(), q, k[:, a:e], v[:, a:e], out, lse, c)
             for a, e, c in ((0, half, False), (half, sk, causal))]
    _close(grads[0][0] + grads[1][0], qr.grad, 1e-5)
    _close(torch.cat([grads[0][1], grads[1][1]], 1), kr.grad, 1e-5)
    _close(torch.cat([grads[0][2], grads[1][2]], 1), vr.grad, 1e-5)
