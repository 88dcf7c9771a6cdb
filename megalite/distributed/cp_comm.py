"""Context-parallel communication: the ring exchange of ring attention, and autograd-aware
all-gather / all-to-all over the CP group (Megatron's get_context_parallel_group()).

The sequence layout under CP (Megatron's get_batch_on_this_cp_rank): every sequence is cut
into 2 x CP equal chunks and CP rank r keeps chunks r and 2CP-1-r, so every rank does the
same causal attention work. `local_token_index` says which global token each local row is.
"""

import torch
import torch.distributed as dist

from megalite import parallel_state as ps


def cp_size(grid):
    """The CP size of `grid` (every function here takes the grid whose CP group it uses: a layout fact)."""
    return grid.cp


def cp_chunks(rank, size):
    """The two of 2 x size chunks that CP rank `rank` keeps."""
    return rank, 2 * size - 1 - rank


def local_token_index(local_len, rank, size, device=None):
    """Global token index of each of this rank's local_len rows ([local_len] int64)."""
    c = local_len // 2
    a, b = cp_chunks(rank, size)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)])


def global_token_index(local_len, device, grid):
    """Global token index of this rank's rows: 0..local_len-1 without CP."""
    if grid.cp == 1:
        return torch.arange(local_len, device=device)
    return local_token_index(local_len, grid.cp_rank, grid.cp, device)


def slice_for_cp_rank(t, dim, rank=None, size=None, grid=None):
    """This CP rank's part of a full-sequence tensor: chunks r and 2CP-1-r along `dim` (rank and size: the
    grid's when not given)."""
    size = grid.cp if size is None else size
    if size == 1:
        return t
    rank = grid.cp_rank if rank is None else rank
    parts = t.chunk(2 * size, dim=dim)
    return torch.cat([parts[i] for i in cp_chunks(rank, size)], dim=dim)


class Ring:
    """Exchanges with the CP ring's neighbours: send to rank r+1, receive from rank r-1, both
    posted at once (no deadlock whoever posts first), waited on when the data is needed."""

    def __init__(self, group=None, ranks=None, grid=None):
        self.group = grid.cp_group if group is None else group  # (grid: when group and ranks are not given)
        ranks = list(grid.cp_ranks) if ranks is None else ranks
        self.rank = ranks.index(dist.get_rank())
        self.size = len(ranks)
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def start(self, send, tag=0):
        """Post send(send) -> next and a receive of the same shape <- prev; returns a handle."""
        send = send.contiguous()
        recv = torch.empty_like(send)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.group, tag),
                                       dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)])
        return reqs, recv, send

    @staticmethod
    def wait(handle):
        reqs, recv, _ = handle  # the send buffer stays referenced until here
        for r in reqs:
            r.wait()
        return recv


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along `dim` over the group (rank order); backward: reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        stacked = torch.stack(grad.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)).contiguous()
        out = torch.empty_like(stacked[0])
        ps.reduce_scatter_tensor(out.view(-1), stacked.view(-1), group=ctx.group)  # chunk i to rank i, summed
        return out, None, None


def all_gather_over_cp(x, dim, grid):
    return _AllGatherSeq.apply(x, dim, grid.cp_group)


class _AllToAll(torch.autograd.Function):
    """Split `x` along split_dim into group-size parts, send part j to rank j, concatenate what
    arrives along cat_dim (in rank order); backward: the inverse exchange."""

    @staticmethod
    def forward(ctx, x, split_dim, cat_dim, group):
        ctx.split_dim, ctx.cat_dim, ctx.group = split_dim, cat_dim, group
        return _all_to_all(x, split_dim, cat_dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.cat_dim, ctx.split_dim, ctx.group), None, None, None


def _all_to_all(x, split_dim, cat_dim, group):
    n = dist.get_world_size(group)
    send = torch.stack(x.chunk(n, dim=split_dim)).contiguous()  # part j (dim 0) goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # the single-tensor form: gloo has it
    return torch.cat(recv.unbind(0), dim=cat_dim)


def all_to_all_over_cp(x, split_dim, cat_dim, group=None, grid=None):
    return _AllToAll.apply(x, split_dim, cat_dim, grid.cp_group if group is None else group)


def sum_over_cp(t, grid):
    """Sum a tensor over the CP group, in place, outside autograd (loss sums and token counts)."""
    if grid.cp > 1:
        dist.all_reduce(t, group=grid.cp_group)
    return t
