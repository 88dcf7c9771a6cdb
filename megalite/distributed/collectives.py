"""Small collectives the training loop needs (so it never touches process groups itself)."""

import torch
import torch.distributed as dist

from megalite import parallel_state as ps


def sum_over_data_parallel(values):
    """Sum over the DP group of a 1-D float tensor (--data-parallel-shares: losses over the global count)."""
    if ps.get_data_parallel_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values, group=ps.get_data_parallel_group())
    return values


def average_over_data_parallel(values):
    """Mean over the DP group of a 1-D float tensor (e.g. the micro-batch losses)."""
    dp = ps.get_data_parallel_world_size()
    return sum_over_data_parallel(values) / dp if dp > 1 else values


def gather_rows(row):
    """Every rank's row of floats (float64), in rank order, the same list on every rank."""
    t = torch.tensor([float(v) for v in row], dtype=torch.float64, device=ps.get_device())
    gathered = [t]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, t)
    return [g.tolist() for g in gathered]


def max_per_data_parallel_rank(value):
    """[largest `value` over the ranks of DP replica r, for each r], the same list on every rank."""
    out = [0.0] * ps.get_data_parallel_world_size()
    for v, r in gather_rows([value, ps.get_data_parallel_rank()]):
        out[int(r)] = max(out[int(r)], v)
    return out


def broadcast_from_last_rank(values):
    """Give every rank its replica's last rank's tensor (the last pipeline stage holds the loss; without
    semi-synchronous replicas: the world's last rank)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        group, ranks = ps.get_replica_world_group() if ps.model_parallel_is_initialized() else (None, None)
        dist.broadcast(values, src=ranks[-1] if ranks else dist.get_world_size() - 1, group=group)
    return values


def any_rank(flag):
    """True on every rank when it is True on any (one one-element all-reduce)."""
    t = torch.tensor([1.0 if flag else 0.0], device=ps.get_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def broadcast_batch(batch, layout=None):
    """The first rank's batch ({key: tensor}) to the other ranks of its TP x CP group (TP ranks
    use the same samples; CP ranks each keep their part of them); returns (batch, layout). The
    layout (keys, shapes, dtypes) goes once per data iterator as an object (pass back the
    returned one); after that a micro-batch is one broadcast per key, no host read."""
    if ps.get_tensor_model_parallel_world_size() * ps.get_context_parallel_world_size() == 1:
        return batch, layout
    group = ps.get_tensor_and_context_parallel_group()
    rank = ps.get_tensor_and_context_parallel_rank()
    src = ps.global_rank() - rank  # TP x CP ranks are neighbours
    if layout is None:
        obj = [None if batch is None else tuple((k, tuple(v.shape), v.dtype) for k, v in batch.items())]
        dist.broadcast_object_list(obj, src=src, group=group)
        layout = obj[0]
    if rank != 0:
        batch = {k: torch.empty(shape, dtype=dtype, device=ps.get_device()) for k, shape, dtype in layout}
    for k in batch:
        dist.broadcast(batch[k], src=src, group=group)
    return batch, layout
