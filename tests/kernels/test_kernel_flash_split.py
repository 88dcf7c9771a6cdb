"""Flash attention's unmasked / masked split (kernels/flash_attention_fwd.py, _bwd.py) under the interpreter.

Each kernel walks the key (or, for dK/dV, query) blocks every row sees whole with no mask, then the causal
diagonal, the ragged tail and padded keys masked. These tests put the block edges everywhere that split can go
wrong: sequence lengths that are and are not multiples of the blocks, causal with sq < sk and sq > sk (queries
that see no key), GQA groups walked in one flat loop, key padding, tensor descriptors (TMA) forced on, strided
inputs, and every block shape of the tuning space at small sizes. Forward and every gradient against float64,
outputs poisoned (NaN) before the run.
"""
import importlib

import pytest
import torch

import kernels
from kernels import _dispatch

from kernel_testutil import check

fa_mod = importlib.import_module("kernels.flash_attention")


def _ref(q, k, v, causal, scale, kpm):
    """float64 attention; a query that sees no key gets zeros (the kernels' and SDPA's contract)."""
    h, hk = q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(h // hk, dim=2), v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    sq, sk = q.shape[1], k.shape[1]
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        ok = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
    ok = ok[None, None] if kpm is None else ok[None, None] & kpm[:, None, None, :]
    p = torch.softmax(s.masked_fill(~ok, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setattr(_dispatch, "POISON", True)
    with kernels.use_backend("triton"):
        yield


def _run(shape, causal, blocks, kpm_lengths=None, tma=None, monkeypatch=None, strided=False, seed=0):
    b, sq, sk, h, hk, d = shape
    monkeypatch.setattr(fa_mod, "FWD_BLOCKS", blocks)
    monkeypatch.setattr(fa_mod, "BWD_BLOCKS", blocks)
    monkeypatch.setattr(fa_mod, "TMA", tma)
    g = torch.Generator().manual_seed(seed)
    if strided:  # q, k, v as views of one fused projection [b, s, h + 2 hk, d] (sq == sk)
        qkv = torch.randn(b, sq, h + 2 * hk, d, generator=g).requires_grad_()
        q, k, v = qkv.split([h, hk, hk], dim=2)
    else:
        q = torch.randn(b, sq, h, d, generator=g).requires_grad_()
        k = torch.randn(b, sk, hk, d, generator=g).requires_grad_()
        v = torch.randn(b, sk, hk, d, generator=g).requires_grad_()
    kpm = None
    if kpm_lengths is not None:
        kpm = torch.arange(sk)[None, :] < torch.tensor(kpm_lengths)[:, None]
    scale = 0.9 / d ** 0.5
    return check(lambda q, k, v: kernels.flash_attention(q, k, v, causal, scale, key_padding_mask=kpm),
                 lambda q, k, v: _ref(q, k, v, causal, scale, kpm), [q, k, v])


@pytest.mark.parametrize("shape,causal,blocks", [
    ((1, 64, 64, 2, 1, 16), True, (16, 16)),     # lengths multiples of the blocks: 3 unmasked + 1 diagonal
    ((2, 50, 50, 2, 2, 16), True, (16, 16)),     # ragged: the last block is diagonal and tail at once
    ((1, 37, 100, 4, 2, 16), True, (16, 32)),    # sq < sk: early keys visible to every query (bottom-right)
    ((1, 100, 37, 2, 1, 16), True, (32, 16)),    # sq > sk: the first 63 queries see no key (zero rows)
    ((1, 45, 70, 2, 1, 32), False, (16, 32)),    # no causal mask: only the tails masked
    ((1, 96, 96, 6, 2, 16), True, (32, 32)),     # GQA 3:1, the dK/dV loop running over (head, block) pairs
])
def test_split_matches_float64(triton_path, monkeypatch, shape, causal, blocks):
    _run(shape, causal, blocks, monkeypatch=monkeypatch)


@pytest.mark.parametrize("causal", [True, False])
def test_key_padding_everywhere_masked(triton_path, monkeypatch, causal):
    _run((3, 48, 48, 2, 1, 16), causal, (16, 16), kpm_lengths=[48, 21, 5], monkeypatch=monkeypatch)


@pytest.mark.parametrize("shape,causal", [((2, 50, 50, 2, 1, 16), True), ((1, 37, 70, 2, 2, 32), False)])
def test_tensor_descriptors(triton_path, monkeypatch, shape, causal):
    """TMA forced on (the interpreter runs descriptors): rows past a batch's end read the next batch's keys,
    which the mask and the +inf log-sum-exp must keep out; rows past the tensor read zeros."""
    _run(shape, causal, (16, 16), tma=True, monkeypatch=monkeypatch)


def test_tensor_descriptors_on_a_fused_projection(triton_path, monkeypatch):
    b, s, h, hk, d = 2, 40, 2, 1, 16
    monkeypatch.setattr(fa_mod, "TMA", True)
    assert fa_mod._tma(torch.empty(b, s, h + 2 * hk, d)[:, :, :h])  # a [b*s, h*d] view with a longer row
    _run((b, s, s, h, hk, d), True, (16, 16), tma=True, monkeypatch=monkeypatch, strided=True)


@pytest.mark.parametrize("bm", [64, 128])
@pytest.mark.parametrize("bn", [32, 64, 128])
def test_every_block_shape_of_the_space(triton_path, monkeypatch, bm, bn):
    """The tuning space's BLOCK_M x BLOCK_N (warps and stages do not exist in the interpreter)."""
    _run((1, 150, 150, 2, 1, 16), True, (bm, bn), monkeypatch=monkeypatch)


def test_descriptor_rules():
    """TMA only where the [b, s, h, d] tensor is a [b * s, h * d] view with 16-byte rows and a power-of-two d."""
    t = torch.empty(2, 8, 4, 64)
    assert fa_mod._tma(t) is False  # no sm_90 here: TMA is opt-in on this machine
    fa_mod.TMA = True
    try:
        assert fa_mod._tma(t)
        assert not fa_mod._tma(torch.empty(2, 8, 4, 80))                     # head dim not a power of two
        assert not fa_mod._tma(torch.empty(2, 4, 8, 64).transpose(1, 2))    # heads outer: no [b * s, h * d]
        assert not fa_mod._tma(torch.empty(2, 8, 4, 65)[..., :64])           # rows of 65 elements: not 16-byte
    finally:
        fa_mod.TMA = None


def test_non_positive_scale_is_refused():
    """The unmasked loop folds the scale into exp2's FMA after the row maximum, right only for a positive
    scale (SDPA on CPU returns NaN for a negative one): one clear error on both paths."""
    q = torch.randn(1, 20, 2, 16)
    for backend in ("triton", "torch"):
        with kernels.use_backend(backend), pytest.raises(ValueError, match="softmax_scale must be positive"):
            kernels.flash_attention(q, q, q, True, -0.3)
