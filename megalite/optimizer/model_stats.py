"""Whole-model statistics for logging: parameter norm, zeros in the gradients."""

import torch
import torch.distributed as dist

from megalite import parallel_state as ps
from megalite.optimizer.clip_grads import counted_once


def global_norm_and_zeros(params, tensors, count_zeros=False, sharded_over_dp=False):
    """(L2 norm, number of zeros) of `tensors` (one per parameter) over the whole model: TP
    duplicates counted once, the last stage's tied-embedding copy not at all, summed over
    TP x PP. Used for --log-params-norm and --log-num-zeros-in-grad."""
    sq = torch.zeros(2, dtype=torch.float64, device=ps.get_device())
    for p, t in zip(params, tensors):
        if t is not None and counted_once(p):
            sq[0] += t.detach().double().pow(2).sum()
            if count_zeros:
                sq[1] += (t == 0).sum()
    if sharded_over_dp and dist.is_initialized() and ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        dist.all_reduce(sq, group=ps.get_data_parallel_group(with_context_parallel=True))  # ZeRO: DP x CP slices
    group = ps.get_model_parallel_group()
    if dist.is_initialized() and group is not None:
        dist.all_reduce(sq, group=group)
    return sq[0].sqrt().item(), sq[1].item()
