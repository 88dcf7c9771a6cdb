"""Megatron-LM's default optimizer layout (dp_reshardable) for an MoE model's experts, read back into one global
tensor per expert weight and state (megatron_buckets.py reads the dense parameters').

megatron-core chains two distributed optimizers for an MoE model: `chained_0` over the dense parameters (one
domain per model-parallel rank), `chained_1` over the experts' (one domain per expert model-parallel rank,
dp_group_idx = ETP rank + ETP x (EP rank + EP x PP rank), megatron-core's tp-ep-pp order). An expert domain's
buffer holds that EP rank's local experts of that stage's MoE layers in registration order (layer by layer,
expert by expert, each expert's fc1 then fc2, weight then bias), laid out by the same replay as the dense buffers
(reverse order, starts padded to 64 elements, the recorded bucket sizes). As for the dense part, the layout is
used only when every expert's fp32 main weights sit exactly where the checkpoint's own weights say; else one line.
Experts cut by expert tensor parallelism (ETP > 1) are not read yet (one line)."""

import math

import torch

from megalite.checkpoint.megatron_buckets import _layers_of, flat_buffers, replay
from megalite.checkpoint.storage import CheckpointError

_SUFFIXES = ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")


def read_experts(ckpt, domains, states):
    """{f"optimizer.state.{state}.{key}": global tensor} of the experts' weights of `ckpt` (a MegatronCheckpoint),
    from its chained_1 dp_reshardable domains."""
    a = ckpt.args
    pp = int(a.pipeline_model_parallel_size)
    etp = int(getattr(a, "expert_tensor_parallel_size", None) or 1)
    if etp != 1:
        raise CheckpointError(f"{ckpt.path}: experts cut by --expert-tensor-parallel-size {etp}: their optimizer state "
                              "in Megatron's dp_reshardable layout is not read yet; load with --no-load-optim")
    ep = int(getattr(a, "expert_model_parallel_size", None) or len(domains) // pp)
    experts = int(getattr(a, "num_experts", None) or 0)
    if not experts or experts % ep or sorted(domains) != list(range(ep * pp)):
        raise CheckpointError(f"{ckpt.path}: its experts' optimizer state has expert model-parallel groups "
                              f"{sorted(domains)}, not the {ep * pp} of EP {ep} x PP {pp} for {experts} experts")
    local, out = experts // ep, {}
    for idx, d in sorted(domains.items()):
        rank, p = idx % ep, idx // ep
        flat = flat_buffers(ckpt, f"expert model-parallel rank {idx}", d, states)
        rows = _rows(ckpt, p, pp, rank * local, local)
        places = replay([math.prod(ckpt.items[key].size[len(at):]) for _, key, at in rows], d["sizes"])
        if places is None or not _holds(ckpt, rows, places, flat["param"]):
            raise CheckpointError(f"{ckpt.path}: its experts' dp_reshardable optimizer state (expert model-parallel "
                                  f"rank {idx}) does not follow megatron-core's expert order (layer, expert, fc1, "
                                  "fc2); load the weights only (--no-load-optim)")
        for (store, key, at), (b, start) in zip(rows, places):
            shape = tuple(ckpt.items[key].size)
            for s in states:
                g = out.setdefault(f"optimizer.state.{s}.{store}", torch.zeros(shape, dtype=torch.float32))
                part = shape[len(at):]
                g[at] = flat[s][b][start:start + math.prod(part)].view(part)
    return out


def _rows(ckpt, p, pp, first, local):
    """[(store key, read key, index of this expert in it)] of stage p's local experts first.. in registration order;
    the store key drops a DDP wrapper's `module.`."""
    found, rows = ckpt.stored, []
    for i in _layers_of(ckpt.args, p, pp):
        for e in range(first, first + local):
            for suffix in _SUFFIXES:
                stacked, single = (found(f"decoder.layers.{x}mlp.experts.experts.{suffix}") for x in ("", f"{i}."))
                if stacked:
                    rows.append((f"decoder.layers.mlp.experts.experts.{suffix}", stacked, (i, e)))
                elif single:
                    rows.append((f"decoder.layers.{i}.mlp.experts.experts.{suffix}", single, (e,)))
    return rows


def _holds(ckpt, rows, places, param_flat):
    cache = {}
    for (_, key, at), (b, start) in zip(rows, places):
        if key not in cache:
            cache = {key: ckpt.tensor(key)}
        want = cache[key][at].reshape(-1)
        got = param_flat[b][start:start + want.numel()]
        if got.numel() != want.numel() or not torch.equal(got.to(want.dtype), want):
            return False
    return True
