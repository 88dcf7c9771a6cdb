"""Compressed data-parallel gradient reduction for slow links (--grad-compression), with error
feedback: what a rank did not send this iteration is added to its next gradient, so nothing is
lost, only delayed.

- topk: each rank sends the `ratio` fraction of its (error-corrected) bucket with the largest
  magnitudes, as (index, value) pairs all-gathered over DP; every rank adds the pairs rank by
  rank (no two pairs of one rank share an index, so the sums are deterministic and the replicas
  stay bit-identical).
- powersgd (Vogels et al., 2019): every weight matrix M (n x m) of the bucket is sent as a rank-r
  product: P = M Q is all-reduced and orthonormalised, Q = M^T P all-reduced, and the gradient
  becomes P Q^T (Q is kept as the next iteration's start). r = the largest with r (n + m) <=
  ratio x n m, at least 1; matrices where that saves nothing, and vectors, are all-reduced whole.

Both run on the plain DP all-reduce, after the bucket is divided by its grad divisor, from
iteration --grad-compression-start-iter on (exact all-reduces before). Every rank issues the same
collectives. The error and Q buffers are not checkpointed: a resumed run restarts them at zero.
"""

import math

import torch
import torch.distributed as dist

from megalite.distributed import comm


class _Compressor:
    def __init__(self, ratio, start_iter, seed=0):
        self.ratio, self.start_iter, self.seed = ratio, start_iter, seed
        self.iteration, self.error = 0, {}

    @property
    def active(self):
        return self.iteration >= self.start_iter

    def _with_error(self, key, t):
        e = self.error.get(key)
        return t.clone() if e is None else t + e


class TopK(_Compressor):
    def reduce(self, bucket):
        data, group = bucket.data, bucket.group
        d = dist.get_world_size(group)
        acc = self._with_error(id(bucket), data)
        k = max(1, math.ceil(self.ratio * acc.numel()))
        idx = acc.abs().topk(k, sorted=False).indices
        vals = acc[idx]
        acc[idx] = 0
        self.error[id(bucket)] = acc  # what stays behind
        all_idx = torch.empty(d * k, dtype=idx.dtype, device=idx.device)
        all_vals = torch.empty(d * k, dtype=vals.dtype, device=vals.device)
        comm.all_gather(all_idx, idx, group=group)
        comm.all_gather(all_vals, vals, group=group)
        data.zero_()
        for r in range(d):  # rank by rank: indices of one rank are distinct, so the order is fixed
            data.index_add_(0, all_idx[r * k:(r + 1) * k], all_vals[r * k:(r + 1) * k])


def powersgd_rank(n, m, ratio):
    """The approximation rank for an n x m matrix (0: send it whole)."""
    r = min(n, m, max(1, int(ratio * n * m / (n + m))))
    return r if r * (n + m) < n * m else 0


class PowerSGD(_Compressor):
    def __init__(self, *args):
        super().__init__(*args)
        self.q = {}

    def reduce(self, bucket):
        group = bucket.group
        mats, whole = [], []
        for i, p in enumerate(bucket.params):
            g = p.main_grad
            r = powersgd_rank(*g.shape, self.ratio) if g.dim() == 2 else 0
            (mats if r else whole).append((i, g, r))
        if whole:
            flat = torch.cat([g.reshape(-1) for _, g, _ in whole])
            comm.all_reduce(flat, group=group)
            offset = 0
            for _, g, _ in whole:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        if not mats:
            return
        ms = [self._with_error((id(bucket), i), g) for i, g, _ in mats]
        qs = [self._start_q(bucket, i, g.shape[1], r, g) for i, g, r in mats]
        ps = self._sum([m @ q for m, q in zip(ms, qs)], group)
        ps = [torch.linalg.qr(p).Q for p in ps]  # identical inputs on every rank: identical bases
        qs = self._sum([m.t() @ p for m, p in zip(ms, ps)], group)
        for (i, g, _), m, p, q in zip(mats, ms, ps, qs):
            approx = p @ q.t()
            self.error[(id(bucket), i)] = m - approx
            self.q[(id(bucket), i)] = q
            g.copy_(approx)

    def _start_q(self, bucket, i, m, r, like):
        q = self.q.get((id(bucket), i))
        if q is None:  # the same random start on every rank
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + bucket.index * 1009 + i)
            q = torch.randn(m, r, generator=gen, dtype=torch.float32).to(like.device)
        return q

    @staticmethod
    def _sum(tensors, group):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        comm.all_reduce(flat, group=group)
        out, offset = [], 0
        for t in tensors:
            out.append(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        return out


def build_compressor(kind, ratio, start_iter, seed=0):
    """The DP bucket compressor for --grad-compression (None for "none")."""
    if kind in (None, "none"):
        return None
    return {"topk": TopK, "powersgd": PowerSGD}[kind](ratio, start_iter, seed)
