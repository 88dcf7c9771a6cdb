"""Flash attention's forward kernel and the device helpers its backward kernels share.

Structure (FlashAttention-2/3, Triton's tutorial 06): a query block first walks the key blocks every one of its
rows sees whole, with no mask at all (the steady state: scores, online softmax, P.V and nothing else), then the
few blocks on the causal diagonal, past the ragged key tail or under a key-padding mask, masked. K and V tiles
come through tensor descriptors (TMA on sm_90) when the host made them, else through pointers whose offsets are
loop-invariant. The grid is (batch x heads, query blocks) with the longest causal query blocks launched first.
"""
import triton
import triton.language as tl


@triton.jit
def _tile(T, desc, row0, start, limit, col, stride, MASK_ROWS: tl.constexpr, TMA: tl.constexpr,
          D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [start, start + ROWS) x [0, D) of one head of a [b, s, h, d] tensor. TMA: `desc` over its
    [b * s, h * d] view (row0 = b * s + start, col = head * d; rows past the tensor read as zeros, rows past
    this batch read the next batch's, which every caller masks or weighs by zero). Pointers: T at (b, 0, head, 0)."""
    if TMA:
        return desc.load([row0.to(tl.int32), col])
    offs = tl.arange(0, ROWS)
    dc = tl.arange(0, BLOCK_D)
    ptrs = T + tl.cast(start, tl.int64) * stride + (offs[:, None] * stride + dc[None, :])
    if MASK_ROWS:
        return tl.load(ptrs, mask=(start + offs[:, None] < limit) & (dc[None, :] < D), other=0.0)
    if D != BLOCK_D:
        return tl.load(ptrs, mask=dc[None, :] < D, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _keep(seed, bh, rows, start, SK, drop_thr, BLOCK_N: tl.constexpr):
    """Dropout keep-mask [rows, BLOCK_N] of keys start + [0, BLOCK_N) (start a multiple of 4): one Philox4x32-10
    call per 4 keys, each key taking one of its 32-bit words, the same bits in all three kernels: element
    (i, j) is kept iff (Philox(seed, (i * ceil(sk / 4) + j // 4, b * h + h, 0, 0))[j % 4] >> 1) >= drop_thr."""
    groups = start // 4 + tl.arange(0, BLOCK_N // 4)
    c0 = rows[:, None] * tl.cdiv(SK, 4) + groups[None, :]
    zero = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed, c0, zero + bh.to(tl.int32), zero, zero)
    # [.., g, a, b] = r_(2a + b): row-major flattening puts word j % 4 at key 4 g + j % 4
    bits = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [rows.shape[0], BLOCK_N])
    return (bits >> 1).to(tl.int32) >= drop_thr


@triton.jit
def _kpm_ok(KPM, b, skpm, cols, SK):
    return tl.load(KPM + b * skpm + cols, mask=cols < SK, other=0) != 0


@triton.jit
def _key_range(m0, SQ, SK, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """(full, hi) for the query block at row m0: keys [0, full) are visible to every row of the block and inside
    the sequence (the unmasked loop); [full, hi) need the mask (the forward's and dQ's key loops)."""
    hi = SK
    full = SK // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(SK, m0 + BLOCK_M + SK - SQ)
        full = tl.minimum(full, tl.maximum(m0 + 1 + SK - SQ, 0) // BLOCK_N * BLOCK_N)
    if HAS_KPM:
        full = 0
    return full, hi


@triton.jit
def _fwd_loop(acc, l_i, m_i, q, K, kd, V, vd, b, hk, bh, rows, lo, hi, SQ, SK, qk_scale, sks, svs,
              KPM, skpm, seed, drop_thr, keep_scale,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr,
              PREC: tl.constexpr, TMA: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr):
    offs = tl.arange(0, BLOCK_N)
    for start in tl.range(lo, hi, BLOCK_N):
        cols = start + offs
        k = _tile(K, kd, b * SK + start, start, SK, hk * D, sks, MASKED, TMA, D, BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        if MASKED:
            ok = cols[None, :] < SK
            if CAUSAL:
                ok &= cols[None, :] <= rows[:, None] + (SK - SQ)
            if HAS_KPM:
                ok &= _kpm_ok(KPM, b, skpm, cols, SK)[None, :]
            s = tl.where(ok, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = tl.math.exp2(s - m_use[:, None])
        else:  # every score finite: the scale folds into the exponent's FMA (qk_scale > 0)
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        v = _tile(V, vd, b * SK + start, start, SK, hk * D, svs, MASKED, TMA, D, BLOCK_N, BLOCK_D)
        if DROPOUT:  # the normaliser l_i sums the probabilities before dropout
            p = tl.where(_keep(seed, bh, rows, start, SK, drop_thr, BLOCK_N), p * keep_scale, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, kd, V, vd, O, LSE, KPM, SEED, qk_scale, drop_thr, keep_scale, H, GROUP, SQ, SK,
              sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, skpm,
              CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
              TMA: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    if CAUSAL:  # the blocks with the most keys first, so the last wave is short
        pid_m = tl.num_programs(1) - 1 - pid_m
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    dc = tl.arange(0, BLOCK_D)
    qmask = (rows[:, None] < SQ) & (dc[None, :] < D)
    q = tl.load(Q + b * sqb + rows[:, None].to(tl.int64) * sqs + h * sqh + dc[None, :], mask=qmask, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    full, hi = _key_range(m0, SQ, SK, CAUSAL, HAS_KPM, BLOCK_M, BLOCK_N)
    Kb = K + b * skb + hk * skh
    Vb = V + b * svb + hk * svh
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, Kb, kd, Vb, vd, b, hk, bh, rows, 0, full, SQ, SK, qk_scale, sks,
                              svs, KPM, skpm, seed, drop_thr, keep_scale, False, CAUSAL, HAS_KPM, DROPOUT, PREC,
                              TMA, D, BLOCK_N, BLOCK_D)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, Kb, kd, Vb, vd, b, hk, bh, rows, full, hi, SQ, SK, qk_scale, sks,
                              svs, KPM, skpm, seed, drop_thr, keep_scale, True, CAUSAL, HAS_KPM, DROPOUT, PREC,
                              TMA, D, BLOCK_N, BLOCK_D)
    empty_row = l_i == 0.0
    o = acc / tl.where(empty_row, 1.0, l_i)[:, None]
    tl.store(O + b * sob + rows[:, None].to(tl.int64) * sos + h * soh + dc[None, :], o.to(O.dtype.element_ty),
             mask=qmask)
    # base-2 logsumexp; +inf for empty rows makes every recomputed probability 0
    lse = tl.where(empty_row, float("inf"), m_i + tl.log2(tl.where(empty_row, 1.0, l_i)))
    tl.store(LSE + bh.to(tl.int64) * SQ + rows, lse, mask=rows < SQ)


@triton.jit
def _attn_bwd_delta(O, DO, DELTA, H, SQ, D, sob, sos, soh, sdob, sdos, sdoh,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta = rowsum(dO * O) in fp32, the backward's per-row constant."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dc = tl.arange(0, BLOCK_D)
    msk = (rows[:, None] < SQ) & (dc[None, :] < D)
    r = rows[:, None].to(tl.int64)
    o = tl.load(O + b * sob + r * sos + (bh % H) * soh + dc[None, :], mask=msk, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdob + r * sdos + (bh % H) * sdoh + dc[None, :], mask=msk, other=0.0).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * SQ + rows, tl.sum(o * do, axis=1), mask=rows < SQ)
