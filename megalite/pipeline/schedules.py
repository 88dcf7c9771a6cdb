"""Forward/backward schedules over the micro-batches of one iteration.

A forward step function has Megatron's contract:
    forward_step_func(data_iterator, model) -> (output_tensor, loss_func)
    loss_func(output_tensor) -> (loss, {"lm loss": detached loss})
                              or (loss sum, token count, {"lm loss": [sum, count]})
Each micro-batch's loss is divided by the number of micro-batches (`loss_divisor`: by default
this rank's; with uneven data-parallel shares the global batch's, megalite/batching/iteration_plan.py), so
the accumulated gradient is that of the mean loss over the global batch. A loss function that returns a
token count (Megatron's --calculate-per-token-loss) is not divided: its gradients are divided by
the global batch's token count after the reduction (distributed/finalize.py). The DP gradient reduction is
left to the hooks of each model chunk's last backward (buckets start as they fill).
The micro-batch run every schedule shares (and what a call did, `trace`; a profiler's `timer`): run.py.
"""

from megalite import parallel_state as ps
from megalite.pipeline.interleaved import forward_backward_pipelining_with_interleaving
from megalite.pipeline.p2p import P2P
from megalite.pipeline.run import Run, free_output
from megalite.pipeline.zero_bubble_run import forward_backward_with_plan


def pipeline_tensor_shape(model_config, micro_batch_size, grid):
    """What travels between stages (of `grid`): [seq (/CP) (/TP under SP), micro-batch, hidden]."""
    c, tp, g = model_config, grid.tp, grid
    seq = c.seq_length // g.cp
    seq = seq // tp if c.sequence_parallel and tp > 1 else seq
    return (seq, micro_batch_size, c.hidden_size)


def forward_backward_no_pipelining(forward_step_func, data_iterator, model, num_microbatches,
                                   forward_only=False, loss_scale=1.0, tensor_shape=None, dtype=None,
                                   loss_divisor=None, trace=None, timer=None):
    """All micro-batches on this single stage, forward then backward each."""
    run = Run(forward_step_func, data_iterator, model, num_microbatches, forward_only, loss_scale, loss_divisor, trace,
              timer)
    try:
        for _ in range(num_microbatches):
            out = run.forward(0, None)
            if not forward_only:
                run.backward(0, None, out, None)
    finally:
        run.restore()
    return run.reported


def forward_backward_pipelining_without_interleaving(forward_step_func, data_iterator, model, num_microbatches,
                                                     forward_only=False, loss_scale=1.0, tensor_shape=None, dtype=None,
                                                     loss_divisor=None, trace=None, timer=None):
    """1F1B: warm-up = min(PP - stage - 1, M) forwards, then one forward / one backward,
    then the remaining backwards. Stage s holds at most PP - s micro-batches' activations."""
    run = Run(forward_step_func, data_iterator, model, num_microbatches, forward_only, loss_scale, loss_divisor, trace,
              timer)
    g, m = run.grid, num_microbatches
    pp, rank = g.pp, g.pp_rank
    p2p = P2P(tensor_shape, dtype, ps.get_device(), g)
    first, last = g.first_stage(), g.last_stage()
    warmup = min(pp - rank - 1, m)
    remaining = m - warmup
    inputs, outputs = [], []
    try:
        for _ in range(warmup):
            inp = None if first else p2p.recv_forward()
            out = run.forward(0, inp)
            if not last:
                p2p.send_forward(out)
            free_output(out, last)
            inputs.append(inp)
            outputs.append(out)
        inp = None if first or remaining == 0 else p2p.recv_forward()
        for i in range(remaining):
            is_last = i == remaining - 1
            out = run.forward(0, inp)
            if forward_only:
                if not last:
                    p2p.send_forward(out)
                inp = None if first or is_last else p2p.recv_forward()
                continue
            out_grad = None if last else p2p.send_forward_recv_backward(out)
            free_output(out, last)
            inputs.append(inp)
            outputs.append(out)
            in_grad = run.backward(0, inputs.pop(0), outputs.pop(0), out_grad)
            if is_last:
                inp = None
                if not first:
                    p2p.send_backward(in_grad)
            else:
                inp = None if first else p2p.send_backward_recv_forward(in_grad)
        if not forward_only:
            for _ in range(warmup):
                out_grad = None if last else p2p.recv_backward()
                in_grad = run.backward(0, inputs.pop(0), outputs.pop(0), out_grad)
                if not first:
                    p2p.send_backward(in_grad)
    finally:
        run.restore()
    return run.reported


def forward_backward_pipelining_zero_bubble(forward_step_func, data_iterator, model, num_microbatches,
                                            forward_only=False, loss_scale=1.0, tensor_shape=None, dtype=None,
                                            loss_divisor=None, trace=None, timer=None):
    """ZB-H1 (--pipeline-schedule zb-h1): 1F1B's order with each backward split, the weight gradients placed in
    the bubble (zero_bubble.py's plan, zero_bubble_run.py); forward only (evaluation): 1F1B's."""
    if forward_only:
        return forward_backward_pipelining_without_interleaving(
            forward_step_func, data_iterator, model, num_microbatches, True, loss_scale, tensor_shape, dtype,
            loss_divisor, trace, timer)
    return forward_backward_with_plan("zb-h1", forward_step_func, data_iterator, model, num_microbatches, False,
                                      loss_scale, tensor_shape, dtype, loss_divisor, trace, timer)


def forward_backward_pipelining_zero_bubble_v(forward_step_func, data_iterator, model, num_microbatches,
                                              forward_only=False, loss_scale=1.0, tensor_shape=None, dtype=None,
                                              loss_divisor=None, trace=None, timer=None):
    """ZB-V (--pipeline-schedule zbv): two model chunks per rank in a V (megalite/parallel/pipeline_stages.py),
    each backward split, by zero_bubble.py's plan; forward only: the plan's forwards."""
    return forward_backward_with_plan("zbv", forward_step_func, data_iterator, model, num_microbatches,
                                      forward_only, loss_scale, tensor_shape, dtype, loss_divisor, trace, timer)


def forward_backward_pipelining_dualpipe_v(forward_step_func, data_iterator, model, num_microbatches,
                                           forward_only=False, loss_scale=1.0, tensor_shape=None, dtype=None,
                                           loss_divisor=None, trace=None, timer=None):
    """DualPipeV (--pipeline-schedule dualpipev): ZB-V's two chunks per rank in a V, in DualPipe's order
    (zero_bubble.py's dualpipe_v_order); forward only: ZB-V's forwards."""
    return forward_backward_with_plan("dualpipev", forward_step_func, data_iterator, model, num_microbatches,
                                      forward_only, loss_scale, tensor_shape, dtype, loss_divisor, trace, timer)


def get_forward_backward_func(grid=None, schedule=None):
    """Megatron's: the schedule of `grid`'s layout (default the global one, as Megatron's takes none); schedule:
    --pipeline-schedule's (None: by the layout)."""
    g = ps.current_grid(grid)
    if g.pp == 1:
        return forward_backward_no_pipelining
    if g.pipeline_placement == "v":
        return forward_backward_pipelining_dualpipe_v if schedule == "dualpipev" else \
            forward_backward_pipelining_zero_bubble_v
    if g.vpp is not None:
        return forward_backward_pipelining_with_interleaving
    if schedule == "zb-h1":
        return forward_backward_pipelining_zero_bubble
    return forward_backward_pipelining_without_interleaving



def run_forward_backward(forward_step_func, iters, chunks, num_microbatches, shape, dtype, **kw):
    """One iteration's micro-batches over this rank's model chunks with the layout's schedule (iters: one data
    iterator per chunk); returns what the loss function reported per micro-batch (last stage)."""
    config = Run.config_of(chunks)
    fwd_bwd = get_forward_backward_func(ps.grid_of(chunks), getattr(config, "pipeline_schedule", None))
    model = chunks if len(chunks) > 1 else chunks[0]
    data = iters if len(chunks) > 1 else iters[0]
    return fwd_bwd(forward_step_func, data, model, num_microbatches, tensor_shape=shape, dtype=dtype, **kw)
