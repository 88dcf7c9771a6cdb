"""Interleaved 1F1B (Megatron's virtual pipeline): each stage holds v model chunks.

Micro-batches run in groups of G contiguous ones per virtual stage (Megatron's
--microbatch-group-size-per-virtual-pipeline-stage, default PP): virtual micro-batch k
(0 <= k < M v) runs on the chunk of entry k of the table [(group, chunk 0), (group, chunk 1),
... per group] (reversed for backward); each chunk takes its micro-batches in order. Warm-up
is (PP - stage - 1) 2 + (v - 1) G forwards, then one forward / one backward, then the
remaining backwards. The bubble shrinks from (PP-1)/(M+PP-1) to (PP-1)/(vM+PP-1), at the
price of v times more point-to-point messages. PP <= G <= M and the last group holds 0 or
at least PP micro-batches (microbatches.interleaving_problem).
"""

from megalite import parallel_state as ps
from megalite.batching.microbatches import interleaving_problem
from megalite.pipeline.p2p import P2P
from megalite.pipeline.run import Run, free_output


class _Plan:
    """The interleaved schedule's arithmetic on one rank: which chunk virtual step k runs, how many steps
    are warm-up, and what arrives after each step."""

    def __init__(self, m, v, pp, rank, group, first_stage, last_stage, forward_only):
        # Chunk of each virtual micro-batch: G micro-batches on chunk 0, the same on chunk 1, ... per group.
        self.table = [c for lo in range(0, m, group) for c in range(v) for _ in range(min(group, m - lo))]
        self.v, self.pp, self.first_stage, self.last_stage = v, pp, first_stage, last_stage
        self.total = m * v
        self.all_warmup = forward_only or m == pp
        self.warmup = self.total if self.all_warmup else min((pp - rank - 1) * 2 + (v - 1) * group, self.total)

    def chunk_id(self, k, forward):
        c = self.table[k % self.total]
        return c if forward else self.v - 1 - c

    def recv_plan(self, k, forward):
        """After virtual step k: whether a tensor arrives (forward: from the previous stage; backward:
        from the next) and for which chunk. The leading stage (first in forward, last in backward)
        is PP - 1 steps ahead of the stage that sends to it around the ring."""
        if self.first_stage if forward else self.last_stage:
            if k < self.pp - 1:
                return False, self.chunk_id(k + 1, forward)
            c = self.chunk_id(k - (self.pp - 1), forward)
            return c != (self.v - 1 if forward else 0), c + (1 if forward else -1)
        return True, self.chunk_id(k + 1, forward)


def forward_backward_pipelining_with_interleaving(forward_step_func, data_iterator, model, num_microbatches,
                                                  forward_only=False, loss_scale=1.0, tensor_shape=None, dtype=None,
                                                  loss_divisor=None, trace=None, timer=None):
    chunks = model if isinstance(model, list) else [model]
    grid = ps.grid_of(chunks)
    v, pp, m = len(chunks), grid.pp, num_microbatches
    config = getattr(chunks[0], "module", chunks[0]).config
    group = getattr(config, "microbatch_group_size_per_vp_stage", None)
    if why := interleaving_problem(m, pp, group):
        raise ValueError(f"{why}; change --global-batch-size or --micro-batch-size")
    first_stage, last_stage = grid.first_stage(), grid.last_stage()
    plan = _Plan(m, v, pp, grid.pp_rank, group or pp, first_stage, last_stage, forward_only)
    chunk_id, recv_plan, total, warmup, all_warmup = (plan.chunk_id, plan.recv_plan, plan.total, plan.warmup,
                                                      plan.all_warmup)
    remaining = total - warmup
    p2p = P2P(tensor_shape, dtype, ps.get_device(), grid)
    run = Run(forward_step_func, data_iterator, chunks, m, forward_only, loss_scale, loss_divisor, trace, timer)
    inputs = [[] for _ in range(v)]
    outputs = [[] for _ in range(v)]
    out_grads = [[] for _ in range(v)]

    def fwd(k):
        c = chunk_id(k, True)
        if first_stage and c == 0 and len(inputs[c]) == len(outputs[c]):
            inputs[c].append(None)  # the first chunk reads data, receives nothing
        # Inputs may arrive ahead of use (groups larger than PP): this micro-batch's is the one after
        # those whose forward ran and whose backward has not released them yet.
        out = run.forward(c, inputs[c][len(outputs[c])])
        outputs[c].append(out)
        return out

    def bwd(k):
        c = chunk_id(k, False)
        if last_stage and c == v - 1 and not out_grads[c]:
            out_grads[c].append(None)  # the loss has no incoming gradient
        return run.backward(c, inputs[c].pop(0), outputs[c].pop(0), out_grads[c].pop(0))

    try:
        inputs[0].append(None if first_stage else p2p.recv_forward())
        for k in range(warmup):
            out = fwd(k)
            c = chunk_id(k, True)
            recv_prev, nxt = recv_plan(k, True)
            recv_prev = recv_prev and k != total - 1
            send = None if (last_stage and c == v - 1) else out
            if k == warmup - 1 and not all_warmup:
                recv_next = not last_stage
                inp, g = p2p.communicate(send_next=send, recv_prev=recv_prev, recv_next=recv_next)
                if recv_next:
                    out_grads[v - 1].append(g)
            else:
                inp, _ = p2p.communicate(send_next=send, recv_prev=recv_prev)
            free_output(send)
            if recv_prev:
                inputs[nxt].append(inp)
        for i in range(remaining):
            fk, bk = i + warmup, i
            out = fwd(fk)
            in_grad = bwd(bk)
            fc, bc = chunk_id(fk, True), chunk_id(bk, False)
            send_out = None if (last_stage and fc == v - 1) else out
            send_grad = None if (first_stage and bc == 0) else in_grad
            recv_prev, nf = recv_plan(fk, True)
            recv_next, nb = recv_plan(bk, False)
            if i == remaining - 1:
                recv_prev = False
            inp, g = p2p.communicate(send_next=send_out, send_prev=send_grad, recv_prev=recv_prev,
                                     recv_next=recv_next)
            free_output(send_out)
            if recv_prev:
                inputs[nf].append(inp)
            if recv_next:
                out_grads[nb].append(g)
        if not forward_only:
            if all_warmup:
                out_grads[v - 1].append(None if last_stage else p2p.recv_backward())
            for k in range(remaining, total):
                in_grad = bwd(k)
                bc = chunk_id(k, False)
                recv_next, nb = recv_plan(k, False)
                recv_next = recv_next and k != total - 1
                send_grad = None if (first_stage and bc == 0) else in_grad
                _, g = p2p.communicate(send_prev=send_grad, recv_next=recv_next)
                if recv_next:
                    out_grads[nb].append(g)
    finally:
        run.restore()
    return run.reported
