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
  is kept iff (Philox4x32-10(key=seed, counter=(i*ceil(sk/4) + j//4, b*h_total + h, 0, 0))[j % 4] >> 1)
  >= round(p * 2**31) (one Philox call per 4 keys), the same numbers in the forward and both backward kernels.
fp32 inputs: the two matmuls of the Triton path run on TF32 tensor cores (inputs rounded to
  10-bit mantissas, fp32 accumulation, as torch's matmuls with allow_tf32); softmax, running
  max/sum and accumulators stay fp32. For full-fp32 products use kernels.use_backend("torch")
  (SDPA). bf16/fp16 inputs use bf16/fp16 tensor cores with fp32 accumulation.
Kernels (flash_attention_fwd.py, flash_attention_bwd.py): each walks the blocks every row sees whole with no
  mask, then the causal diagonal / ragged tail / padded blocks masked; K, V (and the backward's Q, dO) through
  TMA tensor descriptors on sm_90 when the [b, s, h, d] layout allows (no copy), else pointers. Backward: delta
  = rowsum(dO * O), then dK/dV per 128-row key block (S^T = K Q^T: wgmma-sized products; over the q heads of its
  GQA group, so no atomics) and dQ per query block. Launch configurations: the table below, or a tuned one.
CPU tensors take SDPA (GQA through enable_gqa, no repeated K/V copies).
"""
import math

import torch
import torch.nn.functional as F
import triton

from ._dispatch import INTERPRET, empty, use_triton
from .flash_attention_bwd import _attn_bwd_dkdv, _attn_bwd_dq
from . import flash_attention_config as cfgs, tuned
from .flash_attention_config import MAX_HEAD_DIM, arch, launch_config
from .flash_attention_fwd import _attn_bwd_delta, _attn_fwd

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:
    _TensorDescriptor = None

LOG2E = 1.4426950408889634
FWD_BLOCKS = None  # (BLOCK_M, BLOCK_N) override of the configuration table; tests shrink them
BWD_BLOCKS = None  # (BLOCK_M, BLOCK_N) of both backward kernels
TMA = None  # None: tensor descriptors where the device has TMA (sm_90+) and the layout allows; tests force True

def _config(t, kernel, dropout=False):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) of kernel 0 (fwd), 1 (dK/dV), 2 (dQ) for t's head dim."""
    d = t.shape[-1]
    bd = max(16, triton.next_power_of_2(d))
    bm, bn, warps, stages = launch_config(t, kernel, dropout)
    override = BWD_BLOCKS if kernel else FWD_BLOCKS
    if override is not None:
        bm, bn = override
    return bm, bn, bd, (1 if INTERPRET else warps), stages


def _tma(*tensors):
    """Tensor descriptors for these [b, s, h, d] tensors: each must view as [b * s, h * d] with 16-byte rows."""
    if TMA is False or _TensorDescriptor is None or (TMA is None and arch(tensors[0]) < 90):
        return False
    for t in tensors:
        b, s, h, d = t.shape
        if d != triton.next_power_of_2(d) or d < 16 or t.stride(3) != 1 or (h > 1 and t.stride(2) != d) \
                or (b > 1 and t.stride(0) != s * t.stride(1)) or (t.stride(1) * t.element_size()) % 16 \
                or t.data_ptr() % 16:
            return False
    return True


def _desc(t, rows, use):
    """t's [b * s, h * d] descriptor with [rows, d] blocks (or t itself, unused, when use is False)."""
    if not use:
        return t
    b, s, h, d = t.shape
    return _TensorDescriptor(t, [b * s, h * d], [t.stride(1), 1], [rows, d])


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
    bm, bn, bd, warps, stages = _config(q, 0, dropout_p > 0)
    tma = _tma(k, v)
    _attn_fwd[(b * h, triton.cdiv(sq, bm))](
        q, k, _desc(k, bn, tma), v, _desc(v, bn, tma), o, lse, kpm_t, seed if seed is not None else lse,
        scale * LOG2E, thr, keep_scale, h, h // hk, sq, sk, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        skpm, CAUSAL=causal, HAS_KPM=kpm is not None, DROPOUT=seed is not None, PREC="tf32", TMA=tma, D=d,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, num_warps=warps, num_stages=stages)
    return o, lse, seed


def _backward(do, q, k, v, o, lse, kpm, seed, causal, scale, dropout_p, only=None):
    """The backward kernels for output o and base-2 lse (any o/lse: e.g. merged over ring blocks); `only` = 1
    or 2 launches just dK/dV or dQ after delta (the tuner's runs)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kpm_t = kpm.view(torch.uint8) if kpm is not None else lse
    skpm = kpm.stride(0) if kpm is not None else 0
    delta = empty((b, h, sq), q.device, torch.float32)
    bd = max(16, triton.next_power_of_2(d))
    rows = 64 if bd <= 128 else 16  # two [rows, bd] fp32 tiles in registers: d256 at 64 rows spilled (triton 3.6)
    _attn_bwd_delta[(triton.cdiv(sq, rows), b * h)](o, do, delta, h, sq, d, *_strides(o), *_strides(do),
                                                    BLOCK_M=rows, BLOCK_D=bd)
    dq = empty((b, sq, h, d), q.device, q.dtype)
    dk = empty((b, sk, hk, d), k.device, k.dtype)
    dv = empty((b, sk, hk, d), v.device, v.dtype)
    common = (seed if seed is not None else lse, scale * LOG2E, scale, *_dropout_args(dropout_p))
    meta = dict(CAUSAL=causal, HAS_KPM=kpm is not None, DROPOUT=seed is not None, PREC="tf32", D=d, BLOCK_D=bd)
    tma = _tma(q, k, v, do)
    bm, bn, _, warps, stages = _config(q, 1, seed is not None)
    if only != 2:
        _attn_bwd_dkdv[(b * hk, triton.cdiv(sk, bn))](
            q, _desc(q, bm, tma), k, v, do, _desc(do, bm, tma), lse, delta, dk, dv, kpm_t, *common, h, hk,
            h // hk, sq, sk, *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), skpm,
            TMA=tma, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **meta)
    bm, bn, _, warps, stages = _config(q, 2, seed is not None)
    if only != 1:
        _attn_bwd_dq[(b * h, triton.cdiv(sq, bm))](
            q, k, _desc(k, bn, tma), v, _desc(v, bn, tma), do, lse, delta, dq, kpm_t, *common, h, h // hk, sq, sk,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do), skpm, TMA=tma, BLOCK_M=bm, BLOCK_N=bn,
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


def _scale(q, softmax_scale):
    """The softmax scale, 1/sqrt(d) by default; it must be positive (the unmasked loop folds it into exp2's FMA
    after the row maximum, which a negative scale would turn into the minimum; SDPA on CPU returns NaN)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if not scale > 0:
        raise ValueError(f"kernels.flash_attention: softmax_scale must be positive, got {scale}")
    return float(scale)


def _triton_path(q, k, v, kpm=None, kernel="flash_attention"):
    return q.shape[-1] <= MAX_HEAD_DIM and use_triton(q, k, v, kpm, kernel=kernel)


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
    scale = _scale(q, softmax_scale)
    if _triton_path(q, k, v, kernel="flash_attention_block"):
        o, lse, _ = _forward(q, k, v, bool(causal), float(scale), None, 0.0)
        return o, torch.where(torch.isinf(lse), torch.full_like(lse, float("-inf")), lse / LOG2E)
    lse, p = _block_probs(q, k, causal, scale)
    o = p @ v.float().repeat_interleave(q.shape[2] // k.shape[2], 2).transpose(1, 2)
    return o.transpose(1, 2).to(q.dtype), lse


def flash_attention_block_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=None):
    """(dq, dk, dv) of one block given the output and natural-log lse of the whole attention
    the block is part of (ring attention merges them over blocks): the recomputed
    probabilities exp(s - lse) are the block's share; dk, dv summed over each KV head's queries."""
    scale = _scale(q, softmax_scale)
    if _triton_path(q, k, v, kernel="flash_attention_block"):
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
    scale = _scale(q, softmax_scale)
    if _triton_path(q, k, v, kpm):
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        return _FlashAttnFn.apply(q, k, v, bool(causal), float(scale), kpm, float(dropout_p))
    return _attention_torch(q, k, v, causal, scale, kpm, float(dropout_p))


# ---- the tuning space (kernels/tuned.py; benchmarks/tune_kernels.py searches it) ------------------------------
def _make(kernel):
    def make(bucket, dtype, device, small=False):
        b, s, h, hk = (1, 64, 2, 1) if small else (2, 4096, 32, 8)  # Llama-3's GQA 32:8 at 4k
        q = torch.randn(b, s, h, bucket, device=device, dtype=dtype)
        k, v = (torch.randn(b, s, hk, bucket, device=device, dtype=dtype) for _ in range(2))
        scale = bucket ** -0.5
        o, lse, _ = _forward(q, k, v, True, scale, None, 0.0)
        do = torch.randn_like(o)

        def run(cfg):
            with tuned.forced(cfgs.KERNELS[kernel], cfg):
                if kernel == 0:
                    return _forward(q, k, v, True, scale, None, 0.0)
                return _backward(do, q, k, v, o, lse, None, None, True, scale, 0.0, only=kernel)
        return run
    return make


SPACES = tuple(tuned.register(tuned.Space(
    kernel=cfgs.KERNELS[i], params=cfgs.PARAMS[i], buckets=(64, 128), make=_make(i), valid=cfgs.valid(i),
    default=cfgs.default_for(i), dtypes=(torch.bfloat16,))) for i in range(3))
