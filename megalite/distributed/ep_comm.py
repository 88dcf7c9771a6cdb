"""The expert-parallel collectives the MoE token dispatchers use, as autograd functions over a group
of the expert grid (so model code never calls torch.distributed). A group is given as
(process group, size, this rank's index in it), see `groups()`. Rows are tokens:
- all_gather_rows / reduce_scatter_rows: each other's adjoint (the allgather dispatcher, over ETP x EP);
- all_to_all_rows: rows to each rank by split sizes; its adjoint is the same exchange with the
  splits swapped (the alltoall dispatcher, over EP);
- gather_uneven_rows / reduce_scatter_uneven_rows: every rank's rows, however many each has, to every
  rank, and back summed (the alltoall dispatcher over expert-TP), both through all_to_all_rows;
- exchange_counts / gather_counts: integer counts, no gradient.
Each records its bytes in megalite.distributed.comm (what benchmarks/moe.py compares with theory).
"""

import math

import torch
import torch.distributed as dist

from megalite import parallel_state as ps
from megalite.distributed import comm
from megalite.tensor_parallel.mappings import with_adjoint


def groups(grid):
    """{"ep", "etp", "tp_ep"}: (group, size, rank) of this rank's expert-parallel, expert-tensor-parallel
    and expert-tensor-and-expert-parallel groups of `grid`."""
    g = grid
    ep, (etp, etp_rank), ep_rank = g.ep, g.expert_tp(), g.ep_rank
    return {"ep": (g.ep_group, ep, ep_rank), "etp": (g.etp_group if g.experts else g.tp_group, etp, etp_rank),
            "tp_ep": (g.tp_ep_group, ep * etp, etp_rank + etp * ep_rank)}


def _gather(x, g):
    out = x.new_empty((g[1] * x.shape[0],) + tuple(x.shape[1:]))
    comm.all_gather(out, x.contiguous(), group=g[0])
    return out


def _reduce_scatter(x, g):
    out = x.new_empty((x.shape[0] // g[1],) + tuple(x.shape[1:]))
    comm.reduce_scatter(out, x.contiguous(), group=g[0])
    return out


_AllGather = with_adjoint(_gather, _reduce_scatter, "_AllGather")  # (tensor_parallel/mappings.py)
_ReduceScatter = with_adjoint(_reduce_scatter, _gather, "_ReduceScatter")


def all_gather_rows(x, g):
    """[T, ...] on each rank of g -> [size·T, ...], rank r's rows at r·T (backward: reduce-scatter)."""
    return _AllGather.apply(x, g) if g[1] > 1 else x


def reduce_scatter_rows(x, g):
    """[size·T, ...] summed over g, this rank's T rows kept (backward: all-gather)."""
    return _ReduceScatter.apply(x, g) if g[1] > 1 else x


def _exchange(x, out_splits, in_splits, g):
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    row = math.prod(x.shape[1:]) * x.element_size()  # (a rank may send no row at all)
    comm.record_sent("all_to_all", x.numel() * x.element_size(), (sum(in_splits) - in_splits[g[2]]) * row)
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=g[0])
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, g):
        ctx.splits, ctx.g = (out_splits, in_splits), g
        return _exchange(x, out_splits, in_splits, g)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.g), None, None, None


def all_to_all_rows(x, out_splits, in_splits, g):
    """Send in_splits[r] consecutive rows to rank r of g; receive out_splits[r] rows from it."""
    if g[1] == 1:
        return x
    return _AllToAll.apply(x, list(out_splits), list(in_splits), g)


def gather_uneven_rows(x, sizes, g):
    """Every rank's rows (sizes[r] of rank r) on every rank, in rank order; backward: each rank's
    rows' gradients summed over the ranks."""
    if g[1] == 1:
        return x
    return all_to_all_rows(x.repeat(g[1], *([1] * (x.dim() - 1))), sizes, [x.shape[0]] * g[1], g)


def reduce_scatter_uneven_rows(x, sizes, g):
    """Rows of every rank in rank order (sizes[r] of rank r) -> this rank's rows summed over the ranks."""
    if g[1] == 1:
        return x
    mine = sizes[g[2]]
    got = all_to_all_rows(x, [mine] * g[1], sizes, g)
    return got.view((g[1], mine) + tuple(x.shape[1:])).sum(0)


def exchange_counts(counts, g):
    """counts [size·L] (this rank's tokens per expert of each rank of g) -> [size, L]: row s = what
    rank s sends to each of this rank's L experts."""
    if g[1] == 1:
        return counts.view(1, -1)
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=g[0])
    return out.view(g[1], -1)


def gather_counts(counts, g):
    """[n] integers on each rank of g -> [size, n]."""
    if g[1] == 1:
        return counts.view(1, -1)
    out = counts.new_empty((g[1] * counts.numel(),))
    ps.all_gather_tensor(out, counts.contiguous().view(-1), group=g[0])
    return out.view(g[1], -1)
