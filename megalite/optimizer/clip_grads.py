"""Global gradient norm over the whole grid, and clipping by it.

Each distinct gradient element is counted once: TP-duplicated parameters (norms, row
biases) only on TP rank 0, the last pipeline stage's copy of tied word embeddings not at
all. Squared norms are summed over the model-parallel group (TP x PP); gradients are equal
across DP after the reduction, so DP adds nothing.
"""

import torch
import torch.distributed as dist

from megalite import parallel_state as ps


def counted_once(param):
    if getattr(param, "shared_embedding", False) and not ps.is_pipeline_first_stage(ignore_virtual=True):
        return False
    return getattr(param, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_rank() == 0


def get_grad_norm(params, grads, sharded_over_dp=False):
    """L2 norm of the gradients of `params` (parallel lists) over the model-parallel group;
    with sharded_over_dp (ZeRO: each DP rank holds a disjoint slice) summed over DP too."""
    device = ps.get_device()
    sq = torch.zeros(1, dtype=torch.float32, device=device)
    for p, g in zip(params, grads):
        if counted_once(p):
            sq += torch.linalg.vector_norm(g, dtype=torch.float32) ** 2  # no gradient-sized temporary
    if sharded_over_dp and ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(sq, group=ps.get_data_parallel_group())
    group = ps.get_model_parallel_group()
    if group is not None and ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(sq, group=group)
    return sq.sqrt().item()


def clip_grads(grads, max_norm, total_norm):
    """Scale grads in place so their global norm is at most max_norm."""
    if max_norm <= 0:
        return
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
