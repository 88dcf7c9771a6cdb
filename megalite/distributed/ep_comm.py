"""The expert-parallel collectives the MoE token dispatchers use, as autograd functions over the
expert-parallel group (so model code never calls torch.distributed). Rows are tokens:
- all_gather_rows / reduce_scatter_rows: each other's adjoint (the allgather dispatcher);
- all_to_all_rows: rows to each rank by split sizes; its adjoint is the same exchange with the
  splits swapped (the alltoall dispatcher);
- exchange_counts: every rank's per-expert token counts for this rank's experts (no gradient).
Each records its bytes in megalite.distributed.comm (what benchmarks/moe.py compares with theory).
"""

import math

import torch
import torch.distributed as dist

from megalite import parallel_state as ps
from megalite.distributed import comm


def _group():
    return ps.get_expert_model_parallel_group()


def _gather(x):
    ep = ps.get_expert_model_parallel_world_size()
    out = x.new_empty((ep * x.shape[0],) + tuple(x.shape[1:]))
    comm.all_gather(out, x.contiguous(), group=_group())
    return out


def _reduce_scatter(x):
    ep = ps.get_expert_model_parallel_world_size()
    out = x.new_empty((x.shape[0] // ep,) + tuple(x.shape[1:]))
    comm.reduce_scatter(out, x.contiguous(), group=_group())
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather(x)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _reduce_scatter(x)

    @staticmethod
    def backward(ctx, g):
        return _gather(g)


def all_gather_rows(x):
    """[T, ...] on each EP rank -> [EP·T, ...], rank r's rows at r·T (backward: reduce-scatter)."""
    return _AllGather.apply(x) if ps.get_expert_model_parallel_world_size() > 1 else x


def reduce_scatter_rows(x):
    """[EP·T, ...] summed over EP ranks, this rank's T rows kept (backward: all-gather)."""
    return _ReduceScatter.apply(x) if ps.get_expert_model_parallel_world_size() > 1 else x


def _exchange(x, out_splits, in_splits):
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    row = math.prod(x.shape[1:]) * x.element_size()  # (a rank may send no row at all)
    me = ps.get_expert_model_parallel_rank()
    comm.record_sent("all_to_all", x.numel() * x.element_size(), (sum(in_splits) - in_splits[me]) * row)
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=_group())
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        return _exchange(x, out_splits, in_splits)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _exchange(g, in_splits, out_splits), None, None


def all_to_all_rows(x, out_splits, in_splits):
    """Send in_splits[r] consecutive rows to EP rank r; receive out_splits[r] rows from it."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits))


def exchange_counts(counts):
    """counts [EP·L] (this rank's tokens per global expert) -> [EP, L]: row s = what EP rank s
    sends to each of this rank's L experts."""
    ep = ps.get_expert_model_parallel_world_size()
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=_group())
    return out.view(ep, -1)
