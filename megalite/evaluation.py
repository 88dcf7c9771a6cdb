"""Evaluation: forward-only passes over the validation / test data, mean losses over
micro-batches, iterations and DP ranks (every rank gets the same numbers)."""

import torch

from megalite import parallel_state as ps
from megalite.distributed.collectives import average_over_data_parallel, broadcast_from_last_rank
from megalite.pipeline.schedules import get_forward_backward_func


def run_forward_backward(forward_step_func, iters, chunks, num_microbatches, shape, dtype, **kw):
    fwd_bwd = get_forward_backward_func()
    model = chunks if len(chunks) > 1 else chunks[0]
    data = iters if len(chunks) > 1 else iters[0]
    return fwd_bwd(forward_step_func, data, model, num_microbatches, tensor_shape=shape, dtype=dtype, **kw)


def mean_loss(reported, key="lm loss"):
    """Mean over micro-batches and DP ranks, the same number on every rank."""
    dev = ps.get_device()
    if reported:
        vals = torch.stack([r[key].float() for r in reported]).mean().reshape(1).to(dev)
        vals = average_over_data_parallel(vals)
    else:  # a stage without the loss (pipeline)
        vals = torch.zeros(1, device=dev)
    return broadcast_from_last_rank(vals).item()


def evaluate(forward_step_func, iters, chunks, num_microbatches, eval_iters, shape, dtype):
    """{"lm loss": mean} over `eval_iters` global batches."""
    for c in chunks:
        c.eval()
    losses = []
    with torch.no_grad():
        for _ in range(eval_iters):
            reported = run_forward_backward(forward_step_func, iters, chunks, num_microbatches, shape, dtype,
                                            forward_only=True)
            losses.append(mean_loss(reported))
    for c in chunks:
        c.train()
    return {"lm loss": sum(losses) / len(losses)}
