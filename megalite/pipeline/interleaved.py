"""Interleaved 1F1B (Megatron's virtual pipeline): each stage holds v model chunks.

Virtual micro-batch k (0 <= k < M v) runs on chunk (k mod PP v) div PP (reversed for
backward) with micro-batch (k div PP v) PP + k mod PP. Warm-up is (PP - stage - 1) 2 +
(v - 1) PP forwards, then one forward / one backward, then the remaining backwards. The
bubble shrinks from (PP-1)/(M+PP-1) to (PP-1)/(vM+PP-1), at the price of v times more
point-to-point messages. M must be a multiple of PP.
"""

from megalite import parallel_state as ps
from megalite.pipeline.p2p import P2P
from megalite.pipeline.schedules import _free_output, _Run


def forward_backward_pipelining_with_interleaving(forward_step_func, data_iterator, model, num_microbatches,
                                                  forward_only=False, loss_scale=1.0, tensor_shape=None, dtype=None,
                                                  loss_divisor=None):
    chunks = model if isinstance(model, list) else [model]
    v, pp, rank = len(chunks), ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    m = num_microbatches
    if m % pp:
        raise ValueError(f"interleaved pipelining needs the number of micro-batches ({m}) to be a multiple of "
                         f"--pipeline-model-parallel-size {pp}; change --global-batch-size or --micro-batch-size")
    p2p = P2P(tensor_shape, dtype, ps.get_device())
    run = _Run(forward_step_func, data_iterator, chunks, m, forward_only, loss_scale, loss_divisor)
    total = m * v
    all_warmup = forward_only or m == pp
    warmup = total if all_warmup else min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    remaining = total - warmup
    first_stage = ps.is_pipeline_first_stage(ignore_virtual=True)
    last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
    inputs = [[] for _ in range(v)]
    outputs = [[] for _ in range(v)]
    out_grads = [[] for _ in range(v)]

    def chunk_id(k, forward):
        c = (k % (pp * v)) // pp
        return c if forward else v - 1 - c

    def fwd(k):
        c = chunk_id(k, True)
        if first_stage and c == 0 and len(inputs[c]) == len(outputs[c]):
            inputs[c].append(None)  # the first chunk reads data, receives nothing
        out = run.forward(c, inputs[c][-1])
        outputs[c].append(out)
        return out

    def bwd(k):
        c = chunk_id(k, False)
        if last_stage and c == v - 1 and not out_grads[c]:
            out_grads[c].append(None)  # the loss has no incoming gradient
        return run.backward(c, inputs[c].pop(0), outputs[c].pop(0), out_grads[c].pop(0))

    try:
        ps.set_virtual_pipeline_model_parallel_rank(0)
        inputs[0].append(None if first_stage else p2p.recv_forward())
        for k in range(warmup):
            out = fwd(k)
            c = chunk_id(k, True)
            nxt = chunk_id(k + 1, True)
            recv_prev = not (first_stage and nxt == 0) and k != total - 1
            send = None if (last_stage and c == v - 1) else out
            if k == warmup - 1 and not all_warmup:
                recv_next = not last_stage
                inp, g = p2p.communicate(send_next=send, recv_prev=recv_prev, recv_next=recv_next)
                if recv_next:
                    out_grads[v - 1].append(g)
            else:
                inp, _ = p2p.communicate(send_next=send, recv_prev=recv_prev)
            _free_output(send)
            if recv_prev:
                inputs[nxt].append(inp)
        for i in range(remaining):
            fk, bk = i + warmup, i
            out = fwd(fk)
            in_grad = bwd(bk)
            fc, bc = chunk_id(fk, True), chunk_id(bk, False)
            send_out = None if (last_stage and fc == v - 1) else out
            send_grad = None if (first_stage and bc == 0) else in_grad
            recv_prev = True
            if first_stage:
                # The first stage is PP - 1 virtual micro-batches ahead of the last one.
                nf = chunk_id(fk - (pp - 1), True)
                recv_prev = nf != v - 1
                nf += 1
            else:
                nf = chunk_id(fk + 1, True)
            recv_next = True
            if last_stage:
                nb = chunk_id(bk - (pp - 1), False)
                recv_next = nb != 0
                nb -= 1
            else:
                nb = chunk_id(bk + 1, False)
            if i == remaining - 1:
                recv_prev = False
            inp, g = p2p.communicate(send_next=send_out, send_prev=send_grad, recv_prev=recv_prev,
                                     recv_next=recv_next)
            _free_output(send_out)
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
                nb = chunk_id(k + 1, False)
                recv_next = not (last_stage and nb == v - 1) and k != total - 1
                send_grad = None if (first_stage and bc == 0) else in_grad
                _, g = p2p.communicate(send_prev=send_grad, recv_next=recv_next)
                if recv_next:
                    out_grads[nb].append(g)
    finally:
        run.restore()
        ps.set_virtual_pipeline_model_parallel_rank(0)
    return run.reported
