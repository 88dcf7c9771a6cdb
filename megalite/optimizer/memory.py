"""Bytes a rank keeps for training state, measured and by formula (ZeRO paper / Megatron).

Measured: the storage of every tensor the DP wrapper and the optimizer own (model
parameters, fp32 gradient buffers and shard accumulators, fp32 main parameters, Adam
states), each storage counted once; a released (resized-to-zero) buffer counts zero.
"""

import torch


def _tensors(model_chunks, optimizer):
    for m in model_chunks:
        yield from m.parameters()
        yield getattr(m, "grad_data", None)
        for b in getattr(m, "buckets", []):
            yield getattr(b, "data", None)
            yield getattr(b, "shard_acc", None)
            yield getattr(b, "param_shard", None)  # ZeRO-3: the parameters' shard (the full ones are freed)
    opt = optimizer.optimizer
    for g in opt.param_groups:
        yield from g["params"]
    for st in opt.state.values():
        yield from (v for v in st.values() if torch.is_tensor(v))


def training_state_bytes(model_chunks, optimizer):
    seen, total = set(), 0
    for t in _tensors(model_chunks, optimizer):
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def expected_bytes_per_param(kind, d, param_bytes):
    """kind: "plain", "zero1", "zero2" or "zero3"; d: DP size; param_bytes: 2 (bf16/fp16) or 4 (fp32).
    Adam keeps m and v in fp32 (8 bytes) plus fp32 main params for low-precision models."""
    opt = 8 + (4 if param_bytes < 4 else 0)
    if kind == "plain":
        return param_bytes + 4 + opt
    if kind == "zero1":
        return param_bytes + 4 + opt / d
    if kind == "zero2":
        return param_bytes + (4 + opt) / d
    if kind == "zero3":
        return (param_bytes + 4 + opt) / d
    raise ValueError(f"unknown optimizer kind {kind!r}; use plain, zero1, zero2 or zero3")


def state_bytes_by_place(model_chunks, optimizer):
    """(device bytes, host bytes) of the training state: the host part is what
    --optimizer-cpu-offload keeps in host memory (the host groups' fp32 main weights and Adam
    states, which training_state_bytes counts, and their gradient buffer), the device part the rest."""
    host_groups = [g for g in getattr(optimizer, "_flat", []) if g.grad is not None]
    stepped = sum(t.untyped_storage().nbytes() for g in host_groups for t in (g.main, *g.states.values()))
    grads = sum(g.grad.untyped_storage().nbytes() for g in host_groups)
    return training_state_bytes(model_chunks, optimizer) - stepped, stepped + grads
