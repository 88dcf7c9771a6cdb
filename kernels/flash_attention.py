"""FlashAttention-2 in Triton: online-softmax forward saving logsumexp, recomputing backward.

flash_attention(q, k, v, causal=True, softmax_scale=None, key_padding_mask=None)
  q [b, sq, h, d]; k, v [b, sk, hk, d] with h % hk == 0 (GQA/MQA); any seq lengths, any d
  (64/128 are the tuned cases); returns [b, sq, h, d] in q's dtype.
  causal: query i sees key j iff j <= i + sk - sq (bottom-right aligned, as flash-attn >= 2.1;
  the usual upper-triangular mask when sq == sk).
  key_padding_mask: bool [b, sk], True = real token (kept), False = padding (as Hugging Face's
  attention_mask and SDPA's boolean attn_mask; note kernels.softmax's mask is the opposite).
  A query that sees no key gets a zero output and zero gradients (as SDPA).
Backward: delta = rowsum(dO * O) first; then one kernel per K/V block (looping over the q
heads of its GQA group, so dK/dV need no atomics) and one per Q block for dQ.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._dispatch import INTERPRET, empty, use_triton

LOG2E = 1.4426950408889634
FWD_BLOCKS = (128, 64)  # (BLOCK_M, BLOCK_N); tests may shrink them
BWD_BLOCKS = (64, 64)


@triton.jit
def _visible(rows, cols, b, KPM, skpm, SQ, SK, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr):
    ok = (rows[:, None] < SQ) & (cols[None, :] < SK)
    if CAUSAL:
        ok &= cols[None, :] <= rows[:, None] + (SK - SQ)
    if HAS_KPM:
        ok &= (tl.load(KPM + b * skpm + cols, mask=cols < SK, other=0) != 0)[None, :]
    return ok


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, KPM, qk_scale, H, GROUP, SQ, SK, D,
              sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, skpm,
              CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, PREC: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dc = tl.arange(0, BLOCK_D)
    dm = dc[None, :] < D
    q = tl.load(Q + b * sqb + rows[:, None].to(tl.int64) * sqs + h * sqh + dc[None, :],
                mask=(rows[:, None] < SQ) & dm, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = SK
    if CAUSAL:  # blocks entirely right of the diagonal are skipped
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M + SK - SQ)
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kv_off = cols[:, None].to(tl.int64)
        kvm = (cols[:, None] < SK) & dm
        k = tl.load(K + b * skb + kv_off * sks + hk * skh + dc[None, :], mask=kvm, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # log2 units
        s = tl.where(_visible(rows, cols, b, KPM, skpm, SQ, SK, CAUSAL, HAS_KPM), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + b * svb + kv_off * svs + hk * svh + dc[None, :], mask=kvm, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    empty_row = l_i == 0.0
    o = acc / tl.where(empty_row, 1.0, l_i)[:, None]
    tl.store(O + b * sob + rows[:, None].to(tl.int64) * sos + h * soh + dc[None, :],
             o.to(O.dtype.element_ty), mask=(rows[:, None] < SQ) & dm)
    # base-2 logsumexp; +inf for empty rows makes every recomputed probability 0
    tl.store(LSE + bh.to(tl.int64) * SQ + rows, tl.where(empty_row, float("inf"), m_i + tl.log2(tl.where(empty_row, 1.0, l_i))),
             mask=rows < SQ)


@triton.jit
def _attn_bwd_delta(O, DO, DELTA, H, SQ, D, sob, sos, soh, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dc = tl.arange(0, BLOCK_D)
    msk = (rows[:, None] < SQ) & (dc[None, :] < D)
    off = b * sob + rows[:, None].to(tl.int64) * sos + (bh % H) * soh + dc[None, :]
    o = tl.load(O + off, mask=msk, other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=msk, other=0.0).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * SQ + rows, tl.sum(o * do, axis=1), mask=rows < SQ)


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, KPM, qk_scale, sm_scale, H, HK, GROUP, SQ, SK, D,
                   sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, sdb, sds, sdh, skpm,
                   CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, PREC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = (bhk // HK).to(tl.int64)
    hk = bhk % HK
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dc = tl.arange(0, BLOCK_D)
    dm = dc[None, :] < D
    kvm = (cols[:, None] < SK) & dm
    kv_off = cols[:, None].to(tl.int64)
    k = tl.load(K + b * skb + kv_off * sks + hk * skh + dc[None, :], mask=kvm, other=0.0)
    v = tl.load(V + b * svb + kv_off * svs + hk * svh + dc[None, :], mask=kvm, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo = 0
    if CAUSAL:  # queries above this key block see none of it
        lo = tl.maximum(0, pid_n * BLOCK_N - (SK - SQ)) // BLOCK_M * BLOCK_M
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        for start in range(lo, SQ, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            r_off = rows[:, None].to(tl.int64)
            qm = (rows[:, None] < SQ) & dm
            q = tl.load(Q + b * sqb + r_off * sqs + h * sqh + dc[None, :], mask=qm, other=0.0)
            do = tl.load(DO + b * sob + r_off * sos + h * soh + dc[None, :], mask=qm, other=0.0)
            lse = tl.load(LSE + bh * SQ + rows, mask=rows < SQ, other=float("inf"))
            delta = tl.load(DELTA + bh * SQ + rows, mask=rows < SQ, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            p = tl.exp2(s - lse[:, None])
            p = tl.where(_visible(rows, cols, b, KPM, skpm, SQ, SK, CAUSAL, HAS_KPM), p, 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
    out = b * sdb + kv_off * sds + hk * sdh + dc[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=kvm)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kvm)


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, KPM, qk_scale, sm_scale, H, GROUP, SQ, SK, D,
                 sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, skpm,
                 CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, PREC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dc = tl.arange(0, BLOCK_D)
    dm = dc[None, :] < D
    qm = (rows[:, None] < SQ) & dm
    r_off = rows[:, None].to(tl.int64)
    q = tl.load(Q + b * sqb + r_off * sqs + h * sqh + dc[None, :], mask=qm, other=0.0)
    do = tl.load(DO + b * sob + r_off * sos + h * soh + dc[None, :], mask=qm, other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * SQ + rows, mask=rows < SQ, other=float("inf"))
    delta = tl.load(DELTA + bh.to(tl.int64) * SQ + rows, mask=rows < SQ, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = SK
    if CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M + SK - SQ)
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kv_off = cols[:, None].to(tl.int64)
        kvm = (cols[:, None] < SK) & dm
        k = tl.load(K + b * skb + kv_off * sks + hk * skh + dc[None, :], mask=kvm, other=0.0)
        v = tl.load(V + b * svb + kv_off * svs + hk * svh + dc[None, :], mask=kvm, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.where(_visible(rows, cols, b, KPM, skpm, SQ, SK, CAUSAL, HAS_KPM), tl.exp2(s - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    tl.store(DQ + b * sob + r_off * sos + h * soh + dc[None, :], (dq * sm_scale).to(DQ.dtype.element_ty), mask=qm)


def _strides(t):
    return t.stride()[:3]


def _meta(q, causal, kpm):
    d = q.shape[-1]
    return dict(CAUSAL=causal, HAS_KPM=kpm is not None, BLOCK_D=max(16, triton.next_power_of_2(d)),
                PREC="ieee" if q.dtype == torch.float32 else "tf32")


class _FlashAttnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kpm):
        b, sq, h, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        o = empty((b, sq, h, d), q.device, q.dtype)
        lse = empty((b, h, sq), q.device, torch.float32)
        kpm_t = kpm.view(torch.uint8) if kpm is not None else lse
        skpm = kpm.stride(0) if kpm is not None else 0
        bm, bn = FWD_BLOCKS
        meta = _meta(q, causal, kpm)
        warps = 4 if meta["BLOCK_D"] <= 64 or INTERPRET else 8
        _attn_fwd[(triton.cdiv(sq, bm), b * h)](
            q, k, v, o, lse, kpm_t, scale * LOG2E, h, h // hk, sq, sk, d, *_strides(q), *_strides(k),
            *_strides(v), *_strides(o), skpm, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, **meta)
        ctx.save_for_backward(q, k, v, o, lse, kpm)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, kpm = ctx.saved_tensors
        b, sq, h, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        do = do.contiguous()  # same layout as o
        meta = _meta(q, ctx.causal, kpm)
        kpm_t = kpm.view(torch.uint8) if kpm is not None else lse
        skpm = kpm.stride(0) if kpm is not None else 0
        bm, bn = BWD_BLOCKS
        warps = 4 if meta["BLOCK_D"] <= 64 or INTERPRET else 8
        delta = empty((b, h, sq), q.device, torch.float32)
        _attn_bwd_delta[(triton.cdiv(sq, bm), b * h)](o, do, delta, h, sq, d, *_strides(o), BLOCK_M=bm,
                                                      BLOCK_D=meta["BLOCK_D"])
        dq = empty((b, sq, h, d), q.device, q.dtype)
        dk = empty((b, sk, hk, d), k.device, k.dtype)
        dv = empty((b, sk, hk, d), v.device, v.dtype)
        common = (ctx.scale * LOG2E, ctx.scale)
        _attn_bwd_dkdv[(triton.cdiv(sk, bn), b * hk)](
            q, k, v, do, lse, delta, dk, dv, kpm_t, *common, h, hk, h // hk, sq, sk, d, *_strides(q),
            *_strides(k), *_strides(v), *_strides(o), *_strides(dk), skpm, BLOCK_M=bm, BLOCK_N=bn,
            num_warps=warps, **meta)
        _attn_bwd_dq[(triton.cdiv(sq, bm), b * h)](
            q, k, v, do, lse, delta, dq, kpm_t, *common, h, h // hk, sq, sk, d, *_strides(q),
            *_strides(k), *_strides(v), *_strides(o), skpm, BLOCK_M=bm, BLOCK_N=bn,
            num_warps=warps, **meta)
        return dq, dk, dv, None, None, None


def _attention_torch(q, k, v, causal, scale, kpm):
    sq, h, sk, hk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if hk != h:
        kt, vt = kt.repeat_interleave(h // hk, dim=1), vt.repeat_interleave(h // hk, dim=1)
    mask = kpm[:, None, None, :] if kpm is not None else None
    if causal and (sq != sk or mask is not None):  # explicit bottom-right causal mask
        tri = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril_(sk - sq)
        mask = tri if mask is None else mask & tri
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal and mask is None, scale=scale)
    return o.transpose(1, 2)


def flash_attention(q, k, v, causal=True, softmax_scale=None, key_padding_mask=None):
    """Attention over [b, s, heads, d] tensors; see the module docstring."""
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] \
            or q.shape[2] % k.shape[2]:
        raise ValueError(f"kernels.flash_attention: need q [b, sq, h, d], k = v [b, sk, hk, d] with h % hk == 0; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    kpm = key_padding_mask
    if kpm is not None and (kpm.dtype != torch.bool or kpm.shape != (q.shape[0], k.shape[1])):
        raise ValueError(f"kernels.flash_attention: key_padding_mask must be bool [b, sk] (True = keep), "
                         f"got {kpm.dtype} {tuple(kpm.shape)}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if use_triton(q, k, v, kpm):
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        return _FlashAttnFn.apply(q, k, v, bool(causal), float(scale), kpm)
    return _attention_torch(q, k, v, causal, scale, kpm)
