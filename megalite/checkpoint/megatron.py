"""Megatron-LM's `torch_dist` checkpoints, read: a `--save` directory as Megatron-LM writes it (tracker file,
iter_NNNNNNN/ with PyTorch DCP's .metadata and __R_I.distcp files, metadata.json, common.pt), at whatever TP / PP
it was saved, as global tensors under megalite's names, and the run's own numbers (iteration, consumed samples,
the LR schedule, Megatron's argparse namespace, from which the model's flags come).

Megatron-Core saves each tensor under its sharded key: layers stacked (`decoder.layers.self_attention.linear_qkv.
weight` with a leading layer axis over the whole model, whatever the pipeline split), norms under the fused
linear's name (`linear_qkv.layer_norm_weight`), SwiGLU's fc1 as [gate; up], and the query-group-interleaved QKV
rows megalite keeps too. The tables below (megatron_names.py) map them; DCP's chunks make each global tensor
whatever TP it was cut in. Every pickle is read by megalite/checkpoint/safe_pickle.py (nothing in the directory
runs); the tensors themselves by torch.load's weights-only reader."""

import io
import json
import os

import torch

from megalite.checkpoint import megatron_buckets
from megalite.checkpoint.megatron_expert_buckets import read_experts
from megalite.checkpoint.megatron_names import gpt_rows, unsupported
from megalite.checkpoint.safe_pickle import loads, torch_load
from megalite.checkpoint.storage import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_path(root):
    """(the newest iteration's directory of a Megatron-LM --save directory, its iteration or 'release'), or None
    when `root` is not one (no tracker, or the iteration's metadata.json is not a torch_dist one)."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    it = open(tracker).read().strip()
    path = os.path.join(root, "release" if it == "release" else f"iter_{int(it):07d}" if it.isdigit() else it)
    try:
        with open(os.path.join(path, "metadata.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("sharded_backend") != "torch_dist":
        return None
    return path, (it if it == "release" else int(it))


def _chained(o):
    """Whether an optimizer's common state is megatron-core's chain ({index: state}: an MoE model's dense and
    expert optimizers)."""
    return isinstance(o, dict) and bool(o) and all(isinstance(k, int) for k in o)


def is_megatron_checkpoint(root):
    return bool(root) and os.path.isdir(root) and iteration_path(root) is not None


class MegatronCheckpoint:
    """One Megatron-LM checkpoint: its DCP index, common state and global tensors."""

    def __init__(self, root):
        found = iteration_path(root)
        if found is None:
            raise CheckpointError(f"{root} is not a Megatron-LM torch_dist checkpoint directory (it needs {TRACKER} "
                                  "and iter_NNNNNNN/metadata.json with sharded_backend torch_dist)")
        self.path, self.iteration = found
        index = os.path.join(self.path, ".metadata")
        if not os.path.isfile(index):
            raise CheckpointError(f"{self.path} has no .metadata (an incomplete Megatron save?)")
        with open(index, "rb") as f:
            self.meta = loads(f.read(), index)
        self.items = getattr(self.meta, "state_dict_metadata", None)
        if not isinstance(self.items, dict):
            raise CheckpointError(f"{index} is not PyTorch DCP metadata")
        self.common = self._common()
        self.args = self.common.get("args")
        if self.args is None or not hasattr(self.args, "num_layers"):
            raise CheckpointError(f"{self.path} holds no Megatron arguments (common.pt's 'args'): the model's flags "
                                  "cannot be known")

    def _common(self):
        """common.pt (Megatron before July 2026), or the same keys as byte items of the DCP files (after)."""
        path = os.path.join(self.path, "common.pt")
        if os.path.isfile(path):
            with open(path, "rb") as f:
                common = torch_load(f.read(), path)
            if not isinstance(common, dict):
                raise CheckpointError(f"{path} is not a Megatron common state (a dict)")
            return common
        return {k: self.object(k) for k in ("args", "iteration", "checkpoint_version", "opt_param_scheduler")
                if k in self.items}

    def _read(self, fqn, offsets):
        from torch.distributed.checkpoint.metadata import MetadataIndex
        info = self.meta.storage_data.get(MetadataIndex(fqn, offsets))
        if info is None:
            raise CheckpointError(f"{self.path}: the index names {fqn!r} but no file holds it")
        if info.transform_descriptors:
            raise CheckpointError(f"{self.path}: {fqn!r} is stored transformed ({info.transform_descriptors}); "
                                  "megalite reads plain DCP items only")
        with open(os.path.join(self.path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            return f.read(info.length)

    def object(self, key):
        """A byte item (a ShardedObject, or common state in the newer layout), unpickled safely."""
        return torch_load(self._read(key, None), f"{self.path}/{key}")

    def has(self, key):
        return hasattr(self.items.get(key), "chunks")

    def stored(self, key):
        """The key a tensor is held under (a directory saved from the DDP-wrapped model says module.), or None."""
        return key if self.has(key) else ("module." + key if self.has("module." + key) else None)

    def tensor(self, key):
        """The global tensor `key`, assembled from its chunks."""
        md = self.items.get(key)
        if md is None or not hasattr(md, "chunks"):
            raise CheckpointError(f"{self.path} has no tensor {key!r}")
        out = torch.empty(md.size, dtype=md.properties.dtype)
        for c in md.chunks:
            t = torch.load(io.BytesIO(self._read(key, c.offsets)), map_location="cpu", weights_only=True)
            out[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))] = t.reshape(c.sizes)
        return out

    def consumed(self):
        """(consumed train samples, consumed valid samples) as Megatron's args recorded them."""
        return (int(getattr(self.args, "consumed_train_samples", 0) or 0),
                int(getattr(self.args, "consumed_valid_samples", 0) or 0))

    def _key(self, key):
        """Megatron-LM unwraps its model before saving; a directory saved from the DDP-wrapped one says module."""
        if key in self.items:
            return key
        if key.startswith("optimizer.state."):
            return key.replace("optimizer.state.", "optimizer.state.module.", 1)
        return "module." + key

    def _rows(self, cfg):
        why = unsupported(self.args)
        if why:
            raise CheckpointError(f"{self.path}: {why}")
        return gpt_rows(cfg, lambda k: self.has(k) or self.has("module." + k))

    def _cut(self, rows, prefix="", source=None):
        cache = {}
        for name, key, layer, to_megalite in rows:
            key = prefix + key if source is not None else self._key(prefix + key)
            if key not in cache:
                cache = {key: self.tensor(key) if source is None else source[key]}
            yield name, to_megalite(cache[key] if layer is None else cache[key][layer])

    def optimizer_format(self):
        """How Megatron saved its distributed optimizer's state (None: no optimizer state)."""
        o = self.common.get("optimizer")
        if _chained(o):
            kinds = {v.get("param_state_sharding_type", "legacy") for v in o.values() if isinstance(v, dict)}
            return kinds.pop() if len(kinds) == 1 else "mixed"
        return o.get("param_state_sharding_type", "legacy") if isinstance(o, dict) else None

    def optimizer_common(self):
        """The optimizer's common state (its step count, loss scaler): the dense one of an MoE model's chain."""
        o = self.common.get("optimizer") or {}
        return o[min(o)] if _chained(o) else o

    def optimizer(self, cfg):
        """(Adam's step, [(megalite checkpoint name, tensor)]) of the optimizer state: exp_avg, exp_avg_sq and,
        for a bf16 / fp16 model, the fp32 main weights; from Megatron's fully_reshardable layout (a tensor per
        parameter in model space, cut like the weights) or its default dp_reshardable one (flat buckets per
        model-parallel rank: megatron_buckets.py turns them into the same tensors)."""
        fmt = self.optimizer_format()
        states = ["exp_avg", "exp_avg_sq"] + (["param"] if cfg["params_dtype"] != "float32" else [])
        rows = self._rows(cfg)
        if fmt == "dp_reshardable":
            found = megatron_buckets.chains(self)
            step, source = megatron_buckets.read(self, states, cfg["swiglu"], found)
            if "1" in found:  # (an MoE model's chained expert optimizer)
                source.update(read_experts(self, found["1"], states))
        elif fmt == "fully_reshardable":
            step, source = float(self.optimizer_common()["optimizer"]["param_groups"][0].get("step", 0)), None
        else:
            raise CheckpointError(f"{self.path}: its optimizer state is in Megatron's {fmt!r} layout, which megalite "
                                  "does not read; resave it with Megatron-LM's --dist-ckpt-optim-fully-reshardable, "
                                  "or load the weights only (--no-load-optim)")
        out = []
        for state in states:
            mine = "main_param" if state == "param" else state
            out += [(f"optimizer.{mine}.{n}", t) for n, t in self._cut(rows, f"optimizer.state.{state}.", source)]
        return step, out

    def weights(self, cfg):
        """(megalite name, global tensor) of every weight, for the megalite model config `cfg` (model_flags'),
        streamed: each stacked Megatron tensor is read once and cut into its layers."""
        yield from self._cut(self._rows(cfg))
