"""What must happen to gradients after the DP reduction and before the optimizer step."""

import torch
import torch.distributed as dist

from megalite import parallel_state as ps
from megalite.distributed.collectives import broadcast_from_last_rank


def _grad(p):
    # Under ZeRO only the DP-owned shard of the gradient is reduced (and, at stage 2, kept):
    # the shard ranges agree across TP ranks and, for tied embeddings, across stages.
    if getattr(p, "main_grad_shard", None) is not None:
        return p.main_grad_shard
    return p.main_grad if getattr(p, "main_grad", None) is not None else p.grad


def allreduce_sequence_parallel_grads(params, grid):
    """Params applied to sequence-sharded activations (norms, row biases, position embeddings under SP) hold
    partial gradients on each TP rank: sum them over TP of `grid`."""
    g = grid
    if g.tp == 1:
        return
    grads = [_grad(p) for p in params if getattr(p, "sequence_parallel", False) and _grad(p) is not None]
    if not grads:
        return
    flat = dist_flatten(grads)
    dist.all_reduce(flat, group=g.tp_group)
    dist_unflatten(flat, grads)


def allreduce_embedding_grads(model_chunks):
    """A word embedding with copies on the first and last pipeline stages (tied to the output layer, or
    looked up by multi-token prediction on the last stage): sum their grads (the V: both copies are this rank's,
    in its two chunks, summed here; the loop: one on each of the embedding group's two ranks)."""
    g = ps.grid_of(model_chunks)
    if g.pp == 1 or g.rank not in g.emb_ranks:
        return
    grads = []
    for m in model_chunks:
        m = getattr(m, "module", m)
        if getattr(m, "shares_embedding_across_stages", False) and \
                (w := m.shared_embedding_or_output_weight()) is not None:
            grads.append(_grad(w))
    if not grads:
        return
    total = grads[0] if len(grads) == 1 else grads[0] + grads[1]
    if len(g.emb_ranks) > 1:
        dist.all_reduce(total, group=g.emb_group)
    for grad in grads:
        if grad is not total:
            grad.copy_(total)


def dist_flatten(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def dist_unflatten(flat, tensors):
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def finalize_model_grads(model_chunks):
    """DP sync (wait on the overlapped buckets), then the SP and embedding reductions."""
    params = []
    for m in model_chunks:
        if hasattr(m, "finish_grad_sync"):
            m.finish_grad_sync()
        params.extend(p for p in m.parameters() if p.requires_grad)
    allreduce_sequence_parallel_grads(params, ps.grid_of(model_chunks))
    allreduce_embedding_grads(model_chunks)
    update_expert_biases(model_chunks)


def update_expert_biases(model_chunks):
    """MoE routers with an expert bias (--moe-router-enable-expert-bias): their token counts of this
    step summed over the stage's TP x CP x DP ranks (every rank of a stage has the same routers), one
    all-reduce for all of them, then each router moves its bias (megalite/moe/router.py)."""
    routers = [m for c in model_chunks for m in c.modules() if getattr(m, "expert_bias", None) is not None]
    if not routers:
        return
    counts = torch.stack([r.local_tokens_per_expert if r.local_tokens_per_expert is not None
                          else torch.zeros(r.expert_bias.numel(), dtype=torch.int64, device=r.expert_bias.device)
                          for r in routers])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts, group=ps.grid_of(model_chunks).stage_dp_group())
    for r, c in zip(routers, counts):
        r.update_expert_bias(c)


def scale_grads_by_token_count(model_chunks, count):
    """--calculate-per-token-loss: the loss was summed over tokens; divide every gradient by the
    global batch's token count (summed over DP; the last pipeline stage counts, every rank needs
    it). The DP reduction divided by the chunks' grad_divisor (DP: averaged; 1 with uneven
    shares: summed), so the factor is that divisor / count. No host read."""
    count = count.reshape(1).float().clone()
    g = ps.grid_of(model_chunks)
    if g.dp > 1:
        dist.all_reduce(count, group=g.dp_group)
    broadcast_from_last_rank(count, g)
    grads = [_grad(p) for m in model_chunks for p in m.parameters() if p.requires_grad and _grad(p) is not None]
    if grads:
        divisor = getattr(model_chunks[0], "grad_divisor", g.dp)
        torch._foreach_mul_(grads, (divisor / count.clamp(min=1.0)).reshape(()))

