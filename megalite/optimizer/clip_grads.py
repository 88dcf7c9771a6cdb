"""Global gradient norm over the whole grid, and clipping by it.

Each distinct gradient element is counted once: TP-duplicated parameters (norms, row
biases) only on TP rank 0, the last pipeline stage's copy of tied word embeddings not at
all. Squared norms are summed over the model-parallel group (TP x PP), MoE experts' over
EP x PP (param_facts.sum_over_model); gradients are equal across DP after the reduction, so DP
adds nothing.

No host synchronisation and no kernel per parameter: the local norms come from one
torch._foreach_norm per device/dtype group, the clip factor stays a device tensor and is
applied with one torch._foreach_mul_. Only get_grad_norm (the float for logging) reads it.
"""

import torch

from megalite import parallel_state as ps
from megalite.distributed.param_facts import counted_once, grid_of_params, split_dense_expert, sum_over_model


def _foreach_sq_norm(grads, device):
    """Sum of squared L2 norms of `grads` as a 1-element fp32 tensor on `device`."""
    sq = torch.zeros(1, dtype=torch.float32, device=device)
    groups = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (_, dtype), group in groups.items():
        low = dtype in (torch.float16, torch.bfloat16)  # accumulate those in fp32
        norms = torch._foreach_norm(group, 2.0, dtype=torch.float32 if low else None)  # one launch per group
        sq += torch.stack(norms).float().square().sum().to(device)
    return sq


def grad_norm_tensor(params, grads, sharded_over_dp=False):
    """L2 norm of the gradients of `params` (parallel lists) over the model-parallel group (experts:
    over EP x PP), as a 1-element device tensor (no host sync); with sharded_over_dp (ZeRO: each DP
    rank holds a disjoint slice) summed over DP (experts: expert-DP) too."""
    params = list(params)
    kept = [(p, g) for p, g in zip(params, grads) if counted_once(p)]
    dense, expert = split_dense_expert([p for p, _ in kept], [g for _, g in kept])
    dev = ps.get_device()
    return sum_over_model(_foreach_sq_norm(dense, dev), _foreach_sq_norm(expert, dev), sharded_over_dp,
                          grid_of_params(params)).sqrt()


def get_grad_norm(params, grads, sharded_over_dp=False):
    """grad_norm_tensor as a Python float (one host sync)."""
    return grad_norm_tensor(params, grads, sharded_over_dp).item()


def clip_grads(grads, max_norm, total_norm):
    """Scale grads in place so their global norm is at most max_norm. total_norm: a float or a
    device tensor (then the factor min(1, max_norm / (norm + 1e-6)) is computed and applied on
    the device, without reading it on the host)."""
    if max_norm <= 0 or not grads:
        return
    if isinstance(total_norm, torch.Tensor):
        # In float64, then rounded once to the gradients' dtype: the same factor as the float
        # path (a Python float times an fp32 tensor), so no layout's trajectory moves.
        coef = torch.clamp(max_norm / (total_norm.double() + 1e-6), max=1.0).float()
        groups = {}
        for g in grads:
            groups.setdefault(g.device, []).append(g)
        for dev, group in groups.items():
            torch._foreach_mul_(group, coef.reshape(()).to(dev))
        return
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(list(grads), coef)
