"""Megatron's scaled masked softmax and scaled upper-triangular (causal) softmax.

x: [b, h, sq, sk]; mask: bool, True = masked out, broadcastable to x (e.g. [b, 1, sq, sk] or
[b, 1, 1, sk]); masked scores are set to -10000 after scaling, as Megatron does (a fully
masked row therefore gets a uniform distribution, not NaN). causal masks key j > i + sk - sq
(square scores: the upper triangle). fp32 math, output in x's dtype. Rows longer than
MAX_TRITON_SK use the torch path.
"""
import torch
import triton
import triton.language as tl

from ._dispatch import empty_like, num_warps, use_triton

MAX_TRITON_SK = 32768
MASK_VALUE = -10000.0  # the torch path's; the kernel has it as a literal (a @jit function cannot
# read a Python global: the interpreter allows it, the GPU compiler rejects it)


@triton.jit
def _masked(cols, i, b, h, MASK, smb, smh, smq, smk, SQ, SK, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr):
    drop = cols >= SK
    if HAS_MASK:
        drop |= tl.load(MASK + b * smb + h * smh + i * smq + cols * smk, mask=cols < SK, other=0) != 0
    if CAUSAL:
        drop |= cols > i + SK - SQ
    return drop


@triton.jit
def _softmax_fwd(X, Y, MASK, scale, H, SQ, SK, smb, smh, smq, smk,
                 HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = row % SQ
    h = (row // SQ) % H
    b = row // (SQ * H)
    cols = tl.arange(0, BLOCK)
    valid = cols < SK
    x = tl.load(X + row * SK + cols, mask=valid, other=0.0).to(tl.float32) * scale
    x = tl.where(_masked(cols, i, b, h, MASK, smb, smh, smq, smk, SQ, SK, HAS_MASK, CAUSAL), -10000.0, x)
    x = tl.where(valid, x, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(Y + row * SK + cols, (e / tl.sum(e, axis=0)).to(Y.dtype.element_ty), mask=valid)


@triton.jit
def _softmax_bwd(Y, DY, DX, MASK, scale, H, SQ, SK, smb, smh, smq, smk,
                 HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = row % SQ
    h = (row // SQ) % H
    b = row // (SQ * H)
    cols = tl.arange(0, BLOCK)
    valid = cols < SK
    y = tl.load(Y + row * SK + cols, mask=valid, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * SK + cols, mask=valid, other=0.0).to(tl.float32)
    dx = scale * y * (dy - tl.sum(y * dy, axis=0))
    # masked_fill blocks the gradient of masked scores
    dx = tl.where(_masked(cols, i, b, h, MASK, smb, smh, smq, smk, SQ, SK, HAS_MASK, CAUSAL), 0.0, dx)
    tl.store(DX + row * SK + cols, dx.to(DX.dtype.element_ty), mask=valid)


def _mask_args(mask, x):
    if mask is None:
        return x, (0, 0, 0, 0)  # dummy pointer, never read
    m = torch.broadcast_to(mask, x.shape).view(torch.uint8)  # stride-0 broadcast, no copy
    return m, tuple(m.stride())


class _SoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, mask, causal):
        x = x.contiguous()
        b, h, sq, sk = x.shape
        y = empty_like(x)
        m, ms = _mask_args(mask, x)
        block = triton.next_power_of_2(sk)
        if x.numel():
            _softmax_fwd[(b * h * sq,)](x, y, m, scale, h, sq, sk, *ms, HAS_MASK=mask is not None,
                                        CAUSAL=causal, BLOCK=block, num_warps=num_warps(block))
        ctx.save_for_backward(y, mask)
        ctx.scale, ctx.causal = scale, causal
        return y

    @staticmethod
    def backward(ctx, dy):
        y, mask = ctx.saved_tensors
        dy = dy.contiguous()
        b, h, sq, sk = y.shape
        dx = empty_like(y)
        m, ms = _mask_args(mask, y)
        block = triton.next_power_of_2(sk)
        if y.numel():
            _softmax_bwd[(b * h * sq,)](y, dy, dx, m, ctx.scale, h, sq, sk, *ms, HAS_MASK=mask is not None,
                                        CAUSAL=ctx.causal, BLOCK=block, num_warps=num_warps(block))
        return dx, None, None, None


def _softmax_torch(x, scale, mask, causal):
    s = x.float()
    if scale != 1.0:
        s = s * scale
    if causal:
        sq, sk = x.shape[-2:]
        tri = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu_(sk - sq + 1)
        mask = tri if mask is None else (mask | tri)
    if mask is not None:
        s = s.masked_fill(mask, MASK_VALUE)
    return torch.softmax(s, dim=-1).to(x.dtype)


def softmax(x, scale=1.0, mask=None, causal=False):
    """softmax(masked(x * scale)) over the last dim of x [b, h, sq, sk]; see module docstring."""
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"kernels.softmax: mask must be bool (True = masked out), got {mask.dtype}")
    if x.dim() == 4 and x.shape[-1] <= MAX_TRITON_SK and use_triton(x, mask, kernel="softmax"):
        return _SoftmaxFn.apply(x, float(scale), mask, bool(causal))
    return _softmax_torch(x, scale, mask, causal)
