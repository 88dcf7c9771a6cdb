"""Forward/backward schedules over the micro-batches of one iteration.

A forward step function has Megatron's contract:
    forward_step_func(data_iterator, model) -> (output_tensor, loss_func)
    loss_func(output_tensor) -> (loss, {"lm loss": detached loss})
                              or (loss sum, token count, {"lm loss": [sum, count]})
Each micro-batch's loss is divided by the number of micro-batches (`loss_divisor`: by default
this rank's; with uneven data-parallel shares the global batch's, megalite/iteration_plan.py), so
the accumulated gradient is that of the mean loss over the global batch. A loss function that returns a
token count (Megatron's --calculate-per-token-loss) is not divided: its gradients are divided by
the global batch's token count after the reduction (distributed/finalize.py). The DP gradient reduction is
left to the hooks of each model chunk's last backward (buckets start as they fill).

`last_run` records the latest call's operations (("F"|"B", chunk, micro-batch) in order)
and the most micro-batches whose activations were alive at once, for tests and benchmarks.
"""

import torch

from megalite import parallel_state as ps
from megalite.moe.router import set_aux_loss_scale
from megalite.pipeline.p2p import P2P

last_run = {"ops": [], "max_alive": 0}
stage_timer = None  # while megalite/pipeline/auto_layout.py profiles: kind ("F" | "B") -> a context around the op


class _Run:
    """State shared by the schedules: the chunks, data, loss collection and bookkeeping."""

    def __init__(self, forward_step_func, data_iterator, model, num_microbatches, forward_only, loss_scale,
                 loss_divisor=None):
        self.chunks = model if isinstance(model, list) else [model]
        its = data_iterator if isinstance(data_iterator, list) else [data_iterator] * len(self.chunks)
        self.iters, self.func = its, forward_step_func
        self.m, self.forward_only, self.loss_scale = num_microbatches, forward_only, loss_scale
        self.divisor = loss_divisor or num_microbatches
        # MoE auxiliary losses enter the backward scaled as the main loss (Megatron's MoEAuxLossAutoScaler)
        config = getattr(getattr(self.chunks[0], "module", self.chunks[0]), "config", None)
        per_token = getattr(config, "calculate_per_token_loss", False)
        set_aux_loss_scale(loss_scale if per_token else loss_scale / self.divisor)
        self.reported, self.alive = [], 0
        self.next_mb = [0] * len(self.chunks)
        self.bwd_mb = [0] * len(self.chunks)
        last_run["ops"], last_run["max_alive"] = [], 0
        self._sync_states = [getattr(c, "sync_enabled", None) for c in self.chunks]
        for c in self.chunks:  # reduce only on each chunk's last backward
            if hasattr(c, "sync_enabled"):
                c.sync_enabled = False

    def restore(self):
        for c, s in zip(self.chunks, self._sync_states):
            if s is not None:
                c.sync_enabled = s

    def forward(self, chunk, input_tensor):
        if stage_timer is None:
            return self._forward(chunk, input_tensor)
        with stage_timer("F"):
            return self._forward(chunk, input_tensor)

    def backward(self, chunk, input_tensor, output_tensor, output_grad):
        if stage_timer is None:
            return self._backward(chunk, input_tensor, output_tensor, output_grad)
        with stage_timer("B"):
            return self._backward(chunk, input_tensor, output_tensor, output_grad)

    def _forward(self, chunk, input_tensor):
        ps.set_virtual_pipeline_model_parallel_rank(chunk)
        if input_tensor is not None:
            input_tensor.requires_grad_(not self.forward_only)
        model = self.chunks[chunk]
        getattr(model, "module", model).set_input_tensor(input_tensor)
        mb = self.next_mb[chunk]
        self.next_mb[chunk] += 1
        last_run["ops"].append(("F", chunk, mb))
        output, loss_func = self.func(self.iters[chunk], model)
        if ps.is_pipeline_last_stage():
            out = loss_func(output)
            loss, reported = out[0], out[-1]
            self.reported.append(reported)
            output = loss * (self.loss_scale if len(out) == 3 else self.loss_scale / self.divisor)
        if not self.forward_only:
            self.alive += 1
            last_run["max_alive"] = max(last_run["max_alive"], self.alive)
        return output

    def _backward(self, chunk, input_tensor, output_tensor, output_grad):
        ps.set_virtual_pipeline_model_parallel_rank(chunk)
        mb = self.bwd_mb[chunk]
        self.bwd_mb[chunk] += 1
        last_run["ops"].append(("B", chunk, mb))
        if mb == self.m - 1 and hasattr(self.chunks[chunk], "sync_enabled"):
            self.chunks[chunk].sync_enabled = True  # this chunk's buckets reduce during this backward
        if input_tensor is not None:
            input_tensor.retain_grad()
        if output_grad is None:  # the last stage's loss
            output_grad = torch.ones_like(output_tensor)
        # The output's storage may have been freed after sending (only its graph is
        # needed), so call the engine directly: it does not check the gradient's shape.
        torch.autograd.Variable._execution_engine.run_backward(
            (output_tensor,), (output_grad,), False, False, (), True, True)
        self.alive -= 1
        return None if input_tensor is None else input_tensor.grad


def _free_output(t):
    """Release an output's activation memory once sent; autograd keeps its graph."""
    if t is not None and t._base is None and not ps.is_pipeline_last_stage():
        t.data = torch.empty((1,), dtype=t.dtype, device=t.device)


def pipeline_tensor_shape(model_config, micro_batch_size):
    """What travels between stages: [seq (/CP) (/TP under SP), micro-batch, hidden]."""
    c, tp = model_config, ps.get_tensor_model_parallel_world_size()
    seq = c.seq_length // ps.get_context_parallel_world_size()
    seq = seq // tp if c.sequence_parallel and tp > 1 else seq
    return (seq, micro_batch_size, c.hidden_size)


def forward_backward_no_pipelining(forward_step_func, data_iterator, model, num_microbatches,
                                   forward_only=False, loss_scale=1.0, tensor_shape=None, dtype=None,
                                   loss_divisor=None):
    """All micro-batches on this single stage, forward then backward each."""
    run = _Run(forward_step_func, data_iterator, model, num_microbatches, forward_only, loss_scale, loss_divisor)
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
                                                     loss_divisor=None):
    """1F1B: warm-up = min(PP - stage - 1, M) forwards, then one forward / one backward,
    then the remaining backwards. Stage s holds at most PP - s micro-batches' activations."""
    pp, rank, m = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(), num_microbatches
    p2p = P2P(tensor_shape, dtype, ps.get_device())
    run = _Run(forward_step_func, data_iterator, model, m, forward_only, loss_scale, loss_divisor)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    warmup = min(pp - rank - 1, m)
    remaining = m - warmup
    inputs, outputs = [], []
    try:
        for _ in range(warmup):
            inp = None if first else p2p.recv_forward()
            out = run.forward(0, inp)
            if not last:
                p2p.send_forward(out)
            _free_output(out)
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
            _free_output(out)
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


def get_forward_backward_func():
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return forward_backward_no_pipelining
    if ps.get_virtual_pipeline_model_parallel_world_size() is not None:
        from megalite.pipeline.interleaved import forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving

