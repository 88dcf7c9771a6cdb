"""A pipeline plan run (zero_bubble.py's: per rank its F / B / W actions): each F receives its input from the
previous stage and sends its output on, each B receives its output's gradient from the next stage and sends its
input's back (the input gradient only: the split backward, run.py's backward_input), each W accumulates a
micro-batch's weight gradients (backward_weight: the DP reduction fires at the last one, not at its B). Sends are
posted at once and waited for at the end, receives when an action needs them, in the order the plan's checker
proved the senders send them."""

import torch.distributed as dist

from megalite import parallel_state as ps
from megalite.pipeline.p2p import ACTIVATION_TAG, GRADIENT_TAG, P2P
from megalite.pipeline.run import Run, free_output
from megalite.pipeline.wgrad import WeightGradStore
from megalite.pipeline.zero_bubble import B, F, make_plan


class _Messages(P2P):
    """P2P's messages (one shape and dtype, its tags), each to or from any stage: sends posted at once and
    finished at the end (a plan's rank runs on past them), receives waited for when an action needs them."""

    def __init__(self, shape, dtype, grid):
        super().__init__(shape, dtype, ps.get_device(), grid)
        self.ranks, self.sends = list(grid.pp_ranks), []

    def send(self, t, stage, tag):
        t = self._check(t)  # (kept until its send completes)
        self.sends.append((dist.isend(t, dst=self.ranks[stage], group=self.group, tag=tag), t))

    def recv(self, stage, tag):
        t = self._empty()
        dist.irecv(t, src=self.ranks[stage], group=self.group, tag=tag).wait()
        return t

    def finish(self):
        for work, _ in self.sends:
            work.wait()
        self.sends = []


def forward_backward_with_plan(schedule, forward_step_func, data_iterator, model, num_microbatches,
                               loss_scale=1.0, tensor_shape=None, dtype=None, loss_divisor=None, trace=None,
                               timer=None):
    """One iteration's micro-batches by `schedule`'s plan (zb-h1; one model chunk per rank); returns what the loss
    function reported per micro-batch (last stage)."""
    run = Run(forward_step_func, data_iterator, model, num_microbatches, False, loss_scale, loss_divisor, trace,
              timer)
    g, m = run.grid, num_microbatches
    stage, last = g.pp_rank, g.pp - 1
    plan = make_plan(schedule, g.pp, m)
    store, messages = WeightGradStore(), _Messages(tensor_shape, dtype, g)
    store.attach(run.chunks)
    inputs, outputs = {}, {}
    try:
        for a in plan.actions[stage]:
            if a.op == F:
                inp = None if stage == 0 else messages.recv(stage - 1, ACTIVATION_TAG)
                out = run.forward(a.chunk, inp)
                if stage < last:
                    messages.send(out, stage + 1, ACTIVATION_TAG)
                free_output(out, stage == last)
                inputs[a.mb], outputs[a.mb] = inp, out
            elif a.op == B:
                grad = None if stage == last else messages.recv(stage + 1, GRADIENT_TAG)
                in_grad = run.backward_input(a.chunk, inputs.pop(a.mb), outputs.pop(a.mb), grad, store)
                if stage > 0:
                    messages.send(in_grad, stage - 1, GRADIENT_TAG)
            else:
                run.backward_weight(a.chunk, store)
        messages.finish()
    finally:
        store.detach(run.chunks)
        run.restore()
    return run.reported
