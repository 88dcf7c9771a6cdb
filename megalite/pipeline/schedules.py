"""Forward/backward schedules over the micro-batches of one iteration.

A forward step function has Megatron's contract:
    forward_step_func(data_iterator, model) -> (output_tensor, loss_func)
    loss_func(output_tensor) -> (loss, {"lm loss": detached loss})
The loss of each micro-batch is divided by the number of micro-batches so that the
accumulated gradient is that of the mean loss over the global batch.
"""

import contextlib

from megalite import parallel_state as ps


def _forward_backward_step(forward_step_func, data_iterator, model, num_microbatches, forward_only, loss_scale):
    output, loss_func = forward_step_func(data_iterator, model)
    loss, reported = loss_func(output)
    if not forward_only:
        (loss * (loss_scale / num_microbatches)).backward()
    return reported


def forward_backward_no_pipelining(forward_step_func, data_iterator, model, num_microbatches,
                                   forward_only=False, loss_scale=1.0):
    """All micro-batches on this stage; the DP gradient reduction is left to the last one's
    backward (bucket hooks), earlier micro-batches only accumulate."""
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    reported = []
    with no_sync():
        for _ in range(num_microbatches - 1):
            reported.append(_forward_backward_step(forward_step_func, data_iterator, model, num_microbatches,
                                                   forward_only, loss_scale))
    reported.append(_forward_backward_step(forward_step_func, data_iterator, model, num_microbatches,
                                           forward_only, loss_scale))
    return reported


def get_forward_backward_func():
    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("pipeline schedules are not implemented yet")
    return forward_backward_no_pipelining
