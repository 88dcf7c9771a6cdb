"""A blockwise-scaled FP8 GEMM (DeepSeek-V3's recipe, megalite's --fp8-recipe blockwise):

    C[m, n] = sum over K-blocks kb of (A[m, kb] . B[kb, n]) * SA[m, kb] * SB[kb, n // SB_GROUP]

A [M, K] and B [K, N] are FP8 (e4m3 or e5m2, any strides), K cut into blocks of 128; SA holds one fp32 factor
per row of A and K-block (activations' and gradients' 1 x 128 tiles), SB one per K-block and group of SB_GROUP
columns of B (128: a weight's 128 x 128 blocks; 1: an operand tiled along K per column, as the weight gradient's
second operand). Each K-block's product is an FP8 tensor-core GEMM accumulated in fp32, then rescaled and added
in fp32 (as DeepSeek-V3 promotes each 128-wide partial sum to fp32 with its scales). The torch fallback is the
fp32 product of the dequantized operands: the same sum in another order.
"""
import torch
import triton
import triton.language as tl

from ._dispatch import use_triton

BLOCK_K = 128  # the scales' block along the contraction


@triton.jit
def _blockwise_mm(A, B, C, SA, SB, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_sam, s_sak, s_sbk, s_sbn,
                  SB_GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + rk
        a = tl.load(A + rm[:, None] * s_am + k[None, :] * s_ak, mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(B + k[:, None] * s_bk + rn[None, :] * s_bn, mask=(k[:, None] < K) & (rn[None, :] < N), other=0.0)
        part = tl.dot(a, b, out_dtype=tl.float32)
        sa = tl.load(SA + rm * s_sam + kb * s_sak, mask=rm < M, other=0.0)
        sb = tl.load(SB + kb * s_sbk + (rn // SB_GROUP) * s_sbn, mask=rn < N, other=0.0)
        acc += part * sa[:, None] * sb[None, :]
    tl.store(C + rm[:, None] * s_cm + rn[None, :] * s_cn, acc.to(C.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _torch(a, sa, b, sb, sb_group, out_dtype):
    k = a.shape[1]
    da = a.float() * sa.repeat_interleave(BLOCK_K, dim=1)[:, :k]
    db = b.float() * sb.repeat_interleave(BLOCK_K, dim=0)[:k].repeat_interleave(sb_group, dim=1)[:, :b.shape[1]]
    return (da @ db).to(out_dtype)


def blockwise_mm(a, sa, b, sb, sb_group, out_dtype):
    """a [M, K], b [K, N] in FP8; sa [M, ceil(K/128)], sb [ceil(K/128), ceil(N/sb_group)] fp32 factors that undo
    their scales -> C [M, N] in out_dtype (see the module's docstring)."""
    m, k = a.shape
    n = b.shape[1]
    if sa.shape != (m, -(-k // BLOCK_K)) or sb.shape != (-(-k // BLOCK_K), -(-n // sb_group)):
        raise ValueError(f"kernels.blockwise_mm: scales {tuple(sa.shape)} / {tuple(sb.shape)} do not fit operands "
                         f"{tuple(a.shape)} x {tuple(b.shape)} in blocks of {BLOCK_K} (columns of b in groups of "
                         f"{sb_group})")
    if not use_triton(sa, kernel="fp8_blockwise"):
        return _torch(a, sa, b, sb, sb_group, out_dtype)
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if not c.numel():
        return c
    big = a.device.type != "cpu"  # (the interpreter: small tiles)
    bm, bn = (128, 128) if big else (32, 32)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _blockwise_mm[grid](a, b, c, sa, sb, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
                        c.stride(1), sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), SB_GROUP=sb_group,
                        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, num_warps=8 if big else 4, num_stages=3)
    return c
