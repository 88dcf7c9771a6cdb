"""What every schedule shares (schedules.py, interleaved.py): the run of one iteration's micro-batches over the
model chunks (forward, backward, loss collection and scaling, the DP reduction left to each chunk's last
backward) and the release of a sent output's memory.

A caller's ScheduleTrace (`trace`) records the call's operations (("F"|"B"|"W", chunk, micro-batch) in order; W:
a split backward's weight gradients, zero_bubble_run.py) and the most micro-batches whose activations were alive at
once (tests, benchmarks); a `timer` (kind "F" | "B" -> a context; megalite/pipeline/auto_layout.py's profiler) wraps
each forward and backward.
"""

import contextlib

import torch

from megalite import parallel_state as ps
from megalite.moe.aux_losses import set_aux_loss_scale



class ScheduleTrace:
    """One schedule call's operations and its most micro-batches alive at once (each call starts it again)."""

    def __init__(self):
        self.ops, self.max_alive = [], 0


class Run:
    """State shared by the schedules: the chunks, data, loss collection and bookkeeping."""

    def __init__(self, forward_step_func, data_iterator, model, num_microbatches, forward_only, loss_scale,
                 loss_divisor=None, trace=None, timer=None):
        self.chunks = model if isinstance(model, list) else [model]
        # whether each chunk is the model's last (virtual) stage: it computes the loss
        self.grid = ps.grid_of(self.chunks)
        self.last = [self.grid.last_stage() and i == len(self.chunks) - 1 for i in range(len(self.chunks))]
        its = data_iterator if isinstance(data_iterator, list) else [data_iterator] * len(self.chunks)
        self.iters, self.func = its, forward_step_func
        self.m, self.forward_only, self.loss_scale = num_microbatches, forward_only, loss_scale
        self.divisor = loss_divisor or num_microbatches
        # MoE auxiliary losses enter the backward scaled as the main loss (Megatron's MoEAuxLossAutoScaler)
        config = self.config_of(self.chunks)
        per_token = getattr(config, "calculate_per_token_loss", False)
        set_aux_loss_scale(self.chunks, loss_scale if per_token else loss_scale / self.divisor)
        self.reported, self.alive = [], 0
        self.next_mb = [0] * len(self.chunks)
        self.bwd_mb = [0] * len(self.chunks)
        self.wgrad_mb = [0] * len(self.chunks)  # a split backward's W's (zero-bubble schedules)
        self.kept = {}  # (chunk, mb) -> the weight gradients its B computed, accumulated at its W
        self._trained = {}  # chunk -> its parameters that take gradients (a split backward asks for them)
        self.trace, self.timer = trace, timer
        if trace is not None:
            trace.ops, trace.max_alive = [], 0
        self._sync_states = [getattr(c, "sync_enabled", None) for c in self.chunks]
        for c in self.chunks:  # reduce only on each chunk's last backward
            if hasattr(c, "sync_enabled"):
                c.sync_enabled = False

    @staticmethod
    def config_of(chunks):
        """The model configuration of a rank's chunks (None for a model without one)."""
        return getattr(getattr(chunks[0], "module", chunks[0]), "config", None)

    def restore(self):
        for c, s in zip(self.chunks, self._sync_states):
            if s is not None:
                c.sync_enabled = s

    def forward(self, chunk, input_tensor):
        with self._timed("F"):
            return self._forward(chunk, input_tensor)

    def backward(self, chunk, input_tensor, output_tensor, output_grad):
        with self._timed("B"):
            return self._backward(chunk, input_tensor, output_tensor, output_grad)

    def _forward(self, chunk, input_tensor):
        if input_tensor is not None:
            input_tensor.requires_grad_(not self.forward_only)
        model = self.chunks[chunk]
        getattr(model, "module", model).set_input_tensor(input_tensor)
        mb = self.next_mb[chunk]
        self.next_mb[chunk] += 1
        if self.trace is not None:
            self.trace.ops.append(("F", chunk, mb))
        output, loss_func = self.func(self.iters[chunk], model)
        if self.last[chunk]:
            out = loss_func(output)
            loss, reported = out[0], out[-1]
            self.reported.append(reported)
            output = loss * (self.loss_scale if len(out) == 3 else self.loss_scale / self.divisor)
        if not self.forward_only:
            self.alive += 1
            if self.trace is not None:
                self.trace.max_alive = max(self.trace.max_alive, self.alive)
        return output

    def _backward(self, chunk, input_tensor, output_tensor, output_grad):
        mb = self.bwd_mb[chunk]
        self.bwd_mb[chunk] += 1
        if self.trace is not None:
            self.trace.ops.append(("B", chunk, mb))
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

    def backward_input(self, chunk, input_tensor, output_tensor, output_grad, store, w_next=False):
        """B of a split backward: the input gradient, returned; the weight gradients it computes at once (norms,
        biases, embeddings) are kept and those the linear layers defer go to `store` (pipeline/wgrad.py), all
        accumulated by this micro-batch's W (backward_weight), so the DP hooks fire there. w_next: that W is the
        plan's next action (the deferred GEMMs run within this pass: store.collecting's `now`)."""
        mb = self.bwd_mb[chunk]
        self.bwd_mb[chunk] += 1
        if self.trace is not None:
            self.trace.ops.append(("B", chunk, mb))
        if chunk not in self._trained:
            self._trained[chunk] = tuple(p for p in self.chunks[chunk].parameters() if p.requires_grad)
        params = self._trained[chunk]
        given = () if input_tensor is None else (input_tensor,)
        if output_grad is None:  # the last stage's loss
            output_grad = torch.ones_like(output_tensor)
        units = getattr(self.chunks[chunk], "units", None)  # (ZeRO-3: freed as the backward passes them)
        with store.collecting((chunk, mb), now=w_next), self._timed("B"), \
                units.split_backward() if units is not None else contextlib.nullcontext():
            grads = torch.autograd.Variable._execution_engine.run_backward(  # (the engine, as _backward's)
                (output_tensor,), (output_grad,), False, False, given + params, True, False)
        self.kept[(chunk, mb)] = [(p, g) for p, g in zip(params, grads[len(given):]) if g is not None]
        return grads[0] if given else None

    def backward_weight(self, chunk, store):
        """W: the weight gradients of this chunk's next micro-batch whose B has run, accumulated (the DP reduction
        enabled for the last one's, as _backward enables it for the last backward)."""
        mb = self.wgrad_mb[chunk]
        self.wgrad_mb[chunk] += 1
        if self.trace is not None:
            self.trace.ops.append(("W", chunk, mb))
        if mb == self.m - 1 and hasattr(self.chunks[chunk], "sync_enabled"):
            self.chunks[chunk].sync_enabled = True
        with self._timed("B"):
            summed = {}  # one accumulation per parameter (a tied weight's two uses summed first, as autograd does)
            for p, g in self.kept.pop((chunk, mb)) + store.run((chunk, mb)):
                summed[p] = g if p not in summed else summed[p] + g
            if summed:
                torch.autograd.backward(list(summed), list(summed.values()))
        self.alive -= 1

    def _timed(self, kind):
        return contextlib.nullcontext() if self.timer is None else self.timer(kind)


def free_output(t, last=False):
    """Release an output's activation memory once sent (not the last stage's: the loss); autograd keeps its graph."""
    if t is not None and t._base is None and not last:
        t.data = torch.empty((1,), dtype=t.dtype, device=t.device)
