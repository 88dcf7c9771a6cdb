"""Small collectives the training loop needs (so it never touches process groups itself)."""

import torch.distributed as dist

from megalite import parallel_state as ps


def average_over_data_parallel(values):
    """Mean over the DP group of a 1-D float tensor (e.g. the micro-batch losses)."""
    if ps.get_data_parallel_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values, group=ps.get_data_parallel_group())
        values /= ps.get_data_parallel_world_size()
    return values


def broadcast_from_last_rank(values):
    """Give every rank the last rank's tensor (the last pipeline stage holds the loss)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(values, src=dist.get_world_size() - 1)
    return values
