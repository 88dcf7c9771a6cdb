"""Grouped GEMM for Mixture-of-Experts experts: every expert's rows times its own weight, one launch.

grouped_gemm(x, w, counts)
  x [N, K], rows sorted by expert: counts[e] rows for expert e (a list of E ints summing to N;
  zeros allowed); w [E, M, K], or a list of E [M, K] tensors (the experts' separate parameters:
  stacked for the kernel, and again in the backward, so no stacked copy is held between forward
  and backward); returns y [N, M] in x's dtype, y rows of expert e = x_e @ w[e].T.
  Differentiable in x and w: dx_e = dy_e @ w[e], dw[e] = dy_e^T x_e (zero for an expert with no rows).
Triton path: one kernel (`_gg_rows`) over the tiles of all experts at once, for y and for dx: the
  host cuts each expert's rows into BLOCK_M blocks (the last one of an expert partial) and passes
  (expert, first row, end row) per block in a small int32 table; program p takes row block x column
  block of a flattened, GROUP_M-swizzled tile index (neighbouring programs share weight columns in
  L2). dw: a second kernel (`_gg_dw`), one program per (expert, [M, K] tile) reducing over that
  expert's rows (an expert with no rows stores zeros). fp32 accumulation; bf16/fp16/fp32 inputs.
  fp32 inputs use TF32 tensor cores when torch.backends.cuda.matmul.allow_tf32 is set (as torch's
  own matmuls), full fp32 otherwise.
CPU tensors (or backend "torch") take the per-expert loop of torch.matmul.
"""
import torch
import triton
import triton.language as tl

from ._dispatch import INTERPRET, empty, use_triton

GROUP_M = 8  # row blocks per swizzle group
BLOCKS = None  # (BLOCK_M, BLOCK_N, BLOCK_K) override of _config's table; tests shrink them


def _config(dtype):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for the input dtype: 2-byte inputs take
    a 128x128 tile with 64-deep k steps in 3 stages (96 KiB of shared memory, under the A100's
    163 KiB); fp32 a 64x64 tile with 32-deep steps in 2 stages at 4 warps (full-fp32 dots with 32-deep
    steps came within a few registers of 255 on sm_80 and spilled at 8 warps; with triton 3.6, 16-deep
    steps in 3 stages spilled 16 B/thread on sm_80, 2 stages 8 B, this none: measured on the GPU machine,
    2026-11-28). Checked by tests/kernels/gpu_compile.py."""
    bm, bn, bk, warps, stages = (64, 64, 32, 4, 2) if dtype == torch.float32 else (128, 128, 64, 8, 3)
    if BLOCKS is not None:
        bm, bn, bk = BLOCKS
    return bm, bn, bk, (1 if INTERPRET else warps), stages


def _precision(dtype):
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


@triton.jit
def _gg_rows(A, B, C, TABLE, NB, NCOL, RED, sbe, sbk, sbn, PREC: tl.constexpr, GROUP: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[r, n] = sum_k A[r, k] * B[e(r), k, n] over NB row blocks: A [N, RED] and C [N, NCOL] contiguous,
    B[e, k, n] at B + e*sbe + k*sbk + n*sbn (the forward reads w[e] transposed, dx reads it as is)."""
    pid = tl.program_id(0)
    ncb = tl.cdiv(NCOL, BLOCK_N)
    per_group = GROUP * ncb
    first = (pid // per_group) * GROUP
    size = tl.minimum(NB - first, GROUP)
    blk = first + (pid % per_group) % size
    cb = (pid % per_group) // size
    e = tl.load(TABLE + blk).to(tl.int64)
    r0 = tl.load(TABLE + NB + blk)
    r1 = tl.load(TABLE + 2 * NB + blk)
    rows = r0 + tl.arange(0, BLOCK_M)
    cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < r1
    cmask = cols < NCOL
    rows = rows.to(tl.int64)
    a_ptr = A + rows[:, None] * RED
    b_ptr = B + e * sbe + cols[None, :] * sbn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, RED, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < RED
        a = tl.load(a_ptr + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptr + ks[:, None] * sbk, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    tl.store(C + rows[:, None] * NCOL + cols[None, :], acc.to(C.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _gg_dw(DY, X, DW, OFFS, M, K, PREC: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """DW[e] [M, K] = DY_e^T X_e over the rows OFFS[e]..OFFS[e+1] (DY [N, M], X [N, K] contiguous)."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    nkb = tl.cdiv(K, BLOCK_N)
    ms = (pid // nkb) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = (pid % nkb) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = ms < M
    kmask = ks < K
    r0 = tl.load(OFFS + e)
    r1 = tl.load(OFFS + e + 1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(r0, r1, BLOCK_K):
        rs = start + tl.arange(0, BLOCK_K)
        rmask = rs < r1
        rs = rs.to(tl.int64)
        dyt = tl.load(DY + rs[None, :] * M + ms[:, None], mask=mmask[:, None] & rmask[None, :], other=0.0)
        x = tl.load(X + rs[:, None] * K + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(dyt, x, acc, input_precision=PREC)
    out = DW + e.to(tl.int64) * M * K + ms[:, None] * K + ks[None, :]
    tl.store(out, acc.to(DW.dtype.element_ty), mask=mmask[:, None] & kmask[None, :])


def _tables(counts, block_m, device):
    """One int32 tensor (a single host-to-device copy): the row-block table [3, NB] (expert, first
    row, end row) then the E+1 expert row offsets; and NB."""
    expert, first, end, offs = [], [], [], [0]
    for e, n in enumerate(counts):
        start = offs[-1]
        for r in range(start, start + n, block_m):
            expert.append(e)
            first.append(r)
            end.append(start + n)
        offs.append(start + n)
    t = torch.tensor(expert + first + end + offs, dtype=torch.int32)
    return t.to(device), len(expert)


def _rows_launch(a, w, out, table, nb, transpose_w):
    """out = grouped a @ w[e].T (transpose_w, the forward) or a @ w[e] (dx)."""
    ncol, red = out.shape[1], a.shape[1]
    if nb == 0 or ncol == 0:
        return out
    if red == 0:
        return out.zero_()
    bm, bn, bk, warps, stages = _config(a.dtype)
    sbe, sbk, sbn = (w.stride(0), w.stride(2), w.stride(1)) if transpose_w else w.stride()
    grid = (nb * triton.cdiv(ncol, bn),)
    _gg_rows[grid](a, w, out, table, nb, ncol, red, sbe, sbk, sbn, PREC=_precision(a.dtype), GROUP=GROUP_M,
                   BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out


class _GroupedGemmFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, *ws):
        stacked = len(ws) == 1 and ws[0].dim() == 3
        w = ws[0] if stacked else torch.stack(ws)
        x, w = x.contiguous(), w.contiguous()
        table, nb = _tables(counts, _config(x.dtype)[0], x.device)
        y = _rows_launch(x, w, empty((x.shape[0], w.shape[1]), x.device, x.dtype), table, nb, True)
        ctx.save_for_backward(x, table, *((w,) if stacked else ws))
        ctx.nb, ctx.stacked = nb, stacked
        return y

    @staticmethod
    def backward(ctx, dy):
        x, table, *ws = ctx.saved_tensors
        w = ws[0] if ctx.stacked else torch.stack(ws)
        dy = dy.to(x.dtype).contiguous()
        n, k = x.shape
        e, m = w.shape[0], w.shape[1]
        dx = dws = None
        if ctx.needs_input_grad[0]:
            dx = _rows_launch(dy, w, empty((n, k), x.device, x.dtype), table, ctx.nb, False)
        if any(ctx.needs_input_grad[2:]):
            dw = empty((e, m, k), w.device, w.dtype)
            if n == 0:
                dw.zero_()
            elif dw.numel():
                bm, bn, bk, warps, stages = _config(x.dtype)
                offs = table[3 * ctx.nb:]
                _gg_dw[(triton.cdiv(m, bm) * triton.cdiv(k, bn), e)](
                    dy, x, dw, offs, m, k, PREC=_precision(x.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                    num_warps=warps, num_stages=stages)
            dws = (dw,) if ctx.stacked else dw.unbind(0)
        return (dx, None) + (dws if dws is not None else (None,) * len(ws))


def _check(x, ws, stacked, counts):
    """ws: [w [E, M, K]] when stacked, else the E [M, K] weights."""
    shapes = {tuple(t.shape[1:] if stacked else t.shape) for t in ws}
    e = ws[0].shape[0] if stacked else len(ws)
    if x.dim() != 2 or len(shapes) != 1 or any(len(s) != 2 or s[1] != x.shape[1] for s in shapes) or \
            (stacked and ws[0].dim() != 3):
        raise ValueError(f"kernels.grouped_gemm: x [N, K] and w [E, M, K] (or E x [M, K]), got x "
                         f"{tuple(x.shape)}, w {[tuple(t.shape) for t in ws[:2]]}")
    if not e or len(counts) != e or any(c < 0 for c in counts) or sum(counts) != x.shape[0]:
        raise ValueError(f"kernels.grouped_gemm: counts {counts} must be {e} (> 0) non-negative ints summing "
                         f"to the {x.shape[0]} rows of x")
    if len({x.dtype} | {t.dtype for t in ws}) > 1:
        raise ValueError(f"kernels.grouped_gemm: x and w must have one dtype, got {x.dtype} and {ws[0].dtype}")


def grouped_gemm(x, w, counts):
    """y rows of expert e = x_e @ w[e].T (see the module doc): x [N, K] sorted by expert, counts of
    rows per expert, w [E, M, K] or a list of E [M, K] tensors -> y [N, M]."""
    counts = counts.tolist() if isinstance(counts, torch.Tensor) else [int(c) for c in counts]
    stacked = isinstance(w, torch.Tensor)
    ws = [w] if stacked else list(w)
    _check(x, ws, stacked, counts)
    if use_triton(x, *ws, kernel="grouped_gemm"):
        m, k = ws[0].shape[-2:]
        if m * k >= 2 ** 31:  # one expert's weight is addressed with int32 offsets
            raise ValueError(f"kernels.grouped_gemm: one expert's weight [{m}, {k}] has 2**31 elements or more")
        return _GroupedGemmFn.apply(x, counts, *ws)
    return torch.cat([xe @ we.t() for xe, we in zip(torch.split(x, counts), w.unbind(0) if stacked else ws)])
