"""Causal self-attention over a sequence split across context-parallel (CP) ranks.

Each CP rank holds two of the 2 x CP chunks of every sequence (megalite.distributed.cp_comm)
and computes the attention of its own queries. `--cp-comm-type`:
- p2p (ring, Megatron's default): K/V blocks travel around the CP ring, the next block's
  exchange overlapping this block's attention. Each block gives a partial output normalised
  on its own and its log-sum-exp (LSE); partials merge exactly through their LSEs. A block
  is computed only where queries can see keys: with the balanced chunks that is half of
  every remote block (all queries against the first chunk of a lower rank, the second
  query chunk against the whole block of a higher rank), so every rank does the same work.
  The backward recomputes each block's probabilities from the merged output and LSE, and
  the dK/dV of a block travel around the ring with it back to their owner.
- a2a (Ulysses): all-to-all from sequence-sharded to head-sharded, full attention over the
  whole sequence for 1/CP of the heads, all-to-all back.
- allgather: K/V all-gathered, attention for the local queries (backward: reduce-scatter).
- a2a+p2p (--hierarchical-context-parallel-sizes A B): all-to-all within each group of A
  consecutive CP ranks (each then holds 1/A of the heads for the group's tokens), the ring
  across the B groups, all-to-all back.
Causality is by global token index, so each path equals attention over the whole sequence;
a document mask (--reset-attention-mask: every rank holds the whole sequence's [b, 1, S, S])
is indexed at the same global rows and columns; a key-padding mask [b, 1, 1, S] (BERT) makes
the attention non-causal over the unpadded keys.
Dropout on the probabilities draws from the per-(TP, CP)-rank tracked stream; the ring keeps
its block masks for the backward.
"""

import contextlib

import torch
import torch.nn.functional as F

import kernels
from kernels.flash_attention import MAX_HEAD_DIM

from megalite import parallel_state as ps
from megalite.distributed.cp_comm import Ring, all_gather_over_cp, all_to_all_over_cp, local_token_index
from megalite.tensor_parallel import get_rng_tracker

COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


def _finite(lse):
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # fully masked rows: -inf -> 0


def _plan(qi, ki):
    """(query rows, key columns, mask or None) of the part of a block where queries can see
    keys (causal by global index, True = masked); None when no query sees any key."""
    rows = (qi >= ki.min()).nonzero().squeeze(1)
    if rows.numel() == 0:
        return None
    cols = (ki <= qi.max()).nonzero().squeeze(1)
    mask = ki[cols][None, :] > qi[rows][:, None]
    return rows, cols, (mask if bool(mask.any()) else None)


def _scores(q, k, scale, mask):
    """q [b, hkv, g, sq, d], k [b, hkv, sk, d] -> scores [b, hkv, g, sq, sk] (masked: -inf)."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(mask, float("-inf"))


def block_forward(q, k, v, scale, mask=None, p=0.0):
    """Attention of q on one K/V block, normalised within the block: (out [b, hkv, g, sq, d],
    lse [b, hkv, g, sq], dropout keep-mask or None)."""
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    probs = torch.exp(s - _finite(lse)[..., None])
    keep = None
    if p > 0:
        keep = torch.rand_like(probs) >= p
        probs = probs * keep / (1.0 - p)
    return torch.matmul(probs, v.unsqueeze(2)), lse, keep


def merge(out, lse, o, lse_o):
    """Two partial attentions of the same queries (each normalised on its own) -> one."""
    new = torch.logaddexp(lse, lse_o)
    n = _finite(new)[..., None]
    return out * torch.exp(lse[..., None] - n) + o * torch.exp(lse_o[..., None] - n), new


def block_backward(q, k, v, lse, dout, delta, scale, mask=None, p=0.0, keep=None):
    """Gradients of one block given the *merged* output's lse and delta = rowsum(dout * out):
    (dq, dk, dv); dk, dv summed over the query heads of each KV head."""
    probs = torch.exp(_scores(q, k, scale, mask) - _finite(lse)[..., None])
    dprobs = torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2))
    if keep is not None:
        dv = torch.matmul((probs * keep / (1.0 - p)).transpose(-1, -2), dout).sum(2)
        dprobs = dprobs * keep / (1.0 - p)
    else:
        dv = torch.matmul(probs.transpose(-1, -2), dout).sum(2)
    ds = probs * (dprobs - delta[..., None])
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2) * scale
    return dq, dk, dv


def _on_device(plan, qi, ki, doc_mask, device):
    """A block's plan (made on the host) on the compute device: (rows, cols, mask), the mask
    causal by index, or the document mask's rows and columns, or the key-padding mask's
    columns ([b, 1, 1, rows or 1, cols] against scores [b, hkv, g, rows, cols])."""
    rows, cols, mask = plan
    if doc_mask is not None:
        kcols = ki[cols].to(device)
        mask = doc_mask[:, :, :, kcols] if doc_mask.shape[2] == 1 else \
            doc_mask[:, :, qi[rows].to(device)][:, :, :, kcols]  # key padding, or documents
        mask = mask.unsqueeze(2)
    elif mask is not None:
        mask = mask.to(device)
    return rows.to(device), cols.to(device), mask


def _whole(qi, ki):
    """The plan of a non-causal block: every query against every key."""
    return torch.arange(len(qi)), torch.arange(len(ki)), None


def _runs(idx):
    """[(start, end, first global index)] of the runs of consecutive global indices in idx."""
    vals, out, a = idx.tolist(), [], 0
    for i in range(1, len(vals) + 1):
        if i == len(vals) or vals[i] != vals[i - 1] + 1:
            out.append((a, i, vals[a]))
            a = i
    return out


def _flash_pairs(qi, ki):
    """The visible (query run, key run, causal) pairs of a block when each is either fully
    visible or the causal square (always so for CP's chunks); None when some pair is neither."""
    pairs = []
    for qa, qb, q0 in _runs(qi):
        for ka, kb, k0 in _runs(ki):
            if k0 > q0 + (qb - qa) - 1:
                continue  # every key after every query
            if k0 + (kb - ka) - 1 <= q0:
                pairs.append((qa, qb, ka, kb, False))
            elif k0 == q0 and kb - ka == qb - qa:
                pairs.append((qa, qb, ka, kb, True))
            else:
                return None
    return pairs


_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _heads(q, k):
    """q [b, hkv, g, n, d], k [b, hkv, m, d] -> [b, hkv*g, n, d] each (k repeated per query head)."""
    b, hkv, g, n, d = q.shape
    return q.reshape(b, hkv * g, n, d), k.unsqueeze(2).expand(b, hkv, g, k.shape[-2], d).reshape(b, hkv * g, -1, d)


def _sub_forward(mode, q, k, v, causal, scale):
    """A fully visible or causal-square sub-block: (out [b, hkv, g, n, d], lse [b, hkv, g, n]).
    mode "flash": torch's CPU flash kernel (heads repeated for GQA); "triton": megalite's."""
    b, hkv, g, n, d = q.shape
    if mode == "triton":
        o, lse = kernels.flash_attention_block(q.reshape(b, hkv * g, n, d).transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), causal, scale)
        return o.transpose(1, 2).reshape(q.shape), lse.view(q.shape[:-1])
    qh, kh = _heads(q, k)
    o, lse = _FLASH(qh, kh, _heads(q, v)[1], 0.0, causal, scale=scale)
    return o.view(q.shape), lse.view(q.shape[:-1])


def _sub_backward(mode, dout, q, k, v, out, lse, causal, scale):
    """(dq [b, hkv, g, n, d], dk, dv [b, hkv, m, d]) of a sub-block, given the merged out and lse."""
    b, hkv, g, n, d = q.shape
    if mode == "triton":
        def bshd(t):
            return t.reshape(b, hkv * g, n, d).transpose(1, 2)
        dq, dk, dv = kernels.flash_attention_block_backward(bshd(dout), bshd(q), k.transpose(1, 2), v.transpose(1, 2),
                                                            bshd(out), lse.reshape(b, hkv * g, n), causal, scale)
        return dq.transpose(1, 2).reshape(q.shape), dk.transpose(1, 2), dv.transpose(1, 2)
    qh, kh = _heads(q, k)
    dq, dk, dv = _FLASH_BWD(dout.reshape(qh.shape), qh, kh, _heads(q, v)[1], out.reshape(qh.shape),
                            lse.reshape(qh.shape[:-1]), 0.0, causal, scale=scale)
    m = k.shape[-2]
    return dq.view(q.shape), dk.view(b, hkv, g, m, d).sum(2), dv.view(b, hkv, g, m, d).sum(2)


class _OneBlock:
    """A ring of one rank: the block is all of K/V (allgather: K/V gathered beforehand)."""
    size, rank = 1, 0


class RingAttention(torch.autograd.Function):
    """q [b, hkv, g, s, d], k, v [b, hkv, s_k, d] (fp32, this rank's rows) -> (out, lse).
    doc_mask: None (causal) or the whole sequence's mask [b, 1, S, S] (True = masked).
    index_of(j): the global token index of ring rank j's rows (default: CP's balanced chunks);
    q_index: the queries' (default index_of(rank)); both host tensors: every block is planned
    on the host, with no device read in the step. Without dropout or document mask each
    block runs as sub-blocks that are fully visible or causal squares, on megalite's Triton
    flash kernel (CUDA) or torch's CPU flash kernel, both returning the LSE; otherwise
    explicitly (block_forward / block_backward).
    Only q, k, v, out and lse are kept for the backward, as flash attention."""

    @staticmethod
    def forward(ctx, q, k, v, scale, p, ring, doc_mask=None, index_of=None, q_index=None):
        n, r, s = ring.size, ring.rank, q.shape[-2]
        if index_of is None:
            def index_of(j):
                return local_token_index(s, j, n)
        qi = index_of(r) if q_index is None else q_index
        mode, padded = None, doc_mask is not None and doc_mask.shape[2] == 1
        if p == 0 and doc_mask is None:
            # larger heads: the explicit path; the blocks' kernel is not raced (its fallback is that explicit path)
            triton = kernels.use_triton(q, kernel="flash_attention_block") and q.shape[-1] <= MAX_HEAD_DIM
            mode = "triton" if triton else "flash" if _FLASH is not None and q.device.type == "cpu" else None
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv, keeps, plans = torch.stack([k, v]), [], []
        for i in range(n):
            handle = ring.start(kv) if i < n - 1 else None  # the next block travels meanwhile
            ki = index_of((r - i) % n)
            plan, keep = (_flash_pairs(qi, ki) if mode else None), None
            if plan is not None:
                for qa, qb, ka, kb, causal in plan:
                    o, lo = _sub_forward(mode, q[..., qa:qb, :], kv[0][..., ka:kb, :], kv[1][..., ka:kb, :], causal,
                                         scale)
                    out[..., qa:qb, :], lse[..., qa:qb] = merge(out[..., qa:qb, :], lse[..., qa:qb], o, lo)
                plan = (mode, plan)
            elif (plan := (_whole if padded else _plan)(qi, ki)) is not None:
                plan = rows, cols, _ = _on_device(plan, qi, ki, doc_mask, q.device)
                o, lo, keep = block_forward(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], scale, plan[2],
                                            p)
                out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], o, lo)
            plans.append(plan)
            keeps.append(keep)
            if handle is not None:
                kv = Ring.wait(handle)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.p, ctx.ring, ctx.plans, ctx.keeps = scale, p, ring, plans, keeps
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        ring, n = ctx.ring, ctx.ring.size
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)  # the gradient of the block held now, travelling with it
        for i in range(n):
            handle = ring.start(kv, tag=0) if i < n - 1 else None
            plan = ctx.plans[i]
            if plan is not None and isinstance(plan[0], str):  # sub-blocks on a flash kernel
                for qa, qb, ka, kb, causal in plan[1]:
                    gq, gk, gv = _sub_backward(plan[0], dout[..., qa:qb, :], q[..., qa:qb, :], kv[0][..., ka:kb, :],
                                               kv[1][..., ka:kb, :], out[..., qa:qb, :], lse[..., qa:qb], causal,
                                               ctx.scale)
                    dq[..., qa:qb, :] += gq
                    dkv[0][..., ka:kb, :] += gk
                    dkv[1][..., ka:kb, :] += gv
            elif plan is not None:
                rows, cols, mask = plan
                gq, gk, gv = block_backward(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], lse[..., rows],
                                            dout[..., rows, :], delta[..., rows], ctx.scale, mask, ctx.p,
                                            ctx.keeps[i])
                dq[..., rows, :] += gq
                dkv[0][..., cols, :] += gk
                dkv[1][..., cols, :] += gv
            if n > 1:
                dhandle = ring.start(dkv, tag=1)  # after the last step this reaches the block's owner
                if handle is not None:
                    kv = Ring.wait(handle)
                dkv = Ring.wait(dhandle)
        return dq, dkv[0], dkv[1], None, None, None, None, None, None


def _dropout_stream(p):
    return get_rng_tracker().fork() if p > 0 else contextlib.nullcontext()


def ring_attention(q, k, v, dropout_p=0.0, softmax_scale=None, ring=None, return_lse=False, doc_mask=None,
                   index_of=None, q_index=None):
    """q [b, s, hq, d], k, v [b, s, hkv, d] (this CP rank's rows) -> [b, s, hq, d] (and the
    LSE [b, hq, s] with return_lse); GQA: the KV heads travel, never repeated ones. doc_mask:
    the whole sequence's attention mask [b, 1, S, S] (True = masked), default causal."""
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    qf = q.float().permute(0, 2, 1, 3).reshape(b, hkv, hq // hkv, s, d)
    kf, vf = (t.float().permute(0, 2, 1, 3).contiguous() for t in (k, v))
    with _dropout_stream(dropout_p):
        ring = ring or Ring(grid=ps.current_grid())  # (a caller without its own: the global grid's CP ring)
        out, lse = RingAttention.apply(qf, kf, vf, scale, dropout_p, ring, doc_mask, index_of, q_index)
    out = out.reshape(b, hq, s, d).permute(0, 2, 1, 3).to(q.dtype)
    return (out, lse.reshape(b, hq, s)) if return_lse else out


def _global_index(s, n, device=None):
    """Global token index of the rows of a sequence gathered from all CP ranks in rank order."""
    return torch.cat([local_token_index(s, j, n, device) for j in range(n)])


def _mask(qi, ki, doc_mask):
    """[b or 1, 1, len(qi) or 1, len(ki)], True = masked: causal by index, or the document mask's,
    or the key-padding mask's columns."""
    if doc_mask is None:
        return (ki[None, :] > qi[:, None])[None, None]
    if doc_mask.shape[2] == 1:
        return doc_mask[:, :, :, ki]
    return doc_mask[:, :, qi][:, :, :, ki]


def context_parallel_attention(q, k, v, kind, dropout_p, training, core_attention, fused=False, doc_mask=None,
                               grid=None, softmax_scale=None):
    """This CP rank's attention output [b, s, hq, dv] for q [b, s, hq, d], k [b, s, hkv, d], v [b, s, hkv, dv].
    core_attention: the local attention (megalite.transformer.attention.core_attention) that
    a2a and allgather run with an explicit mask by global index. doc_mask: the whole
    sequence's [b, 1, S, S] (--reset-attention-mask), or its key-padding mask [b, 1, 1, S]
    (BERT: non-causal); default causal. grid: whose CP groups (default the global one).
    softmax_scale: default 1/sqrt(d). dv != d (multi-latent attention): the ring paths carry K and V
    in one buffer, so the smaller side travels zero-padded to the larger (zeros change no dot product
    and no output column that is kept); a2a moves them apart and needs none."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    with contextlib.nullcontext() if fused else kernels.use_backend("torch"):  # --no-fused-kernels: no Triton
        return _cp_attention(q, k, v, kind, dropout_p if training else 0.0, core_attention, fused, doc_mask,
                             ps.current_grid(grid), scale)


def _padded_ring(q, k, v, p, scale, **kw):
    """ring_attention for v's head dim != q's: the smaller zero-padded to the larger, the output cut to dv."""
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        return ring_attention(q, k, F.pad(v, (0, d - dv)), p, scale, **kw)[..., :dv]
    if dv > d:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    return ring_attention(q, k, v, p, scale, **kw)


def _cp_attention(q, k, v, kind, p, core_attention, fused, doc_mask, grid, scale):
    n, r = grid.cp, grid.cp_rank
    s = q.shape[1]
    if kind == "p2p":
        return _padded_ring(q, k, v, p, scale, ring=Ring(grid.cp_group, grid.cp_ranks), doc_mask=doc_mask)
    if kind == "allgather":  # the gathered K/V as one block (kept for the backward only as inputs)
        kg, vg = all_gather_over_cp(k, 1, grid), all_gather_over_cp(v, 1, grid)  # [b, n*s, hkv, d] in rank order
        qi, ki = local_token_index(s, r, n), _global_index(s, n)  # host: the ring plans there
        return _padded_ring(q, kg, vg, p, scale, ring=_OneBlock(), doc_mask=doc_mask, index_of=lambda j: ki,
                            q_index=qi)
    if kind == "a2a":
        qa, ka, va = (all_to_all_over_cp(t, 2, 1, grid=grid) for t in (q, k, v))  # heads out, sequence in
        gi = _global_index(s, n, q.device)
        if doc_mask is not None:
            out = core_attention(qa, ka, va, p, fused, True, attn_mask=_mask(gi, gi, doc_mask), softmax_scale=scale)
        else:  # the whole sequence in its natural order: plain causal attention (flash, no mask)
            order = torch.argsort(gi)
            out = core_attention(*(t.index_select(1, order) for t in (qa, ka, va)), p, fused, True,
                                 softmax_scale=scale)
            out = out.index_select(1, gi)  # back to the gathered order (gi inverts the sort)
        return all_to_all_over_cp(out, 1, 2, grid=grid)
    if kind == "a2a+p2p":
        (inner, inner_ranks), (outer, outer_ranks) = grid.hcp
        a, cp_ranks = len(inner_ranks), list(grid.cp_ranks)
        qa, ka, va = (all_to_all_over_cp(t, 2, 1, inner) for t in (q, k, v))  # 1/A of the heads, A x s rows

        def index_of(j):  # the rows of ring rank j: its inner group's CP ranks j*A .. j*A+A-1, in order
            return torch.cat([local_token_index(s, j * a + i, n) for i in range(a)])
        ring = Ring(outer, outer_ranks)
        assert ring.rank == cp_ranks.index(grid.rank) // a
        out = _padded_ring(qa, ka, va, p, scale, ring=ring, doc_mask=doc_mask, index_of=index_of)
        return all_to_all_over_cp(out, 1, 2, inner)
    raise ValueError(f"--cp-comm-type {kind!r} is not one of {', '.join(COMM_TYPES)}")
