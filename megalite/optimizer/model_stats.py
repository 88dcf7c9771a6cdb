"""Whole-model statistics for logging: parameter norm, zeros in the gradients."""

import torch

from megalite import parallel_state as ps
from megalite.distributed.param_facts import counted_once, grid_of_params, is_expert, sum_over_model


def global_norm_and_zeros(params, tensors, count_zeros=False, sharded_over_dp=False):
    """(L2 norm, number of zeros) of `tensors` (one per parameter) over the whole model: TP
    duplicates counted once, the last stage's tied-embedding copy not at all, summed over
    TP x PP (experts: EP x PP). Used for --log-params-norm and --log-num-zeros-in-grad."""
    params = list(params)
    parts = {True: torch.zeros(2, dtype=torch.float64, device=ps.get_device()),
             False: torch.zeros(2, dtype=torch.float64, device=ps.get_device())}
    for p, t in zip(params, tensors):
        if t is not None and counted_once(p):
            sq = parts[is_expert(p)]
            sq[0] += t.detach().double().pow(2).sum()
            if count_zeros:
                sq[1] += (t == 0).sum()
    sq = sum_over_model(parts[False], parts[True], sharded_over_dp, grid_of_params(params))
    return sq[0].sqrt().item(), sq[1].item()
