"""Small collectives the training loop needs (so it never touches process groups itself). Each takes the
grid whose groups it uses (a layout fact: always handed down, never the global one)."""

import torch
import torch.distributed as dist

from megalite import parallel_state as ps


def sum_over_data_parallel(values, grid):
    """Sum over the DP group of a 1-D float tensor (--data-parallel-shares: losses over the global count)."""
    if grid.dp > 1:
        values = values.clone()
        dist.all_reduce(values, group=grid.dp_group)
    return values


def max_over_data_parallel(values, grid, expert=False):
    """Elementwise maximum over the DP x CP group (the ranks that ran the iteration's other micro-batches and
    sequence chunks), e.g. FP8's amaxes; expert: over expert-DP (an MoE expert's copies)."""
    group, size, _ = grid.expert_dp() if expert else grid.dp_cp()
    if size > 1:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values


def average_over_data_parallel(values, grid):
    """Mean over the DP group of a 1-D float tensor (e.g. the micro-batch losses)."""
    dp = grid.dp
    return sum_over_data_parallel(values, grid) / dp if dp > 1 else values


def gather_rows(row):
    """Every rank's row of floats (float64), in rank order, the same list on every rank."""
    t = torch.tensor([float(v) for v in row], dtype=torch.float64, device=ps.get_device())
    gathered = [t]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, t)
    return [g.tolist() for g in gathered]


def max_per_data_parallel_rank(value, grid):
    """[largest `value` over the ranks of DP replica r, for each r], the same list on every rank."""
    out = [0.0] * grid.dp
    for v, r in gather_rows([value, grid.dp_rank]):
        out[int(r)] = max(out[int(r)], v)
    return out


def sum_over_replica_world(values, grid):
    """Sum over every rank of this rank's replica (the world without semi-synchronous replicas, which agree nothing
    else between them) of a float tensor, returned on the host: the kernels' race times (kernels/choice.py)."""
    t = values.to(ps.get_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, group=grid.replica_world_group)
    return t.cpu()


def broadcast_from_last_rank(values, grid):
    """Give every rank its replica's last rank's tensor (the last pipeline stage holds the loss; without
    semi-synchronous replicas: the world's last rank)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = grid.replica_world_ranks
        dist.broadcast(values, src=ranks[-1] if ranks else dist.get_world_size() - 1, group=grid.replica_world_group)
    return values


def any_rank(flag):
    """True on every rank when it is True on any (one one-element all-reduce)."""
    t = torch.tensor([1.0 if flag else 0.0], device=ps.get_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def broadcast_batch(batch, layout, grid):
    """The first rank's batch ({key: tensor}) to the other ranks of its TP x CP group (TP ranks
    use the same samples; CP ranks each keep their part of them); returns (batch, layout). The
    layout (keys, shapes, dtypes) goes once per data iterator as an object (pass back the
    returned one); after that a micro-batch is one broadcast per key, no host read."""
    g = grid
    if g.tp * g.cp == 1:
        return batch, layout
    group = g.tp_cp_group if g.cp > 1 else g.tp_group
    rank = g.tp_cp_rank()
    src = g.rank - rank  # TP x CP ranks are neighbours
    if layout is None:
        obj = [None if batch is None else tuple((k, tuple(v.shape), v.dtype) for k, v in batch.items())]
        dist.broadcast_object_list(obj, src=src, group=group)
        layout = obj[0]
    if rank != 0:
        batch = {k: torch.empty(shape, dtype=dtype, device=ps.get_device()) for k, shape, dtype in layout}
    for k in batch:
        dist.broadcast(batch[k], src=src, group=group)
    return batch, layout
