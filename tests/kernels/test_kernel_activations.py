import math

import pytest
import torch
import torch.nn.functional as F

import kernels

from kernel_testutil import backend, check, cuda_relerr_ok  # noqa: F401


def _ref_bias_gelu(x, b):
    z = x + b
    return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))


def _ref_swiglu(x):
    g, u = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return g / (1 + torch.exp(-g)) * u


def test_bias_gelu(backend):
    x = (torch.randn(3, 37, 1000) * 2).requires_grad_()
    b = torch.randn(1000).requires_grad_()
    check(kernels.bias_gelu, _ref_bias_gelu, [x, b])


def test_swiglu(backend):
    x = (torch.randn(3, 37, 2 * 1000) * 2).requires_grad_()
    check(kernels.swiglu, _ref_swiglu, [x])


def test_swiglu_strided(backend):
    """A non-contiguous input (slice of a wider projection output)."""
    x = (torch.randn(37, 2 * 1000 + 6) * 2)[:, 3:-3].requires_grad_()
    check(kernels.swiglu, _ref_swiglu, [x])


def test_fallbacks_are_plain_torch():
    x, b = torch.randn(37, 1000), torch.randn(1000)
    with kernels.use_backend("torch"):
        assert torch.equal(kernels.bias_gelu(x, b), F.gelu(x + b, approximate="tanh"))
        y = torch.randn(37, 2000)
        assert torch.equal(kernels.swiglu(y), F.silu(y[:, :1000]) * y[:, 1000:])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_activations_cuda(dtype, tol):
    torch.manual_seed(0)
    x = torch.randn(8 * 2048, 16384, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(16384, device="cuda", dtype=dtype, requires_grad=True)
    for fn, ref, args in [(kernels.bias_gelu, _ref_bias_gelu, (x, b)), (kernels.swiglu, _ref_swiglu, (x,))]:
        y = fn(*args)
        dy = torch.randn_like(y)
        g = torch.autograd.grad(y, args, dy)
        ra = [a.detach().float().requires_grad_() for a in args]
        yr = ref(*ra)
        gr = torch.autograd.grad(yr, ra, dy.float())
        cuda_relerr_ok(y, yr, tol)
        for a, r in zip(g, gr):
            # dbias sums 16K rows: compare with a looser, still dtype-scaled bound
            cuda_relerr_ok(a, r, tol if a.dim() > 1 else 4 * tol)
