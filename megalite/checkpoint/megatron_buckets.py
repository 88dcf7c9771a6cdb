"""Megatron-LM's default optimizer layout (`dp_reshardable`: what its torch_dist saves hold unless
--dist-ckpt-optim-fully-reshardable), read back into one global tensor per parameter and state.

Megatron's distributed optimizer keeps, for each model-parallel rank (`dp_group_idx` = tp_rank + TP x pp_rank), one
flat tensor per grad buffer, bucket and state (the fp32 main `param`, `exp_avg`, `exp_avg_sq`), laid out as its
DDP lays the grad buffer out: the rank's parameters in reverse registration order, each start padded to 64
elements, each bucket closed where Megatron closed it (its sizes are recorded: per_bucket_numel_unpadded). The
registration order is the layer spec's, and the local spec's differs from Transformer Engine's (the layer norms
modules of their own, or fused into the next linear layer). Both are replayed, and only an order under which every
parameter's fp32 main weights equal the weights the same checkpoint holds (rounded to the model's dtype) is used;
when neither holds, one line says so and nothing is guessed."""

import math
import re

import torch

from megalite.checkpoint.storage import CheckpointError

# (an MoE model's optimizer is megatron-core's chain of two: chained_0 the dense parameters', chained_1 the experts')
_BUCKET = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                     r"\.bucket_idx_(\d+)\.(\w+)$")
_NORM = ("layer_norm_weight", "layer_norm_bias")
# a layer's parameters in registration order (megatron-core's TransformerLayer: input norm, attention - whose
# output projection its base class builds before the QKV - pre-MLP norm, MLP), under the checkpoint's names
_ATTN = ["self_attention.linear_proj.weight", "self_attention.linear_proj.bias"]
_QKV = ["self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"]
_QK_NORMS = ["self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
             "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias"]
_FC = ["mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"]
# an MoE layer's dense parameters (its experts are in the experts' buffers: megatron_expert_buckets.py): the
# router, then the shared experts; its pre-MLP norm a module of its own under TE (nothing to fuse it into)
_MOE = ["mlp.router.weight", "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight",
        "mlp.shared_experts.gate_weight"]
_IN_NORM = [f"self_attention.linear_qkv.{n}" for n in _NORM]
_MLP_NORM = [f"mlp.linear_fc1.{n}" for n in _NORM] + ["pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias"]
ORDERS = {  # the local spec: norms are modules of their own; Transformer Engine's: fused, first in their linear
    "local": _IN_NORM + _ATTN + _QKV + _QK_NORMS + _MLP_NORM + _FC + _MOE,
    "transformer_engine": _ATTN + _IN_NORM + _QKV + _QK_NORMS + _MLP_NORM + _FC + _MOE,
}
_COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight",
           "mlp.linear_fc1.bias", "embedding.word_embeddings.weight", "output_layer.weight",
           "mlp.shared_experts.linear_fc1.weight")
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight", "mlp.shared_experts.linear_fc2.weight")


def read(ckpt, states, swiglu, found=None):
    """(Adam's step, {f"optimizer.state.{state}.{key}": global tensor}) for the dense model keys of `ckpt` (a
    MegatronCheckpoint), from its dp_reshardable buckets (found: chains(ckpt), where the caller has it)."""
    a = ckpt.args
    tp, pp = int(a.tensor_model_parallel_size), int(a.pipeline_model_parallel_size)
    if getattr(a, "virtual_pipeline_model_parallel_size", None) or getattr(a, "num_layers_per_virtual_pipeline_stage",
                                                                           None):
        raise CheckpointError(f"{ckpt.path}: an interleaved pipeline's optimizer state in Megatron's dp_reshardable "
                              "layout is not read yet; load the weights only (--no-load-optim)")
    found = chains(ckpt) if found is None else found
    domains = found.get(None) or found.get("0") or {}  # (an MoE model's experts: megatron_expert_buckets.py)
    if sorted(domains) != list(range(tp * pp)):
        raise CheckpointError(f"{ckpt.path}: its dp_reshardable optimizer state has model-parallel groups "
                              f"{sorted(domains)}, not the {tp * pp} of TP {tp} x PP {pp}")
    out, step = {}, None
    for idx, d in sorted(domains.items()):
        t, p = idx % tp, idx // tp
        flat = flat_buffers(ckpt, f"model-parallel rank {idx}", d, states)
        rows, places = _placed(ckpt, _params(ckpt, p, pp), d, flat["param"], t, tp, swiglu)
        for (store, read_key, layer, tied), (b, start) in zip(rows, places):
            if tied or not _writes(store, t):
                continue
            shape = ckpt.items[read_key].size
            for s in states:
                g = out.setdefault(f"optimizer.state.{s}.{store}", torch.zeros(tuple(shape), dtype=torch.float32))
                whole = g if layer is None else g[layer]
                local = _local_index(store, whole.shape, t, tp, swiglu)
                part = _local_shape(store, whole.shape, tp)
                values = flat[s][b][start:start + math.prod(part)].view(part)
                _put(whole, local, values)
        step = d["step"] if step is None else step
    return step, out


def flat_buffers(ckpt, who, d, states):
    """{state: [its flat tensor per bucket]} of one domain (`who` names it), whose parameters share one grad buffer
    (several, for mixed dtypes, are not read yet)."""
    if len(d["buckets"]) != 1:
        raise CheckpointError(f"{ckpt.path}: {who} has {len(d['buckets'])} grad buffers (mixed dtypes), which megalite "
                              "does not read yet; load with --no-load-optim")
    (_, buckets), = d["buckets"].items()
    return {s: [ckpt.tensor(buckets[b][s]) for b in sorted(buckets)] for s in set(states) | {"param"}}


def chains(ckpt):
    """{chain (None, or megatron-core's chained optimizer index): {dp_group_idx: {"buckets": {(gbuf, dtype): {bucket:
    {state: key}}}, "sizes": [...], "step": Adam's step}}}."""
    found = {}
    for key in ckpt.items:
        m = _BUCKET.match(key)
        if m:
            chain, idx, gbuf, dtype, bucket, state = m.groups()
            d = found.setdefault(chain, {}).setdefault(int(idx), {"buckets": {}})
            d["buckets"].setdefault((int(gbuf), dtype), {}).setdefault(int(bucket), {})[state] = key
    for chain, domains in found.items():
        for idx, d in domains.items():
            _sizes_and_step(ckpt, d, (f"chained_{chain}." if chain is not None else "")
                            + f"optimizer.distributed.dp_group_idx_{idx}")
    return found


def _sizes_and_step(ckpt, d, base):
    sizes = ckpt.object(f"{base}.per_bucket_numel_unpadded/shard_0_1")
    d["sizes"] = [n for per_gbuf in sizes[0] for per_dtype in per_gbuf.values() for n in per_dtype] \
        if isinstance(sizes, list) and sizes and isinstance(sizes[0], list) else None
    groups = ckpt.object(f"{base}.optimizer/shard_0_1")
    try:
        d["step"] = float(groups[0]["param_groups"][0]["step"])
    except (TypeError, KeyError, IndexError):
        raise CheckpointError(f"{ckpt.path}: {base}.optimizer holds no Adam step") from None
    if d["sizes"] is None:
        raise CheckpointError(f"{ckpt.path}: {base}.per_bucket_numel_unpadded is not Megatron's bucket record")


def _layers_of(a, p, pp):
    """The global layer indices pipeline stage p of pp holds (uniform, or Megatron's uneven first / last)."""
    n = int(a.num_layers)
    first = getattr(a, "decoder_first_pipeline_num_layers", None)
    last = getattr(a, "decoder_last_pipeline_num_layers", None)
    counts = [None] * pp
    if pp > 1 and first is not None:
        counts[0] = int(first)
    if pp > 1 and last is not None:
        counts[-1] = int(last)
    rest = n - sum(c for c in counts if c is not None)
    free = sum(c is None for c in counts)
    counts = [c if c is not None else rest // free for c in counts]
    if sum(counts) != n:
        raise CheckpointError(f"--num-layers {n} does not split over {pp} pipeline stages as the checkpoint's args say")
    start = sum(counts[:p])
    return range(start, start + counts[p])


def _params(ckpt, p, pp):
    """Pipeline stage p's parameters in registration order under each spec: {spec: [(store key, read key, layer or
    None, size placeholder)]}; the store key drops a DDP wrapper's `module.`."""
    found = ckpt.stored
    specs = {}
    for spec, order in ORDERS.items():
        rows = []
        if p == 0:
            rows += [(k, found(k), None) for k in ("embedding.word_embeddings.weight",
                                                   "embedding.position_embeddings.weight") if found(k)]
        for i in _layers_of(ckpt.args, p, pp):
            for suffix in order:
                stacked, single = found(f"decoder.layers.{suffix}"), found(f"decoder.layers.{i}.{suffix}")
                if stacked:
                    rows.append((f"decoder.layers.{suffix}", stacked, i))
                elif single:
                    rows.append((f"decoder.layers.{i}.{suffix}", single, None))
        if p == pp - 1:
            rows += [(k, found(k), None) for k in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias",
                                                   "output_layer.weight") if found(k)]
            if pp > 1 and not found("output_layer.weight"):  # tied: the last stage's copy of the embedding
                rows.append(("embedding.word_embeddings.weight", found("embedding.word_embeddings.weight"), "tied"))
        specs[spec] = [(s, r, None if layer == "tied" else layer, layer == "tied") for s, r, layer in rows]
    return specs


def _writes(store, t):
    """Whether TP rank t's copy is the one written (a replicated parameter's state is TP rank 0's)."""
    return t == 0 or _suffix(store) in _COLUMN + _ROW


def _suffix(key):
    return re.sub(r"^decoder\.layers\.(\d+\.)?", "", key) if key.startswith("decoder.layers.") else key


def _local_shape(store, shape, tp):
    s, shape = _suffix(store), list(shape)
    if s in _COLUMN:
        shape[0] //= tp
    elif s in _ROW:
        shape[1] //= tp
    return shape


def _local_index(store, shape, t, tp, swiglu):
    """(axis, global indices along it) of TP rank t's shard (None: replicated). SwiGLU's fc1 is [gate; up] and a
    rank holds [its gate rows; its up rows]."""
    s = _suffix(store)
    if s in _ROW:
        n = shape[1] // tp
        return 1, torch.arange(t * n, (t + 1) * n)
    if s not in _COLUMN:
        return None
    n = shape[0] // tp
    if swiglu and (s.startswith("mlp.linear_fc1.") or s.startswith("mlp.shared_experts.linear_fc1.")):
        half, h = shape[0] // 2, n // 2
        return 0, torch.cat([torch.arange(t * h, (t + 1) * h), torch.arange(half + t * h, half + (t + 1) * h)])
    return 0, torch.arange(t * n, (t + 1) * n)


def _put(whole, local, values):
    if local is None:
        whole.copy_(values)
    else:
        whole.index_copy_(local[0], local[1], values)


def _get(whole, local):
    return whole if local is None else whole.index_select(local[0], local[1])


def _placed(ckpt, specs, d, param_flat, t, tp, swiglu):
    """(rows, each one's (bucket, start)) under the spec whose replayed layout puts every parameter's fp32 main
    weights where the checkpoint's weights are."""
    for rows in specs.values():
        sizes = [math.prod(_local_shape(store, ckpt.items[key].size[0 if layer is None else 1:], tp))
                 for store, key, layer, _ in rows]
        places = replay(sizes, d["sizes"])
        if places is not None and _holds(ckpt, rows, places, param_flat, t, tp, swiglu):
            return rows, places
    raise CheckpointError(f"{ckpt.path}: its dp_reshardable optimizer state does not follow the parameter order of "
                          f"megatron-core's {' or '.join(specs)} layer spec (the fp32 main weights are not where that "
                          "order puts them); load the weights only (--no-load-optim)")


def replay(sizes, buckets):
    """Megatron's grad-buffer layout of parameters of these sizes (registration order) over buckets of these
    unpadded sizes: each parameter's (bucket, start in it), or None when they do not fit."""
    out, b, pos = [None] * len(sizes), 0, 0
    for i in reversed(range(len(sizes))):
        start = -(-pos // 64) * 64
        if pos and b < len(buckets) and start == buckets[b]:  # a bucket closed before this one (shared embedding)
            b, start = b + 1, 0
        if b >= len(buckets) or start + sizes[i] > buckets[b]:
            return None
        out[i], pos = (b, start), start + sizes[i]
        if pos == buckets[b]:
            b, pos = b + 1, 0
    return out if b == len(buckets) else None


def _holds(ckpt, rows, places, param_flat, t, tp, swiglu):
    cache = {}
    for (store, read_key, layer, _), (b, start) in zip(rows, places):
        if read_key not in cache:
            cache = {read_key: ckpt.tensor(read_key)}
        whole = cache[read_key] if layer is None else cache[read_key][layer]
        want = _get(whole, _local_index(store, whole.shape, t, tp, swiglu))
        got = param_flat[b][start:start + want.numel()]
        if got.numel() != want.numel() or not torch.equal(got.to(want.dtype), want.reshape(-1)):
            return False
    return True
