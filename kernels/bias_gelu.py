"""Fused bias + tanh-GeLU (Megatron's bias_gelu): y = gelu_tanh(x + bias), bias over the last dim."""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._dispatch import empty_like, use_triton

BLOCK = 1024


@triton.jit
def _tanh(z):
    return 2.0 * tl.sigmoid(2.0 * z) - 1.0  # no portable tl.tanh across Triton versions


@triton.jit
def _bias_gelu_kernel(X, B, DY, OUT, numel, N, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    msk = offs < numel
    z = tl.load(X + offs, mask=msk, other=0.0).to(tl.float32) + \
        tl.load(B + offs % N, mask=msk, other=0.0).to(tl.float32)
    t = _tanh(0.7978845608028654 * z * (1.0 + 0.044715 * z * z))
    if BACKWARD:
        dy = tl.load(DY + offs, mask=msk, other=0.0).to(tl.float32)
        d = 0.5 * z * (1.0 - t * t) * (0.7978845608028654 + 0.1070322243 * z * z) + 0.5 * (1.0 + t)
        out = dy * d
    else:
        out = 0.5 * z * (1.0 + t)
    tl.store(OUT + offs, out.to(OUT.dtype.element_ty), mask=msk)


class _BiasGeluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        x = x.contiguous()
        y = empty_like(x)
        if x.numel():
            _bias_gelu_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, bias, x, y, x.numel(), x.shape[-1],
                                                                 BACKWARD=False, BLOCK=BLOCK, num_warps=4)
        ctx.save_for_backward(x, bias)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dy = dy.contiguous()
        dx = empty_like(x)
        if x.numel():
            _bias_gelu_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, bias, dy, dx, x.numel(), x.shape[-1],
                                                                 BACKWARD=True, BLOCK=BLOCK, num_warps=4)
        dbias = dx.reshape(-1, x.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)
        return dx, dbias


def bias_gelu(x, bias):
    """gelu(x + bias, approximate='tanh'); bias [N] broadcast over x [..., N]."""
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"kernels.bias_gelu: bias must be [{x.shape[-1]}], got {tuple(bias.shape)}")
    if use_triton(x, bias, kernel="bias_gelu"):
        return _BiasGeluFn.apply(x, bias)
    return F.gelu(x + bias, approximate="tanh")
