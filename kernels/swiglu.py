"""SwiGLU: x = [gate | up] on the last dim (2N) -> silu(gate) * up ([..., N])."""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._dispatch import empty, use_triton

BLOCK = 1024


@triton.jit
def _swiglu_fwd(X, Y, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    msk = cols < N
    g = tl.load(X + row * 2 * N + cols, mask=msk, other=0.0).to(tl.float32)
    u = tl.load(X + row * 2 * N + N + cols, mask=msk, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=msk)


@triton.jit
def _swiglu_bwd(X, DY, DX, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    msk = cols < N
    g = tl.load(X + row * 2 * N + cols, mask=msk, other=0.0).to(tl.float32)
    u = tl.load(X + row * 2 * N + N + cols, mask=msk, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * N + cols, mask=msk, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    tl.store(DX + row * 2 * N + cols, dg.to(DX.dtype.element_ty), mask=msk)
    tl.store(DX + row * 2 * N + N + cols, (dy * g * s).to(DX.dtype.element_ty), mask=msk)


class _SwigluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        n = x.shape[-1] // 2
        m = x.numel() // max(1, 2 * n)
        y = empty(x.shape[:-1] + (n,), x.device, x.dtype)
        if x.numel():
            _swiglu_fwd[(m, triton.cdiv(n, BLOCK))](x, y, n, BLOCK=BLOCK, num_warps=4)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dy = dy.contiguous()
        n = x.shape[-1] // 2
        dx = empty(x.shape, x.device, x.dtype)
        if x.numel():
            _swiglu_bwd[(x.numel() // (2 * n), triton.cdiv(n, BLOCK))](x, dy, dx, n, BLOCK=BLOCK, num_warps=4)
        return dx


def swiglu(x):
    """silu(gate) * up where gate, up = x.chunk(2, dim=-1) (Megatron's --swiglu layout)."""
    if x.shape[-1] % 2:
        raise ValueError(f"kernels.swiglu: last dim must be even ([gate | up]), got {x.shape[-1]}")
    if use_triton(x, kernel="swiglu"):
        return _SwigluFn.apply(x)
    g, u = torch.chunk(x, 2, dim=-1)
    return F.silu(g) * u
