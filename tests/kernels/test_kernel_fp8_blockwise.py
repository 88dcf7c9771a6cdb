"""kernels.fp8_blockwise.blockwise_mm (Triton interpreter on CPU): DeepSeek-V3's blockwise-scaled FP8 GEMM
against the float64 product of the dequantized operands, within the bound of its fp32 sums; and the
--fp8-recipe blockwise layers through it against the torch path."""
import types

import pytest
import torch

import kernels
from kernels.fp8_blockwise import blockwise_mm
from megalite.tensor_parallel.fp8 import Fp8Site, blocks, fp8_linear, quantized_blocks

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _bound(da, db):
    """Elementwise: each output is a K-term fp32 sum (the K-blocks' partial sums, each rescaled by two
    multiplications, added in turn), so it is within (K + 3) units of roundoff of sum |a| |b|."""
    return (da.shape[1] + 3) * 2.0 ** -24 * (da.abs().double() @ db.abs().double())


@pytest.mark.parametrize("m,k,n,group,dtypes", [
    (37, 200, 150, 128, (E4M3, E4M3)),  # forward: x tiles, w blocks, partial blocks everywhere
    (64, 256, 96, 128, (E5M2, E4M3)),  # hybrid's input gradient: dy in e5m2
    (48, 300, 40, 1, (E5M2, E4M3)),  # weight gradient: tiles along the tokens of both
])
def test_blockwise_mm_is_the_product_of_the_dequantized_operands(m, k, n, group, dtypes):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k)  # (scales that differ block to block)
    b_rows = torch.randn(n, k, generator=g) * 4  # b is given transposed (strided), as a weight is
    aq, sa = quantized_blocks(a, 1, 128, dtypes[0], 0)
    bq, sb = quantized_blocks(b_rows, group if group > 1 else 1, 128, dtypes[1], 0)
    da, db = blocks(a, 1, 128, dtypes[0], 0), blocks(b_rows, group if group > 1 else 1, 128, dtypes[1], 0).t()
    with kernels.use_backend("triton"):
        c = blockwise_mm(aq, sa, bq.t(), sb.t(), group, torch.float32)
    ref = da.double() @ db.double()
    assert ((c.double() - ref).abs() <= _bound(da, db)).all(), (c.double() - ref).abs().max()
    with kernels.use_backend("torch"):
        assert torch.equal(blockwise_mm(aq, sa, bq.t(), sb.t(), group, torch.float32), (da @ db))


def test_scales_that_do_not_fit_are_refused():
    a, b = torch.zeros(4, 256).to(E4M3), torch.zeros(256, 8).to(E4M3)
    with pytest.raises(ValueError, match=r"kernels.blockwise_mm: scales \(4, 1\) / \(2, 1\) do not fit"):
        blockwise_mm(a, torch.ones(4, 1), b, torch.ones(2, 1), 128, torch.float32)


def _layer(backend):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 50, 256, generator=g) * 3).requires_grad_(True)
    w = torch.randn(192, 256, generator=g).requires_grad_(True)
    with kernels.use_backend(backend):
        y = fp8_linear(x, w, Fp8Site("hybrid", "blockwise", grid=types.SimpleNamespace(tp=1, cp=1)))
        y.backward(torch.randn(y.shape, generator=g) * 1e-2)
    return y.detach(), x.grad, w.grad


def test_blockwise_layers_through_the_kernel_are_the_torch_path():
    """Forward, input and weight gradients of a blockwise FP8 layer through the kernel equal the torch path's (the
    fp32 product of the dequantized operands) within fp32's reordered sums (K = 256 and 150 terms: 2^-15 of the
    largest)."""
    for got, want in zip(_layer("triton"), _layer("torch")):
        assert (got - want).abs().max() <= 2.0 ** -15 * want.abs().max(), (got - want).abs().max()


def test_no_fused_kernels_keeps_the_blockwise_gemm_in_torch(monkeypatch):
    from kernels import fp8_blockwise as module
    ran = []
    monkeypatch.setattr(module._blockwise_mm, "run", lambda *a, **k: ran.append(1))
    x, w = torch.randn(4, 128, requires_grad=True), torch.randn(128, 128, requires_grad=True)
    with kernels.use_backend("triton"):
        site = Fp8Site("e4m3", "blockwise", grid=types.SimpleNamespace(tp=1, cp=1), fused=False)
        fp8_linear(x, w, site).sum().backward()
    assert not ran
