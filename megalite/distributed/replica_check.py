"""Replicas must hold bit-identical weights after every step: Megatron's
--check-weight-hash-across-dp-replicas-interval (every weight over its data-parallel replicas)
and --test-mode (also the weights every TP rank holds whole, norms and q/k norms among them).
Under ZeRO-3 no DP rank repeats another's shard: only the TP comparison of shards applies.
Each rank hashes its parameters (SHA-256 of their bytes, as Megatron does) and the hashes are
all-gathered over the group, so every rank learns the same answer from the same collective and
they stop together (a skipped reduction, a faulty device or link shows here before it spreads)."""

import hashlib

import torch
import torch.distributed as dist

from megalite import parallel_state as ps
from megalite.distributed.param_facts import is_expert


def _weights(chunk):
    """(name, tensor, param, replicated over DP): ZeRO-3 holds only its shards of the sharded
    parameters (no DP replica to compare; TP ranks hold the same ranges of the TP-replicated ones)."""
    pieces, in_buckets = {}, set()
    if getattr(chunk, "units", None) is not None:
        for b in chunk.buckets:
            in_buckets.update(b.params)
            for pc in b.pieces:
                pieces.setdefault(pc.param, []).append(pc)
    for name, p in getattr(chunk, "module", chunk).named_parameters():
        if p in in_buckets:  # sharded: this rank's pieces (none if it owns no element of p)
            for pc in pieces.get(p, []):
                yield f"{name}[{pc.start}:{pc.end}]", pc.data, p, False
        else:
            yield name, p.detach(), p, True


def weight_hashes(chunks, values=None):
    """{name: (first 8 bytes of the parameter's SHA-256 as an int64, whether every TP rank holds it whole, whether
    DP ranks hold it whole, whether it is an expert's)} of this rank's parameters; each is hashed once.
    values: {param: the tensor to hash instead} (replicas of different precisions: the fp32 main weights)."""
    out = {}
    for chunk in chunks:
        for name, t, p, dp_replicated in _weights(chunk):
            t = (values or {}).get(p, t)
            raw = t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
            digest = int.from_bytes(hashlib.sha256(raw).digest()[:8], "little", signed=True)
            out[name] = (digest, not getattr(p, "tensor_model_parallel", False), dp_replicated, is_expert(p))
    return out


def _differ(hashes, names, group, size):
    mine = torch.tensor([hashes[n][0] for n in names], dtype=torch.int64, device=ps.get_device())
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    stacked = torch.stack(every)
    return [n for n, d in zip(names, (stacked != stacked[:1]).any(dim=0).tolist()) if d]


def replicas_differ(chunks, tp_too=False, across_replicas=False, values=None):
    """Names of the parameters whose bits differ between DP replicas ([] when they agree), the
    same list on every rank; tp_too: also the TP-replicated ones between TP ranks. Pending ZeRO
    all-gathers (--overlap-param-gather) finish first. across_replicas (after a semi-synchronous
    outer step): every weight this rank holds against its counterparts in the other replicas. values: see
    weight_hashes."""
    for chunk in chunks:
        if hasattr(chunk, "finish_param_sync"):
            chunk.finish_param_sync()
    hashes, out, g = weight_hashes(chunks, values), [], ps.grid_of(chunks)
    if across_replicas:
        differ = _differ(hashes, list(hashes), g.replica_group, g.replicas) if g.replicas > 1 else []
        return [f"{n} (over replicas)" for n in differ]
    groups = ((False,) + g.dp_cp()[:2],  # CP ranks are replicas too
              (True,) + g.expert_dp()[:2])
    for expert, group, size in groups:  # experts: their expert-DP replicas (param_facts)
        if size > 1 and (not expert or g.experts):
            out += _differ(hashes, [n for n, h in hashes.items() if h[2] and h[3] == expert], group, size)
    if tp_too and g.tp > 1:
        whole = [n for n, (_, tp_replicated, _, _) in hashes.items() if tp_replicated]
        out += [f"{n} (over TP)" for n in _differ(hashes, whole, g.tp_group, g.tp)]
    return out
