"""The Triton kernels behind layer_norm / rms_norm (host code, tuning space: layer_norm.py).

Every kernel is persistent: a grid of a few programs per SM, each walking tiles pid, pid + G, ...
with `tl.range(..., num_stages=STAGES)`, which Triton software-pipelines: the next tiles' loads are
issued as cp.async (LDGSTS on sm_80/sm_90) into shared memory while this tile is reduced and stored,
so an SM keeps STAGES - 1 tiles of loads in flight instead of one row (the old backward's limit,
latency-bound at 11-12% of copy bandwidth on an H200). A tile is [ROWS, BLOCK]: several rows per
program step when the hidden size is small, so a 768-wide row does not leave most lanes idle.
Rows wider than the fused block (ONE_PASS false) are walked in BLOCK-wide chunks, re-reading the
row (which mostly hits L2); the chunk loops are pipelined the same way.
"""
import triton
import triton.language as tl


@triton.jit
def _norm_fwd(X, W, B, Y, MEAN, RSTD, M, N, eps,
              IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
              ONE_PASS: tl.constexpr, STAGES: tl.constexpr, HOIST: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        cm = cols < N
        # weights once per program, every tile reusing them (HOIST), unless the registers they take would
        # spill (wide rows: then each tile reloads them from L1/L2)
        if HOIST:
            w = tl.load(W + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
            if HAS_BIAS:
                b = tl.load(B + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        for t in tl.range(pid, tl.cdiv(M, ROWS), step, num_stages=STAGES):
            rows = t * ROWS + tl.arange(0, ROWS)
            rm = rows < M
            offs = rows[:, None].to(tl.int64) * N + cols[None, :]
            msk = rm[:, None] & cm[None, :]
            x = tl.load(X + offs, mask=msk, other=0.0).to(tl.float32)
            mean = tl.zeros([ROWS], dtype=tl.float32)
            if not IS_RMS:
                mean = tl.sum(x, axis=1) / N
            xc = tl.where(msk, x - mean[:, None], 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
            if not HOIST:
                w = tl.load(W + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
                if HAS_BIAS:
                    b = tl.load(B + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
            y = xc * rstd[:, None] * w
            if HAS_BIAS:
                y += b
            tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=msk)
            if not IS_RMS:
                tl.store(MEAN + rows, mean, mask=rm)
            tl.store(RSTD + rows, rstd, mask=rm)
    else:  # one row per step, in chunks (ROWS is 1)
        for row in range(pid, M, step):
            base = tl.cast(row, tl.int64) * N
            mean = 0.0
            if not IS_RMS:
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for off in tl.range(0, N, BLOCK, num_stages=STAGES):
                    acc += tl.load(X + base + off + cols, mask=off + cols < N, other=0.0).to(tl.float32)
                mean = tl.sum(acc, axis=0) / N
            acc2 = tl.zeros([BLOCK], dtype=tl.float32)
            for off in tl.range(0, N, BLOCK, num_stages=STAGES):
                msk = off + cols < N
                x = tl.load(X + base + off + cols, mask=msk, other=0.0).to(tl.float32)
                xc = tl.where(msk, x - mean, 0.0)
                acc2 += xc * xc
            rstd = 1.0 / tl.sqrt(tl.sum(acc2, axis=0) / N + eps)
            for off in tl.range(0, N, BLOCK, num_stages=STAGES):
                msk = off + cols < N
                x = tl.load(X + base + off + cols, mask=msk, other=0.0).to(tl.float32)
                y = (x - mean) * rstd * tl.load(W + off + cols, mask=msk, other=0.0).to(tl.float32)
                if HAS_BIAS:
                    y += tl.load(B + off + cols, mask=msk, other=0.0).to(tl.float32)
                tl.store(Y + base + off + cols, y.to(Y.dtype.element_ty), mask=msk)
            if not IS_RMS:
                tl.store(MEAN + row, mean)
            tl.store(RSTD + row, rstd)


@triton.jit
def _norm_bwd(X, W, DY, DX, MEAN, RSTD, DW, DB, M, N,
              IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
              STAGES: tl.constexpr):
    """Whole rows in registers. dW/dB accumulate over this program's tiles in [ROWS, BLOCK] registers and
    are written once, at the end, to this program's row of the partial buffers (torch.empty: every
    program writes its whole row, so nothing is zeroed or read back)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    cm = cols < N
    w = tl.load(W + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    db = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for t in tl.range(pid, tl.cdiv(M, ROWS), step, num_stages=STAGES):
        rows = t * ROWS + tl.arange(0, ROWS)
        rm = rows < M
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        msk = rm[:, None] & cm[None, :]
        x = tl.load(X + offs, mask=msk, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=msk, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rm, other=0.0)[:, None]
        mean = tl.zeros([ROWS, 1], dtype=tl.float32)
        if not IS_RMS:
            mean = tl.load(MEAN + rows, mask=rm, other=0.0)[:, None]
        xhat = tl.where(msk, (x - mean) * rstd, 0.0)
        wdy = w * dy
        c1 = (tl.sum(xhat * wdy, axis=1) / N)[:, None]
        if IS_RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            dx = (wdy - (xhat * c1 + (tl.sum(wdy, axis=1) / N)[:, None])) * rstd
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=msk)
        dw += dy * xhat  # masked rows and columns hold dy = 0: they add nothing
        db += dy
    DW += pid.to(tl.int64) * N
    tl.store(DW + cols, tl.sum(dw, axis=0), mask=cm)
    if HAS_BIAS:
        DB += pid.to(tl.int64) * N
        tl.store(DB + cols, tl.sum(db, axis=0), mask=cm)


@triton.jit
def _norm_bwd_chunked(X, W, DY, DX, MEAN, RSTD, DW, DB, M, N,
                      IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Rows wider than the registers hold: two pipelined passes over each row's chunks (sums, then dx).
    A whole dW row cannot stay in registers here, so this program's partial row (N fp32, L2-resident)
    is stored by its first row and accumulated by the rest; the host gives every program a row."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    DW += pid.to(tl.int64) * N
    DB += pid.to(tl.int64) * N
    for row in range(pid, M, step):
        base = tl.cast(row, tl.int64) * N
        rstd = tl.load(RSTD + row)
        mean = 0.0
        if not IS_RMS:
            mean = tl.load(MEAN + row)
        a1 = tl.zeros([BLOCK], dtype=tl.float32)
        a2 = tl.zeros([BLOCK], dtype=tl.float32)
        for c in tl.range(0, N, BLOCK, num_stages=STAGES):
            msk = c + cols < N
            x = tl.load(X + base + c + cols, mask=msk, other=0.0).to(tl.float32)
            dy = tl.load(DY + base + c + cols, mask=msk, other=0.0).to(tl.float32)
            wdy = tl.load(W + c + cols, mask=msk, other=0.0).to(tl.float32) * dy
            a1 += tl.where(msk, (x - mean) * rstd, 0.0) * wdy
            a2 += wdy
        c1 = tl.sum(a1, axis=0) / N
        c2 = tl.sum(a2, axis=0) / N
        later = cols * 0 + row != pid  # the first row stores the partial, later rows add to it (a tensor:
        # the interpreter's masks must be). The pipeliner turns the partial's loads into cp.async, issued by
        # other threads than the previous row's stores: a CTA barrier orders them after those stores.
        tl.debug_barrier()
        for c in tl.range(0, N, BLOCK, num_stages=STAGES):
            msk = c + cols < N
            x = tl.load(X + base + c + cols, mask=msk, other=0.0).to(tl.float32)
            dy = tl.load(DY + base + c + cols, mask=msk, other=0.0).to(tl.float32)
            xhat = tl.where(msk, (x - mean) * rstd, 0.0)
            wdy = tl.load(W + c + cols, mask=msk, other=0.0).to(tl.float32) * dy
            if IS_RMS:
                dx = (wdy - xhat * c1) * rstd
            else:
                dx = (wdy - (xhat * c1 + c2)) * rstd
            tl.store(DX + base + c + cols, dx.to(DX.dtype.element_ty), mask=msk)
            tl.store(DW + c + cols, tl.load(DW + c + cols, mask=msk & later, other=0.0) + dy * xhat, mask=msk)
            if HAS_BIAS:
                tl.store(DB + c + cols, tl.load(DB + c + cols, mask=msk & later, other=0.0) + dy, mask=msk)
