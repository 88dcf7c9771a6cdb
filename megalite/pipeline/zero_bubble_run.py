"""A pipeline plan run (zero_bubble.py's: per rank its F / B / W actions, each of one model chunk): each F takes
its input from the stage before and hands its output to the stage after, each B takes its output's gradient
from the stage after and hands its input's back (the input gradient only: the split backward, run.py's
backward_input), each W accumulates a micro-batch's weight gradients (backward_weight: the DP reduction fires at
the last one, not at its B). Between two stages of one rank (the V's turning point) the tensor is handed over
as it is; to another rank it is sent, posted at once and waited for at the end. Receives are posted from each
peer in the order that peer sends (the plan says it), ahead of need where a later message is wanted first, so
that NCCL, which ignores tags, matches each to its send. Forward only (evaluation): the plan's F's alone."""

import torch.distributed as dist

from megalite import parallel_state as ps
from megalite.pipeline.p2p import ACTIVATION_TAG, GRADIENT_TAG, P2P
from megalite.pipeline.run import Run, free_output
from megalite.pipeline.wgrad import WeightGradStore
from megalite.pipeline.zero_bubble import B, F, W, Action, make_plan, messages

TAGS = {"activation": ACTIVATION_TAG, "gradient": GRADIENT_TAG}


class _Messages(P2P):
    """P2P's messages (one shape and dtype, its tags), each to or from any pipeline rank: sends posted at once and
    finished at the end (a plan's rank runs on past them); receives posted in each sender's order (`expected`:
    peer -> [(kind, stage, mb)] as it sends them to this rank) and waited for when an action needs them."""

    def __init__(self, shape, dtype, grid, expected):
        super().__init__(shape, dtype, ps.get_device(), grid)
        self.ranks, self.sends, self.expected = list(grid.pp_ranks), [], expected
        self.posted, self.pending = {peer: 0 for peer in expected}, {}

    def send(self, t, peer, kind):
        t = self._check(t)  # (kept until its send completes)
        self.sends.append((dist.isend(t, dst=self.ranks[peer], group=self.group, tag=TAGS[kind]), t))

    def recv(self, peer, key):
        order = self.expected[peer]
        while key not in self.pending:
            kind = order[self.posted[peer]][0]
            t = self._empty()
            self.pending[order[self.posted[peer]]] = (
                dist.irecv(t, src=self.ranks[peer], group=self.group, tag=TAGS[kind]), t)
            self.posted[peer] += 1
        work, t = self.pending.pop(key)
        work.wait()
        return t

    def finish(self):
        for work, _ in self.sends:
            work.wait()
        self.sends = []


class _Hand:
    """Where a stage's tensors come from and go to: the same rank's other chunk (handed over), or a peer."""

    def __init__(self, run, actions, st, tensor_shape, dtype):
        g = run.grid
        self.rank, self.st = g.pp_rank, st
        sent, _ = messages(actions, st)
        expected = {src: keys for (src, dst), keys in sent.items() if dst == self.rank}
        self.net, self.local = _Messages(tensor_shape, dtype, g, expected), {}

    def take(self, kind, stage, frm, mb):
        """The `kind` tensor for `stage` of micro-batch mb, from stage `frm`."""
        peer = self.st.holder(frm)[0]
        if peer == self.rank:
            return self.local.pop((kind, stage, mb))
        return self.net.recv(peer, (kind, stage, mb))

    def give(self, t, kind, stage, mb):
        """Hand `t` to `stage` (of micro-batch mb)."""
        peer = self.st.holder(stage)[0]
        if peer == self.rank:
            self.local[(kind, stage, mb)] = t.detach()  # (a leaf of the next chunk's graph, as a received one)
        else:
            self.net.send(t, peer, kind)


def forward_backward_with_plan(schedule, forward_step_func, data_iterator, model, num_microbatches,
                               forward_only=False, loss_scale=1.0, tensor_shape=None, dtype=None, loss_divisor=None,
                               trace=None, timer=None):
    """One iteration's micro-batches by `schedule`'s plan (zb-h1: one model chunk per rank; zbv, dualpipev: two,
    in a V; forward only, DualPipeV's needs no 2p micro-batches: ZB-V's forwards, the same stages);
    returns what the loss function reported per micro-batch (last stage)."""
    run = Run(forward_step_func, data_iterator, model, num_microbatches, forward_only, loss_scale, loss_divisor,
              trace, timer)
    g, m = run.grid, num_microbatches
    plan = make_plan("zbv" if forward_only and schedule == "dualpipev" else schedule, g.pp, m)  # (the same V)
    actions = [[a for a in acts if a.op == F or not forward_only] for acts in plan.actions]
    hand, st = _Hand(run, actions, plan.stages, tensor_shape, dtype), plan.stages
    store = WeightGradStore()
    store.attach(run.chunks)
    inputs, outputs = {}, {}
    try:
        mine = actions[g.pp_rank]
        for i, a in enumerate(mine):
            s = st.stage(g.pp_rank, a.chunk)
            if a.op == F:
                inp = None if s == 0 else hand.take("activation", s, s - 1, a.mb)
                out = run.forward(a.chunk, inp)
                if s < st.count - 1:
                    hand.give(out, "activation", s + 1, a.mb)
                free_output(out, s == st.count - 1)
                if not forward_only:
                    inputs[(a.chunk, a.mb)], outputs[(a.chunk, a.mb)] = inp, out
            elif a.op == B:
                grad = None if s == st.count - 1 else hand.take("gradient", s, s + 1, a.mb)
                key = (a.chunk, a.mb)
                w_next = i + 1 < len(mine) and mine[i + 1] == Action(W, a.chunk, a.mb)
                in_grad = run.backward_input(a.chunk, inputs.pop(key), outputs.pop(key), grad, store, w_next)
                if s > 0:
                    hand.give(in_grad, "gradient", s - 1, a.mb)
            else:
                run.backward_weight(a.chunk, store)
        hand.net.finish()
    finally:
        store.detach(run.chunks)
        run.restore()
    return run.reported
