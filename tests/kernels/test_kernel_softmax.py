import pytest
import torch

import kernels

from kernel_testutil import backend, check, cuda_relerr_ok  # noqa: F401


def _ref(x, scale, mask, causal):
    s = x * scale
    sq, sk = x.shape[-2:]
    drop = torch.zeros(sq, sk, dtype=torch.bool)
    if causal:
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        drop = j > i + (sk - sq)
    if mask is not None:
        drop = drop | mask
    s = torch.where(drop, torch.full_like(s, -10000.0), s)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


@pytest.mark.parametrize("mask_shape,causal,sq", [
    (None, False, 37),
    (None, True, 100),          # square: Megatron's upper-triangular softmax
    (None, True, 37),           # sq < sk: bottom-right aligned
    ((3, 1, 37, 100), False, 37),
    ((3, 1, 1, 100), True, 37),  # padding mask combined with causal
])
def test_softmax(backend, mask_shape, causal, sq):
    x = (torch.randn(3, 2 if sq < 100 else 1, sq, 100) * 3).requires_grad_()
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape) < 0.3
        if mask_shape[2] > 1:
            mask[1, 0, 5] = True  # a fully masked row: uniform, as Megatron
    scale = 0.37
    check(lambda x: kernels.softmax(x, scale, mask, causal), lambda x: _ref(x, scale, mask, causal), [x])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("causal", [True, False])
def test_softmax_cuda(dtype, tol, causal):
    torch.manual_seed(0)
    x = torch.randn(4, 16, 2048, 2048, device="cuda", dtype=dtype, requires_grad=True)
    mask = None if causal else torch.rand(4, 1, 1, 2048, device="cuda") < 0.2
    y = kernels.softmax(x, 0.125, mask, causal)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    xr = x.detach().float().requires_grad_()
    with kernels.use_backend("torch"):
        yr = kernels.softmax(xr, 0.125, mask, causal)
    (dxr,) = torch.autograd.grad(yr, xr, dy.float())
    cuda_relerr_ok(y, yr, tol)
    cuda_relerr_ok(dx, dxr, tol)
