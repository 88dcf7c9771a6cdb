"""Rotary position embedding, rotate-half (GPT-NeoX / Llama / Megatron) layout.

x: [b, s, h, d] (any strides with a unit last stride). cos, sin: [s, r] or [b or 1, s, 1, r]
with r <= d even (r < d: only the first r dims rotate, the rest pass through).
out[..., :r] = x_r * cos + rotate_half(x_r) * sin, rotate_half(v) = cat(-v2, v1).
The backward is the rotation by -theta. cos/sin get no gradient. inplace=True writes into x.
"""
import torch
import triton
import triton.language as tl

from ._dispatch import empty, use_triton


@triton.jit
def _rotary_kernel(X, OUT, COS, SIN, B, H, D, HALF,
                   sxb, sxs, sxh, sob, sos, soh, scb, scs, scd,
                   CONJ: tl.constexpr, COPY_REST: tl.constexpr, SHARED_CS: tl.constexpr, STAGES: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """One program: one position, BLOCK_H heads, every batch row. cos/sin are the same for all of them when the
    table is shared over the batch (SHARED_CS, stride 0): loaded once, before the loop, and reused; the batch
    loop is pipelined, so the next row's x is in flight while this one is stored."""
    si = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_HALF)
    cm = c < HALF
    msk = (heads[:, None] < H) & cm[None, :]
    xh = X + si * sxs + heads[:, None].to(tl.int64) * sxh
    oh = OUT + si * sos + heads[:, None].to(tl.int64) * soh
    if SHARED_CS:
        c1 = tl.load(COS + si * scs + c * scd, mask=cm, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(COS + si * scs + (c + HALF) * scd, mask=cm, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(SIN + si * scs + c * scd, mask=cm, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(SIN + si * scs + (c + HALF) * scd, mask=cm, other=0.0).to(tl.float32)[None, :]
    for bi in tl.range(0, B, num_stages=STAGES):
        xp = xh + tl.cast(bi, tl.int64) * sxb
        op = oh + tl.cast(bi, tl.int64) * sob
        if not SHARED_CS:  # per-sample positions: this row's own cos/sin
            cp = tl.cast(bi, tl.int64) * scb + si * scs
            c1 = tl.load(COS + cp + c * scd, mask=cm, other=0.0).to(tl.float32)[None, :]
            c2 = tl.load(COS + cp + (c + HALF) * scd, mask=cm, other=0.0).to(tl.float32)[None, :]
            s1 = tl.load(SIN + cp + c * scd, mask=cm, other=0.0).to(tl.float32)[None, :]
            s2 = tl.load(SIN + cp + (c + HALF) * scd, mask=cm, other=0.0).to(tl.float32)[None, :]
        x1 = tl.load(xp + c[None, :], mask=msk, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF + c[None, :], mask=msk, other=0.0).to(tl.float32)
        if CONJ:  # transpose of the rotation: dx = dy*cos + rotate_half^T(dy*sin)
            o1 = x1 * c1 + x2 * s2
            o2 = x2 * c2 - x1 * s1
        else:
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2 + x1 * s2
        tl.store(op + c[None, :], o1.to(OUT.dtype.element_ty), mask=msk)
        tl.store(op + HALF + c[None, :], o2.to(OUT.dtype.element_ty), mask=msk)
        if COPY_REST:  # pass-through dims when rotating only part of the head
            rc = 2 * HALF + tl.arange(0, BLOCK_REST)
            rm = (heads[:, None] < H) & (rc[None, :] < D)
            tl.store(op + rc[None, :], tl.load(xp + rc[None, :], mask=rm, other=0.0), mask=rm)


def _cos3(t, b, s):
    """cos/sin -> a [b, s, r] view (stride 0 where broadcast)."""
    if t.dim() == 2:
        t = t.unsqueeze(0)
    elif t.dim() == 4 and t.shape[2] == 1:
        t = t[:, :, 0, :]
    else:
        raise ValueError(f"kernels.rotary: cos/sin must be [s, r] or [b, s, 1, r], got {tuple(t.shape)}")
    return t.expand(b, s, t.shape[-1])


def _launch(x, out, cos, sin, conj):
    b, s, h, d = x.shape
    c3, s3 = _cos3(cos, b, s), _cos3(sin, b, s)
    if c3.stride() != s3.stride():  # the kernel indexes both with one set of strides
        c3, s3 = c3.contiguous(), s3.contiguous()
    half = c3.shape[-1] // 2
    bh = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(h), max(1, 4096 // bh))
    rest = d - 2 * half
    if x.numel():
        # pipelining only pays with a batch loop to overlap (and costs shared memory without one)
        _rotary_kernel[(s, triton.cdiv(h, block_h))](
            x, out, c3, s3, b, h, d, half, *x.stride()[:3], *out.stride()[:3], *c3.stride(),
            CONJ=conj, COPY_REST=rest > 0 and out is not x, SHARED_CS=c3.stride(0) == 0 or b == 1,
            STAGES=2 if b > 1 else 1, BLOCK_H=block_h, BLOCK_HALF=bh, BLOCK_REST=triton.next_power_of_2(max(rest, 1)),
            num_warps=4)


class _RotaryFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, inplace):
        if x.stride(-1) != 1:
            if inplace:
                raise ValueError("kernels.rotary: inplace needs a unit stride on the last dim")
            x = x.contiguous()
        out = x if inplace else empty(x.shape, x.device, x.dtype)
        _launch(x, out, cos, sin, conj=False)
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx = empty(dy.shape, dy.device, dy.dtype)
        _launch(dy, dx, cos, sin, conj=True)
        return dx, None, None, None


def _rotary_torch(x, cos, sin, inplace):
    r = cos.shape[-1]
    if cos.dim() == 2:  # [s, r] -> [s, 1, r] broadcasts over [b, s, h, r]
        cos, sin = cos[:, None, :], sin[:, None, :]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    xr = x[..., :r]
    x1, x2 = xr.chunk(2, dim=-1)
    out = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    if r < x.shape[-1]:
        out = torch.cat((out, x[..., r:]), dim=-1)
    return x.copy_(out) if inplace else out


def rotary(x, cos, sin, inplace=False):
    """Apply rotary embedding to x [b, s, h, d]; see the module docstring for cos/sin shapes."""
    r = cos.shape[-1]
    if x.dim() != 4 or r % 2 or r > x.shape[-1] or cos.shape != sin.shape:
        raise ValueError(f"kernels.rotary: need x [b, s, h, d] and cos/sin of one shape with even last dim "
                         f"<= d; got x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if use_triton(x, cos, sin, kernel="rotary"):
        return _RotaryFn.apply(x, cos, sin, inplace)
    return _rotary_torch(x, cos, sin, inplace)
