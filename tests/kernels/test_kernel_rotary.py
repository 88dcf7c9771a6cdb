import pytest
import torch

import kernels

from kernel_testutil import backend, check, cuda_relerr_ok  # noqa: F401


def _ref(x, cos, sin):
    r = cos.shape[-1]
    if cos.dim() == 2:
        cos, sin = cos[:, None, :], sin[:, None, :]
    xr, rest = x[..., :r], x[..., r:]
    x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
    c1, c2 = cos[..., : r // 2], cos[..., r // 2:]
    s1, s2 = sin[..., : r // 2], sin[..., r // 2:]
    return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, rest), dim=-1)


def _freqs(b, s, r, d_base=10000.0):
    inv = 1.0 / d_base ** (torch.arange(0, r, 2).double() / r)
    pos = torch.randint(0, 4096, (b, s)).double() if b else torch.arange(s).double()
    ang = pos[..., None] * inv
    ang = torch.cat((ang, ang), -1)
    if b:
        ang = ang[:, :, None, :]
    return ang.cos().float(), ang.sin().float()


@pytest.mark.parametrize("layout", ["s_d", "b_s_1_r_partial", "strided_qkv", "b1_s_1_r"])
def test_rotary(backend, layout):
    """cos/sin shared over the batch (loaded once a program, the batch loop reusing them), per sample (loaded in
    the loop), and per sample with one sample (treated as shared)."""
    b, s, h, d = 1 if layout == "b1_s_1_r" else 3, 100 if layout == "s_d" else 37, 4, 64
    if layout == "strided_qkv":  # q as a view of a fused [b, s, h, 3d] projection
        x = torch.randn(b, s, h, 3 * d)[..., d: 2 * d].requires_grad_()
        assert not x.is_contiguous()
    else:
        x = torch.randn(b, s, h, d).requires_grad_()
    if layout in ("b_s_1_r_partial", "b1_s_1_r"):  # per-sample positions; halves differ so a half swap shows up
        cos, sin = _freqs(b, s, 48 if layout == "b_s_1_r_partial" else d)
        cos, sin = cos + 0.3 * torch.randn_like(cos), sin + 0.3 * torch.randn_like(sin)
    else:
        cos, sin = _freqs(0, s, d)
    check(lambda x: kernels.rotary(x, cos, sin), lambda x: _ref(x, cos.double(), sin.double()), [x])


def test_rotary_inplace(backend):
    b, s, h, d = 3, 37, 4, 64
    cos, sin = _freqs(0, s, d)
    leaf = torch.randn(b, s, h, d, requires_grad=True)
    check(lambda x: kernels.rotary(x * 1.0, cos, sin, inplace=True),
          lambda x: _ref(x, cos.double(), sin.double()), [leaf])
    y = torch.randn(b, s, h, d)
    ptr = y.data_ptr()
    out = kernels.rotary(y, cos, sin, inplace=True)
    assert out.data_ptr() == ptr


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_rotary_cuda(dtype, tol):
    torch.manual_seed(0)
    b, s, h, d = 4, 4096, 32, 128
    x = torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True)
    cos, sin = (t.cuda() for t in _freqs(0, s, d))
    y = kernels.rotary(x, cos, sin)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    xr = x.detach().float().requires_grad_()
    yr = _ref(xr, cos, sin)
    (dxr,) = torch.autograd.grad(yr, xr, dy.float())
    cuda_relerr_ok(y, yr, tol)
    cuda_relerr_ok(dx, dxr, tol)
