"""Megatron's --check-weight-hash-across-dp-replicas-interval: data-parallel replicas must hold
bit-identical weights after every step. Each rank hashes its parameters (SHA-256 of their bytes,
as Megatron does) and the hashes are all-gathered over the DP group, so every rank learns the
same answer from the same collective and they stop together (a skipped reduction, a faulty
device or link shows here before it spreads)."""

import hashlib

import torch
import torch.distributed as dist

from megalite import parallel_state as ps


def weight_hashes(chunks):
    """(names, int64 tensor of the first 8 bytes of each parameter's SHA-256), this rank."""
    names, digests = [], []
    for chunk in chunks:
        for name, p in getattr(chunk, "module", chunk).named_parameters():
            raw = p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
            names.append(name)
            digests.append(int.from_bytes(hashlib.sha256(raw).digest()[:8], "little", signed=True))
    return names, torch.tensor(digests, dtype=torch.int64, device=ps.get_device())


def dp_replicas_differ(chunks):
    """Names of the parameters whose bits differ between DP replicas ([] when they agree), the
    same list on every rank. Pending ZeRO all-gathers (--overlap-param-gather) finish first."""
    if ps.get_data_parallel_world_size() == 1:
        return []
    for chunk in chunks:
        if hasattr(chunk, "finish_param_sync"):
            chunk.finish_param_sync()
    names, mine = weight_hashes(chunks)
    every = [torch.empty_like(mine) for _ in range(ps.get_data_parallel_world_size())]
    dist.all_gather(every, mine, group=ps.get_data_parallel_group())
    stacked = torch.stack(every)
    differ = (stacked != stacked[:1]).any(dim=0).tolist()
    return [n for n, d in zip(names, differ) if d]
