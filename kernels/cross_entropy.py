"""Per-rank part of vocab-parallel cross-entropy (Megatron's vocab_parallel_cross_entropy).

cross_entropy(logits [..., V_local], target [...] int64 GLOBAL ids, label_smoothing=0.0,
              vocab_start_index=0, vocab_size=None, allreduce_max=None, allreduce_sum=None,
              inplace_backward=False) -> fp32 loss shaped like target

Forward: one pass over each row gives (local max, local sum exp(x - local max), target logit
(0 when the target lives on another rank), sum of logits); then allreduce_max(max), rescale
the sum-exp, and ONE allreduce_sum of the stacked [2 or 3, N] fp32 tensor. The callables
all-reduce a tensor in place over the tensor-parallel group; None means a single rank.
vocab_size: the real (unpadded) global vocab; columns with global id >= vocab_size are
padding, ignored in the loss and given zero gradient. Default: V_local (single rank); needed
with label smoothing when allreduce_sum is given.
Label smoothing follows torch.nn.functional.cross_entropy: (1-ls)*nll + ls*mean_v(-logp_v).
(Megatron's variant equals this with ls' = ls * V / (V - 1).)
Targets must be real ids; mask ignored tokens in the caller's loss mask.
Backward: grad = g * (softmax - (1-ls)*onehot - ls/V); with inplace_backward=True it is
written into the logits' storage (they must not be needed afterwards), so no second
logits-sized tensor exists. Kernel offsets are int64 (N*V may exceed 2**31).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._dispatch import empty, empty_like, use_triton

BLOCK_V = 4096  # tests lower it to cover several chunks per row
STAGES = 3  # the forward's chunk loop keeps STAGES - 1 chunks of loads in flight (cp.async) while one is reduced


@triton.jit
def _ce_fwd(LOGITS, TARGET, STATS, N, stride, V_REAL, vocab_start, SMOOTH: tl.constexpr, BLOCK: tl.constexpr,
            STAGES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride
    t = tl.load(TARGET + row).to(tl.int64) - vocab_start
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0
    # the target's logit by one load (0 when another rank holds it), not a [BLOCK] accumulator in the loop: the
    # pipelined loop's registers are what limits how many programs share an SM
    mine = (t >= 0) & (t < V_REAL)
    tgt = tl.load(base + tl.where(mine, t, 0), mask=mine, other=0.0).to(tl.float32)
    sx = tl.zeros([BLOCK], dtype=tl.float32)
    # pipelined: a row's chunks are independent loads (only the running max/sum carry over), so the next ones are
    # fetched while this one is reduced; one chunk a loop step was latency-bound
    for off in tl.range(0, V_REAL, BLOCK, num_stages=STAGES):
        c = off + cols
        msk = c < V_REAL
        x = tl.load(base + c, mask=msk, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))  # every chunk has a real column: finite
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
        if SMOOTH:
            sx += tl.where(msk, x, 0.0)
    tl.store(STATS + row, m)
    tl.store(STATS + N + row, s)
    tl.store(STATS + 2 * N + row, tgt)
    if SMOOTH:
        tl.store(STATS + 3 * N + row, tl.sum(sx, axis=0))


@triton.jit
def _ce_bwd(LOGITS, DX, TARGET, LSE, G, stride, V, V_REAL, vocab_start, ls, inv_vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    msk = c < V
    x = tl.load(LOGITS + row * stride + c, mask=msk, other=0.0).to(tl.float32)
    t = tl.load(TARGET + row).to(tl.int64) - vocab_start
    p = tl.exp(x - tl.load(LSE + row))
    grad = tl.load(G + row) * (p - tl.where(c == t, 1.0 - ls, 0.0) - ls * inv_vocab)
    grad = tl.where(c < V_REAL, grad, 0.0)  # padded vocab columns
    tl.store(DX + row * stride + c, grad.to(DX.dtype.element_ty), mask=msk)


def _stats_torch(x2, target, v_real, vocab_start, smooth):
    x = x2[:, :v_real].float()
    m = x.max(dim=-1).values if v_real else torch.full((x2.shape[0],), float("-inf"), device=x2.device)
    s = torch.exp(x - m[:, None]).sum(-1)
    t = target - vocab_start
    ok = (t >= 0) & (t < v_real)
    tgt = x.gather(1, t.clamp(0, max(v_real - 1, 0))[:, None]).squeeze(1) * ok if v_real else s * 0
    rows = [m, s, tgt] + ([x.sum(-1)] if smooth else [])
    return torch.stack(rows)


def _grad_torch(x2, target, lse, g, v_real, vocab_start, ls, vocab_size, out):
    p = torch.exp(x2.float() - lse[:, None])
    t = target - vocab_start
    ok = (t >= 0) & (t < v_real)
    p[ok, t[ok]] -= 1.0 - ls
    p -= ls / vocab_size
    p[:, v_real:] = 0.0
    return out.copy_(p * g[:, None])


class _CrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ls, vocab_start, vocab_size, allreduce_max, allreduce_sum, inplace):
        v = logits.shape[-1]
        x2 = logits.reshape(-1, v)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        t = target.reshape(-1).long().contiguous()
        n = x2.shape[0]
        v_real = max(0, min(v, vocab_size - vocab_start))
        smooth = ls > 0
        triton_path = use_triton(x2, kernel="cross_entropy")
        if triton_path:
            stats = empty((4 if smooth else 3, n), x2.device, torch.float32)
            if n:
                block = min(BLOCK_V, triton.next_power_of_2(max(v, 1)))
                _ce_fwd[(n,)](x2, t, stats, n, x2.stride(0), v_real, vocab_start, SMOOTH=smooth, BLOCK=block,
                              STAGES=STAGES if v_real > block else 1, num_warps=8)
        else:
            stats = _stats_torch(x2, t, v_real, vocab_start, smooth)
        m = stats[0]
        if allreduce_max is not None:
            gm = m.clone()
            allreduce_max(gm)
            stats[1] *= torch.exp(m - gm)
            m = gm
        red = stats[1:]  # [sum-exp, target logit(, sum logits)]: one fused all-reduce
        if allreduce_sum is not None:
            allreduce_sum(red)
        lse = m + torch.log(red[0])
        loss = lse - red[1]
        if smooth:
            loss = (1.0 - ls) * loss + ls * (lse - red[2] / vocab_size)
        ctx.save_for_backward(x2, t, lse)
        ctx.args = (v_real, vocab_start, ls, vocab_size, inplace, triton_path, logits.shape)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, g):
        x2, t, lse = ctx.saved_tensors
        v_real, vocab_start, ls, vocab_size, inplace, triton_path, shape = ctx.args
        g = g.reshape(-1).float().contiguous()
        dx = x2 if inplace else empty_like(x2)
        if triton_path:
            n, v = x2.shape
            block = min(BLOCK_V, triton.next_power_of_2(max(v, 1)))
            if n and v:
                _ce_bwd[(n, triton.cdiv(v, block))](x2, dx, t, lse, g, x2.stride(0), v, v_real, vocab_start,
                                                    ls, 1.0 / vocab_size, BLOCK=block, num_warps=8)
        else:
            _grad_torch(x2, t, lse, g, v_real, vocab_start, ls, vocab_size, dx)
        if inplace and hasattr(torch.autograd.graph, "increment_version"):
            torch.autograd.graph.increment_version(x2)  # other users of logits must see it changed
        return dx.view(shape), None, None, None, None, None, None, None


def cross_entropy(logits, target, label_smoothing=0.0, vocab_start_index=0, vocab_size=None,
                  allreduce_max=None, allreduce_sum=None, inplace_backward=False):
    """Per-token fp32 loss; see the module docstring for the vocab-parallel protocol."""
    if vocab_size is None:
        if label_smoothing > 0 and allreduce_sum is not None:
            raise ValueError("kernels.cross_entropy: pass vocab_size (the global, unpadded vocab) "
                             "with label smoothing over a vocab-parallel group")
        vocab_size = vocab_start_index + logits.shape[-1]
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"kernels.cross_entropy: target must be int64 ids, got {target.dtype}")
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"kernels.cross_entropy: target {tuple(target.shape)} must match "
                         f"logits {tuple(logits.shape)} without the vocab dim")
    if (allreduce_max is None and allreduce_sum is None and vocab_start_index == 0 and not inplace_backward
            and not use_triton(logits, kernel="cross_entropy")):
        # One rank on the torch path: torch's fused log-softmax is the fastest exact route
        # (about 3x fewer passes over the logits than the vocab-parallel algorithm).
        x = logits[..., :vocab_size] if vocab_size < logits.shape[-1] else logits
        x2 = x.reshape(-1, x.shape[-1])
        loss = F.cross_entropy(x2 if x2.dtype == torch.float32 else x2.float(), target.reshape(-1).long(),
                               label_smoothing=float(label_smoothing), reduction="none")
        return loss.view(target.shape)
    return _CrossEntropyFn.apply(logits, target, float(label_smoothing), int(vocab_start_index),
                                 int(vocab_size), allreduce_max, allreduce_sum, bool(inplace_backward))
