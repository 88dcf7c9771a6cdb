"""Flash attention's backward kernels: dK/dV per key block, dQ per query block (no atomics).

dK/dV: a program holds a key block's K, V and fp32 dK, dV (BLOCK_N = 128 rows on sm_90) and walks the query
blocks of every query head of its GQA group, computing the transposed products S^T = K Q^T and dP^T = V dO^T,
so that all four matmuls have the key block's rows as their M dimension (wgmma takes 64 rows per warpgroup;
a 32-row S = Q K^T would fall back to mma.sync). Rows past the query length weigh zero through their +inf
log-sum-exp, keys past the key length are never stored, and padded keys' rows are zeroed at the store, so only
the query blocks on the causal diagonal (and a ragged query tail, for the pointers' bounds) take the mask.
dQ: a program holds a query block (>= 64 rows per warpgroup, so no warpgroup repeats another's work) and walks
the key blocks as the forward does: wholly visible blocks unmasked, the diagonal, tail or padded ones masked.
"""
import triton
import triton.language as tl

from .flash_attention_fwd import _keep, _key_range, _kpm_ok, _tile


@triton.jit
def _dkdv_loop(dk, dv, k, v, Q, qd, DO, dod, LSE, DELTA, b, hk, n0, n_iter, first, gap_lo, gap_hi, end, H, GROUP,
               SQ, SK, qk_scale, sqb, sqs, sqh, sob, sos, soh, seed, drop_thr, keep_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
               TMA: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """n_iter query blocks: for each head g of the GQA group the blocks first, first + BLOCK_M, ... below end,
    jumping from gap_lo to gap_hi. One flat loop over (head, block) rather than a loop per head: the software
    pipeline runs across heads and no per-head loop state holds registers."""
    offs = tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    start = first
    g = 0
    for _ in tl.range(0, n_iter):
        h = hk * GROUP + g
        bh = b * H + h
        rows = start + offs
        q = _tile(Q + b * sqb + h * sqh, qd, b * SQ + start, start, SQ, h * D, sqs, MASKED, TMA, D, BLOCK_M, BLOCK_D)
        do = _tile(DO + b * sob + h * soh, dod, b * SQ + start, start, SQ, h * D, sos, MASKED, TMA, D, BLOCK_M,
                   BLOCK_D)
        if MASKED:
            lse = tl.load(LSE + bh * SQ + rows, mask=rows < SQ, other=float("inf"))
            delta = tl.load(DELTA + bh * SQ + rows, mask=rows < SQ, other=0.0)
        else:
            lse = tl.load(LSE + bh * SQ + rows)
            delta = tl.load(DELTA + bh * SQ + rows)
        st = tl.dot(k, tl.trans(q), input_precision=PREC)  # [BLOCK_N, BLOCK_M]
        pt = tl.math.exp2(st * qk_scale - lse[None, :])
        if MASKED and CAUSAL:
            pt = tl.where(cols[:, None] <= rows[None, :] + (SK - SQ), pt, 0.0)
        dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
        if DROPOUT:  # O = (P * Z) V: dV = (P * Z)^T dO, dP = (dO V^T) * Z
            z = tl.where(tl.trans(_keep(seed, bh, rows, n0, SK, drop_thr, BLOCK_N)), keep_scale, 0.0)
            dv = tl.dot((pt * z).to(do.dtype), do, dv, input_precision=PREC)
            dpt = dpt * z
        else:
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PREC)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=PREC)
        start += BLOCK_M
        start = tl.where(start == gap_lo, gap_hi, start)
        wrap = start >= end
        start = tl.where(wrap, first, start)
        g += wrap.to(tl.int32)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, qd, K, V, DO, dod, LSE, DELTA, DK, DV, KPM, SEED, qk_scale, sm_scale, drop_thr, keep_scale,
                   H, HK, GROUP, SQ, SK, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, sdb, sds, sdh,
                   skpm, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
                   TMA: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    bhk = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N  # the first key blocks see the most queries: launched first
    b = (bhk // HK).to(tl.int64)
    hk = bhk % HK
    cols = n0 + tl.arange(0, BLOCK_N)
    dc = tl.arange(0, BLOCK_D)
    kvm = (cols[:, None] < SK) & (dc[None, :] < D)
    kv_off = cols[:, None].to(tl.int64)
    k = tl.load(K + b * skb + kv_off * sks + hk * skh + dc[None, :], mask=kvm, other=0.0)
    v = tl.load(V + b * svb + kv_off * svs + hk * svh + dc[None, :], mask=kvm, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    # query blocks [lo, full) cross the diagonal and [tail, SQ) is the ragged end (masked: the pointers' bounds);
    # [full, tail) see the whole key block, unmasked
    tail = SQ // BLOCK_M * BLOCK_M
    lo = 0
    full = 0
    if CAUSAL:
        lo = tl.maximum(0, n0 - (SK - SQ)) // BLOCK_M * BLOCK_M
        full = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - (SK - SQ), 0), BLOCK_M) * BLOCK_M
        full = tl.maximum(tl.minimum(full, tl.cdiv(SQ, BLOCK_M) * BLOCK_M), lo)
    tail2 = tl.maximum(tail, full)
    n_masked = (full - lo) // BLOCK_M + (tail2 < SQ).to(tl.int32)
    first = tl.where(lo < full, lo, tail2)
    n_full = tl.maximum(tail - full, 0) // BLOCK_M
    dk, dv = _dkdv_loop(dk, dv, k, v, Q, qd, DO, dod, LSE, DELTA, b, hk, n0, GROUP * n_masked, first, full, tail2,
                        SQ, H, GROUP, SQ, SK, qk_scale, sqb, sqs, sqh, sob, sos, soh, seed, drop_thr, keep_scale,
                        True, CAUSAL, DROPOUT, PREC, TMA, D, BLOCK_M, BLOCK_N, BLOCK_D)
    dk, dv = _dkdv_loop(dk, dv, k, v, Q, qd, DO, dod, LSE, DELTA, b, hk, n0, GROUP * n_full, full, -1, -1, tail,
                        H, GROUP, SQ, SK, qk_scale, sqb, sqs, sqh, sob, sos, soh, seed, drop_thr, keep_scale,
                        False, CAUSAL, DROPOUT, PREC, TMA, D, BLOCK_M, BLOCK_N, BLOCK_D)
    if HAS_KPM:  # a padded key has probability 0 for every query: its gradients are 0
        keep = _kpm_ok(KPM, b, skpm, cols, SK)[:, None]
        dk = tl.where(keep, dk, 0.0)
        dv = tl.where(keep, dv, 0.0)
    out = b * sdb + kv_off * sds + hk * sdh + dc[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=kvm)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kvm)


@triton.jit
def _dq_loop(dq, q, do, lse, delta, K, kd, V, vd, KPM, b, hk, bh, rows, lo, hi, SQ, SK, qk_scale, sks, svs, skpm,
             seed, drop_thr, keep_scale,
             MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr,
             PREC: tl.constexpr, TMA: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    offs = tl.arange(0, BLOCK_N)
    for start in tl.range(lo, hi, BLOCK_N):
        cols = start + offs
        k = _tile(K, kd, b * SK + start, start, SK, hk * D, sks, MASKED, TMA, D, BLOCK_N, BLOCK_D)
        v = _tile(V, vd, b * SK + start, start, SK, hk * D, svs, MASKED, TMA, D, BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        p = tl.math.exp2(s * qk_scale - lse[:, None])
        if MASKED:
            ok = cols[None, :] < SK
            if CAUSAL:
                ok &= cols[None, :] <= rows[:, None] + (SK - SQ)
            if HAS_KPM:
                ok &= _kpm_ok(KPM, b, skpm, cols, SK)[None, :]
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        if DROPOUT:
            dp = tl.where(_keep(seed, bh, rows, start, SK, drop_thr, BLOCK_N), dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, kd, V, vd, DO, LSE, DELTA, DQ, KPM, SEED, qk_scale, sm_scale, drop_thr, keep_scale, H, GROUP,
                 SQ, SK, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, skpm,
                 CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
                 TMA: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    if CAUSAL:
        pid_m = tl.num_programs(1) - 1 - pid_m
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    dc = tl.arange(0, BLOCK_D)
    qm = (rows[:, None] < SQ) & (dc[None, :] < D)
    r_off = rows[:, None].to(tl.int64)
    q = tl.load(Q + b * sqb + r_off * sqs + h * sqh + dc[None, :], mask=qm, other=0.0)
    do = tl.load(DO + b * sob + r_off * sos + h * soh + dc[None, :], mask=qm, other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * SQ + rows, mask=rows < SQ, other=float("inf"))
    delta = tl.load(DELTA + bh.to(tl.int64) * SQ + rows, mask=rows < SQ, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    full, hi = _key_range(m0, SQ, SK, CAUSAL, HAS_KPM, BLOCK_M, BLOCK_N)
    Kb = K + b * skb + hk * skh
    Vb = V + b * svb + hk * svh
    dq = _dq_loop(dq, q, do, lse, delta, Kb, kd, Vb, vd, KPM, b, hk, bh, rows, 0, full, SQ, SK, qk_scale, sks, svs,
                  skpm, seed, drop_thr, keep_scale, False, CAUSAL, HAS_KPM, DROPOUT, PREC, TMA, D, BLOCK_N, BLOCK_D)
    dq = _dq_loop(dq, q, do, lse, delta, Kb, kd, Vb, vd, KPM, b, hk, bh, rows, full, hi, SQ, SK, qk_scale, sks, svs,
                  skpm, seed, drop_thr, keep_scale, True, CAUSAL, HAS_KPM, DROPOUT, PREC, TMA, D, BLOCK_N, BLOCK_D)
    tl.store(DQ + b * sob + r_off * sos + h * soh + dc[None, :], (dq * sm_scale).to(DQ.dtype.element_ty), mask=qm)
