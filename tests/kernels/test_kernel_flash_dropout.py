"""Flash attention's in-kernel dropout (Triton interpreter) against a reference mask built
independently from the same seed: a numpy Philox4x32-10 over the documented counters.

The seed is the one the kernel draws from the current torch generator (the test replays the
generator to get it). The reference mask must equal the mask the forward applied (read off
the output with one-hot values) and drive a float64 reference that matches the forward and
all three gradients (so the backward regenerates the very same mask); the keep rate is 1 - p.
"""
import numpy as np
import pytest
import torch

import kernels
from kernels import _dispatch
from kernel_testutil import check

M32 = 0xFFFFFFFF


def philox_keep(seed, b, h, sq, sk, p):
    """bool [b, h, sq, sk]: kept iff (Philox(key=seed, ctr=(i*ceil(sk/4) + j//4, b*h+h, 0, 0))[j % 4] >> 1) >=
    round(p*2^31): one Philox call per 4 keys, each key one of its words."""
    sk4 = -(-sk // 4)
    i, g = np.meshgrid(np.arange(sq, dtype=np.uint64), np.arange(sk4, dtype=np.uint64), indexing="ij")
    bh = np.arange(b * h, dtype=np.uint64)[:, None, None]
    c0 = np.broadcast_to((i * sk4 + g) & M32, (b * h, sq, sk4)).copy()
    c1 = np.broadcast_to(bh, c0.shape).copy()
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0, k1 = np.uint64(seed & M32), np.uint64(seed >> 32 & M32)
    ra, rb = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        p0, p2 = c0 * ra, c2 * rb  # 32x32 -> 64-bit products
        c0, c2, c1, c3 = (p2 >> np.uint64(32)) ^ c1 ^ k0, (p0 >> np.uint64(32)) ^ c3 ^ k1, p2 & M32, p0 & M32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & M32, (k1 + np.uint64(0xBB67AE85)) & M32
    words = np.stack([c0, c1, c2, c3], axis=-1).reshape(b * h, sq, 4 * sk4)[..., :sk]  # key j: word j % 4
    keep = (words >> np.uint64(1)).astype(np.int64) >= int(round(p * 2 ** 31))
    return torch.from_numpy(keep.reshape(b, h, sq, sk))


def _run_triton(fn, *args):
    _dispatch.POISON = True
    try:
        with kernels.use_backend("triton"):
            state = torch.get_rng_state()
            out = fn(*args)
    finally:
        _dispatch.POISON = False
    after = torch.get_rng_state()
    torch.set_rng_state(state)  # replay the draw the kernel made
    seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64))
    assert torch.equal(torch.get_rng_state(), after), "the kernel must draw exactly one seed from the generator"
    return out, seed


def _ref(q, k, v, causal, scale, keep, p):
    h, hk = q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(h // hk, dim=2), v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    sq, sk = q.shape[1], k.shape[1]
    if causal:
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq), float("-inf"))
    probs = torch.softmax(s, dim=-1) * keep / (1.0 - p)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def test_mask_equals_reference_and_keep_rate():
    """q = 0 gives uniform probabilities and one-hot v[j] = e_j makes the output the dropped
    probability matrix itself: o[b, i, h, j] = keep[b, h, i, j] / (sk * (1 - p))."""
    b, s, h, d, p = 2, 64, 3, 64, 0.3
    q = torch.zeros(b, s, h, d)
    k = torch.randn(b, s, h, d)
    v = torch.eye(s, d).expand(b, h, s, d).transpose(1, 2).contiguous()
    o, seed = _run_triton(lambda: kernels.flash_attention(q, k, v, causal=False, dropout_p=p))
    ref = philox_keep(seed, b, h, s, s, p)
    got = o.permute(0, 2, 1, 3)[..., :s]
    assert torch.isfinite(got).all()
    assert torch.equal(got > 0, ref), f"{(got > 0).ne(ref).sum()} mask elements differ from the reference"
    expect = ref.float() / (s * (1 - p))
    # probabilities exactly 1/s (q = 0), scaled by 1 / (1 - p) and summed with zeros: 1-2 roundings
    assert torch.allclose(got, expect, rtol=1e-6, atol=0), (got - expect).abs().max()
    rate, n = ref.float().mean().item(), ref.numel()
    assert abs(rate - (1 - p)) < 5 * ((p * (1 - p)) / n) ** 0.5, f"keep rate {rate:.4f}, want {1 - p}"
    o2, seed2 = _run_triton(lambda: kernels.flash_attention(q, q, v, causal=False, dropout_p=p))
    assert seed2 != seed and not torch.equal(o2, o), "a second call must draw a new mask"


@pytest.mark.parametrize("causal,shape,p", [
    (True, (2, 37, 45, 4, 2, 64), 0.1),     # GQA 2:1, sq != sk (bottom-right causal), odd lengths
    (False, (1, 50, 50, 2, 2, 32), 0.5),    # MHA, small head dim
])
def test_dropout_forward_and_backward_match_reference(causal, shape, p):
    b, sq, sk, h, hk, d = shape
    q = torch.randn(b, sq, h, d).requires_grad_()
    k, v = (torch.randn(b, sk, hk, d).requires_grad_() for _ in range(2))
    scale = 0.9 / d ** 0.5
    torch.manual_seed(torch.randint(0, 1000, ()).item())
    state = torch.get_rng_state()
    seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64))
    keep = philox_keep(seed, b, h, sq, sk, p).double()
    torch.set_rng_state(state)  # the kernel draws this same seed
    _dispatch.POISON = True
    try:
        with kernels.use_backend("triton"):
            check(lambda q, k, v: kernels.flash_attention(q, k, v, causal, scale, dropout_p=p),
                  lambda q, k, v: _ref(q, k, v, causal, scale, keep, p), [q, k, v])
    finally:
        _dispatch.POISON = False


def test_torch_path_dropout_runs_and_rejects_bad_p():
    q = torch.randn(2, 20, 4, 16)
    o = kernels.flash_attention(q, q[:, :, :2], q[:, :, :2], dropout_p=0.2)
    assert o.shape == q.shape and torch.isfinite(o).all()
    with pytest.raises(ValueError, match="dropout_p"):
        kernels.flash_attention(q, q, q, dropout_p=1.0)
