"""FlashAttention-2 in Triton: online-softmax forward saving logsumexp, recomputing backward.

flash_attention(q, k, v, causal=True, softmax_scale=None, dropout_p=0.0, key_padding_mask=None)
  q [b, sq, h, d]; k, v [b, sk, hk, d] with h % hk == 0 (GQA/MQA); any seq lengths, head dim
  d <= 256 on the Triton path (block sizes are chosen per head dim and dtype so every build
  fits an A100's and an H100's shared memory; tests/kernels/gpu_compile.py checks this);
  returns [b, sq, h, d] in q's dtype.
  causal: query i sees key j iff j <= i + sk - sq (bottom-right aligned, as flash-attn >= 2.1;
  the usual upper-triangular mask when sq == sk).
  key_padding_mask: bool [b, sk], True = real token (kept), False = padding (as Hugging Face's
  attention_mask and SDPA's boolean attn_mask; note kernels.softmax's mask is the opposite).
  A query that sees no key gets a zero output and zero gradients (as SDPA).
  dropout_p: dropout on the attention probabilities (kept ones scaled by 1/(1-p)), as
  F.scaled_dot_product_attention(dropout_p=p). The Triton path draws one 62-bit seed from the
  current torch generator of q's device (torch.randint on the device: no host sync; inside
  megalite's `get_rng_tracker().fork()` that is the TP-rank stream, and activation
  recomputation replays it), and the kernels regenerate the mask from it: element (b, h, i, j)
  is kept iff (Philox4x32-10(key=seed, counter=(i*sk + j, b*h_total + h, 0, 0))[0] >> 1) >=
  round(p * 2**31), the same numbers in the forward and in both backward kernels.
fp32 inputs: the two matmuls of the Triton path run on TF32 tensor cores (inputs rounded to
  10-bit mantissas, fp32 accumulation, as torch's matmuls with allow_tf32); softmax, running
  max/sum and accumulators stay fp32. For full-fp32 products use kernels.use_backend("torch")
  (SDPA). bf16/fp16 inputs use bf16/fp16 tensor cores with fp32 accumulation.
Backward: delta = rowsum(dO * O) first; then one kernel per K/V block (looping over the q
heads of its GQA group, so dK/dV need no atomics) and one per Q block for dQ.
CPU tensors take SDPA (GQA through enable_gqa, no repeated K/V copies).
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._dispatch import INTERPRET, empty, use_triton

LOG2E = 1.4426950408889634
FWD_BLOCKS = None  # (BLOCK_M, BLOCK_N) override of the per-head-dim table; tests shrink them
BWD_BLOCKS = None

# (BLOCK_D, bytes per q/k/v element) -> (BLOCK_M, BLOCK_N, warps, stages) of the forward, the
# dK/dV and the dQ kernel. Chosen by compiling for sm_80 and sm_90 (tests/kernels/gpu_compile.py):
# no spills at d <= 128 with and without dropout (triton 3.6 and 3.9), shared memory under the A100's 166912 B per
# block (so also under the H100's 232448 B). dK/dV keeps its [BLOCK_N, d] accumulators resident
# and walks the queries in short BLOCK_M steps, which keeps the score tiles small.
_CONFIGS = {
    (64, 2): ((128, 64, 8, 3), (16, 32, 4, 3), (64, 64, 4, 3)),
    (128, 2): ((128, 64, 8, 3), (32, 64, 8, 3), (64, 64, 8, 3)),
    (256, 2): ((64, 32, 8, 2), (32, 32, 8, 2), (32, 32, 8, 2)),
    (64, 4): ((64, 64, 4, 2), (16, 32, 4, 2), (32, 64, 4, 2)),
    (128, 4): ((64, 32, 4, 2), (32, 32, 4, 2), (32, 32, 4, 2)),
    (256, 4): ((32, 32, 4, 2), (16, 32, 4, 2), (16, 32, 4, 2)),
}
MAX_HEAD_DIM = 256


def _config(d, dtype, kernel):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) of kernel 0 (fwd), 1 (dK/dV), 2 (dQ)."""
    bd = max(16, triton.next_power_of_2(d))
    bm, bn, warps, stages = _CONFIGS[(max(64, bd), 4 if dtype == torch.float32 else 2)][kernel]
    override = BWD_BLOCKS if kernel else FWD_BLOCKS
    if override is not None:
        bm, bn = override
    return bm, bn, bd, (1 if INTERPRET else warps), stages


@triton.jit
def _visible(rows, cols, b, KPM, skpm, SQ, SK, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr):
    ok = (rows[:, None] < SQ) & (cols[None, :] < SK)
    if CAUSAL:
        ok &= cols[None, :] <= rows[:, None] + (SK - SQ)
    if HAS_KPM:
        ok &= (tl.load(KPM + b * skpm + cols, mask=cols < SK, other=0) != 0)[None, :]
    return ok


@triton.jit
def _keep(seed, bh, rows, cols, SK, drop_thr):
    """Dropout keep-mask of a [BLOCK_M, BLOCK_N] score block: Philox on (i*sk + j, b*h + h)."""
    c0 = rows[:, None] * SK + cols[None, :]
    zero = c0 * 0
    r0, _, _, _ = tl.philox(seed, c0, zero + bh.to(tl.int32), zero, zero)
    return (r0 >> 1).to(tl.int32) >= drop_thr


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, KPM, SEED, qk_scale, drop_thr, keep_scale, H, GROUP, SQ, SK, D,
              sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, skpm,
              CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
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
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
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
        if DROPOUT:  # the normaliser l_i sums the probabilities before dropout
            p = tl.where(_keep(seed, bh, rows, cols, SK, drop_thr), p * keep_scale, 0.0)
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
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, KPM, SEED, qk_scale, sm_scale, drop_thr, keep_scale,
                   H, HK, GROUP, SQ, SK, D,
                   sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, sdb, sds, sdh, skpm,
                   CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
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
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
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
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            if DROPOUT:  # O = (P * Z) V: dV = (P * Z)^T dO, dP = (dO V^T) * Z
                z = tl.where(_keep(seed, bh, rows, cols, SK, drop_thr), keep_scale, 0.0)
                dv += tl.dot(tl.trans((p * z).to(do.dtype)), do, input_precision=PREC)
                dp = dp * z
            else:
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
    out = b * sdb + kv_off * sds + hk * sdh + dc[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=kvm)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kvm)


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, KPM, SEED, qk_scale, sm_scale, drop_thr, keep_scale, H, GROUP,
                 SQ, SK, D, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, skpm,
                 CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
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
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
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
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        if DROPOUT:
            dp = tl.where(_keep(seed, bh, rows, cols, SK, drop_thr), dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    tl.store(DQ + b * sob + r_off * sos + h * soh + dc[None, :], (dq * sm_scale).to(DQ.dtype.element_ty), mask=qm)


def _strides(t):
    return t.stride()[:3]


def _dropout_args(p):
    """(threshold on 31 random bits, 1/(1-p)) for keep iff bits >= threshold."""
    return int(round(p * 2 ** 31)), (1.0 / (1.0 - p) if p > 0 else 1.0)


def _forward(q, k, v, causal, scale, kpm, dropout_p):
    """The forward kernel: (o [b, sq, h, d], base-2 lse [b, h, sq] (+inf: a query sees no key), seed)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    o = empty((b, sq, h, d), q.device, q.dtype)
    lse = empty((b, h, sq), q.device, torch.float32)
    kpm_t = kpm.view(torch.uint8) if kpm is not None else lse
    skpm = kpm.stride(0) if kpm is not None else 0
    # the seed stays on the device: drawn from the current generator, read by the kernels
    seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=q.device) if dropout_p > 0 else None
    thr, keep_scale = _dropout_args(dropout_p)
    bm, bn, bd, warps, stages = _config(d, q.dtype, 0)
    _attn_fwd[(triton.cdiv(sq, bm), b * h)](
        q, k, v, o, lse, kpm_t, seed if seed is not None else lse, scale * LOG2E, thr, keep_scale,
        h, h // hk, sq, sk, d, *_strides(q), *_strides(k), *_strides(v), *_strides(o), skpm,
        CAUSAL=causal, HAS_KPM=kpm is not None, DROPOUT=seed is not None, PREC="tf32",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, num_warps=warps, num_stages=stages)
    return o, lse, seed


def _backward(do, q, k, v, o, lse, kpm, seed, causal, scale, dropout_p):
    """The backward kernels for output o and base-2 lse (any o/lse: e.g. merged over ring blocks)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kpm_t = kpm.view(torch.uint8) if kpm is not None else lse
    skpm = kpm.stride(0) if kpm is not None else 0
    bd = _config(d, q.dtype, 1)[2]
    meta = dict(CAUSAL=causal, HAS_KPM=kpm is not None, DROPOUT=seed is not None, PREC="tf32", BLOCK_D=bd)
    delta = empty((b, h, sq), q.device, torch.float32)
    _attn_bwd_delta[(triton.cdiv(sq, 64), b * h)](o, do, delta, h, sq, d, *_strides(o), BLOCK_M=64, BLOCK_D=bd)
    dq = empty((b, sq, h, d), q.device, q.dtype)
    dk = empty((b, sk, hk, d), k.device, k.dtype)
    dv = empty((b, sk, hk, d), v.device, v.dtype)
    common = (seed if seed is not None else lse, scale * LOG2E, scale, *_dropout_args(dropout_p))
    bm, bn, _, warps, stages = _config(d, q.dtype, 1)
    _attn_bwd_dkdv[(triton.cdiv(sk, bn), b * hk)](
        q, k, v, do, lse, delta, dk, dv, kpm_t, *common, h, hk, h // hk, sq, sk, d, *_strides(q),
        *_strides(k), *_strides(v), *_strides(o), *_strides(dk), skpm, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=warps, num_stages=stages, **meta)
    bm, bn, _, warps, stages = _config(d, q.dtype, 2)
    _attn_bwd_dq[(triton.cdiv(sq, bm), b * h)](
        q, k, v, do, lse, delta, dq, kpm_t, *common, h, h // hk, sq, sk, d, *_strides(q),
        *_strides(k), *_strides(v), *_strides(o), skpm, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=warps, num_stages=stages, **meta)
    return dq, dk, dv


class _FlashAttnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kpm, dropout_p):
        o, lse, seed = _forward(q, k, v, causal, scale, kpm, dropout_p)
        ctx.save_for_backward(q, k, v, o, lse, kpm, seed)
        ctx.causal, ctx.scale, ctx.dropout_p = causal, scale, dropout_p
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, kpm, seed = ctx.saved_tensors
        dq, dk, dv = _backward(do.contiguous(), q, k, v, o, lse, kpm, seed, ctx.causal, ctx.scale, ctx.dropout_p)
        return dq, dk, dv, None, None, None, None


def _block_probs(q, k, causal, scale, lse=None):
    """torch path: fp32 scores [b, h, sq, sk] (bottom-right causal), their lse, probabilities."""
    rep = q.shape[2] // k.shape[2]
    s = q.float().transpose(1, 2) @ k.float().repeat_interleave(rep, 2).permute(0, 2, 3, 1) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril_(sk - sq), float("-inf"))
    lse = torch.logsumexp(s, -1) if lse is None else lse.float()
    return lse, torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])


def flash_attention_block(q, k, v, causal=True, softmax_scale=None):
    """One block of ring attention, no autograd: (out [b, sq, h, d] in q's dtype, lse [b, h, sq]
    fp32, natural log, -inf where a query sees no key). Inputs as flash_attention's (strided
    views allowed; the last dim contiguous). Triton on CUDA (d <= 256), else torch in fp32."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if q.shape[-1] <= MAX_HEAD_DIM and use_triton(q, k, v, kernel="flash_attention"):
        o, lse, _ = _forward(q, k, v, bool(causal), float(scale), None, 0.0)
        return o, torch.where(torch.isinf(lse), torch.full_like(lse, float("-inf")), lse / LOG2E)
    lse, p = _block_probs(q, k, causal, scale)
    o = p @ v.float().repeat_interleave(q.shape[2] // k.shape[2], 2).transpose(1, 2)
    return o.transpose(1, 2).to(q.dtype), lse


def flash_attention_block_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=None):
    """(dq, dk, dv) of one block given the output and natural-log lse of the whole attention
    the block is part of (ring attention merges them over blocks): the recomputed
    probabilities exp(s - lse) are the block's share; dk, dv summed over each KV head's queries."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if q.shape[-1] <= MAX_HEAD_DIM and use_triton(q, k, v, kernel="flash_attention"):
        lse2 = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse * LOG2E).contiguous()
        return _backward(dout.contiguous(), q, k, v, out.contiguous(), lse2, None, None, bool(causal), float(scale),
                         0.0)
    b, sk, hk, d = k.shape
    rep = q.shape[2] // hk
    _, p = _block_probs(q, k, causal, scale, lse)
    do = dout.float().transpose(1, 2)  # [b, h, sq, d]
    vr = v.float().repeat_interleave(rep, 2).transpose(1, 2)
    ds = p * (do @ vr.transpose(-1, -2) - (do * out.float().transpose(1, 2)).sum(-1, keepdim=True))
    dq = (ds @ k.float().repeat_interleave(rep, 2).transpose(1, 2)) * scale
    dk = (ds.transpose(-1, -2) @ q.float().transpose(1, 2)) * scale
    dv = p.transpose(-1, -2) @ do
    group = (lambda t: t.view(b, hk, rep, sk, d).sum(2).transpose(1, 2).to(k.dtype))  # [b, sk, hk, d]
    return dq.transpose(1, 2).to(q.dtype), group(dk), group(dv)


def _attention_torch(q, k, v, causal, scale, kpm, dropout_p):
    sq, h, sk, hk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    mask = kpm[:, None, None, :] if kpm is not None else None
    if causal and (sq != sk or mask is not None):  # explicit bottom-right causal mask
        tri = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril_(sk - sq)
        mask = tri if mask is None else mask & tri
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       dropout_p=dropout_p, is_causal=causal and mask is None, scale=scale,
                                       enable_gqa=hk != h)
    return o.transpose(1, 2)


def flash_attention(q, k, v, causal=True, softmax_scale=None, dropout_p=0.0, key_padding_mask=None):
    """Attention over [b, s, heads, d] tensors; see the module docstring."""
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] \
            or q.shape[2] % k.shape[2]:
        raise ValueError(f"kernels.flash_attention: need q [b, sq, h, d], k = v [b, sk, hk, d] with h % hk == 0; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    kpm = key_padding_mask
    if kpm is not None and (kpm.dtype != torch.bool or kpm.shape != (q.shape[0], k.shape[1])):
        raise ValueError(f"kernels.flash_attention: key_padding_mask must be bool [b, sk] (True = keep), "
                         f"got {kpm.dtype} {tuple(kpm.shape)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"kernels.flash_attention: dropout_p must be in [0, 1), got {dropout_p}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if q.shape[-1] <= MAX_HEAD_DIM and use_triton(q, k, v, kpm, kernel="flash_attention"):
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        return _FlashAttnFn.apply(q, k, v, bool(causal), float(scale), kpm, float(dropout_p))
    return _attention_torch(q, k, v, causal, scale, kpm, float(dropout_p))
