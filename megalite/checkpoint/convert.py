"""Offline conversion, tensor by tensor: megalite <-> megalite (another TP/PP), Megatron-LM -> megalite (HF:
hf_convert.py, on this module's Reader and Writer).

Nothing here needs process groups. A megalite checkpoint is read one global tensor at a
time (assembled from its chunks), and written as the ranks of a TP x PP job would have
written it: one box per TP shard, in files per (TP, PP) rank, flushed whenever the buffered
tensors pass `flush_bytes`, so peak memory stays near the largest tensor plus that buffer.
"""

import json
import os
import re
import shutil

import torch

from megalite import __version__
from megalite.checkpoint.storage import (
    DTYPES,
    INDEX_FILE,
    INDEX_FORMAT,
    CheckpointError,
    fsync_write,
    open_safetensors,
    read_index,
    read_json,
)
from megalite.transformer.pipeline_layers import stage_layer_counts

META, TRACKER = "megalite.json", "latest_checkpointed_iteration.txt"
_LAYER = re.compile(r"(?:de|en)coder\.layers\.(\d+)\.")


def find_checkpoint(root):
    """(directory of the newest checkpoint under --load-dir, its metadata)."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        raise CheckpointError(f"{root} holds no {TRACKER}: not a megalite checkpoint directory")
    it = open(tracker).read().strip()
    path = os.path.join(root, "release" if it == "release" else f"iter_{int(it):07d}")
    meta = read_json(os.path.join(path, META), "checkpoint metadata")
    if meta.get("format") != "megalite-checkpoint":
        raise CheckpointError(f"{os.path.join(path, META)} is not a megalite checkpoint's metadata")
    return path, meta


class Reader:
    """Global tensors of one checkpoint directory, loaded on demand."""

    def __init__(self, path):
        self.path, self.index = path, read_index(path)

    def names(self):
        return list(self.index)

    def get(self, name):
        if name not in self.index:
            raise CheckpointError(f"the checkpoint has no tensor {name!r}")
        e = self.index[name]
        out = torch.empty(e["size"], dtype=DTYPES[e["dtype"]])
        for c in e["chunks"]:
            # Opened per chunk: a kept-open file stays mapped, and its read pages count as ours.
            with open_safetensors(os.path.join(self.path, c["file"])) as f:
                out[tuple(slice(o, o + n) for o, n in zip(c["offsets"], c["sizes"]))] = f.get_tensor(c["key"])
        return out


def _save_file(tensors, path):
    """safetensors' save_file writes tensor by tensor (no whole-file buffer), then fsync."""
    from safetensors.torch import save_file
    save_file(tensors, path, metadata={"format": "pt"})
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def padded_vocab(vocab, divisible_by, tp):
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


class Writer:
    """Writes a megalite checkpoint laid out for TP x PP ranks (DP 1), streaming."""

    def __init__(self, root, iteration, cfg, tp, pp, flush_bytes=256 << 20):
        self.root, self.iteration, self.cfg, self.tp, self.pp = root, iteration, cfg, tp, pp
        self.dir = os.path.join(root, "release" if iteration == "release" else f"iter_{iteration:07d}")
        self.tmp = self.dir + ".tmp"
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)
        self.flush_bytes, self.buffered, self.files, self.index = flush_bytes, 0, {}, {}
        self.buffers, self.pending = {}, {}  # rank -> {key: tensor}, rank -> [chunk entries]
        counts = stage_layer_counts(cfg["num_layers"], pp)
        self.stage_of_layer = [s for s, n in enumerate(counts) for _ in range(n)]
        ffn = [cfg[f] for f in ("ffn_hidden_size", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")
               if cfg.get(f)]
        if cfg["num_attention_heads"] % tp or cfg["num_query_groups"] % tp or any(n % tp for n in ffn):
            raise CheckpointError(f"--target-tensor-parallel-size {tp} does not divide the heads "
                                  f"({cfg['num_attention_heads']}), query groups ({cfg['num_query_groups']}) and "
                                  f"FFN sizes ({', '.join(map(str, ffn))})")

    def _stage(self, name):
        m = _LAYER.search(name)
        if m:
            return self.stage_of_layer[int(m.group(1))]
        return 0 if "embedding." in name else self.pp - 1

    def _split_dim(self, name, t):
        base = re.sub(r"^(replica\d+\.)?(optimizer|semi_sync)\.[a-z_]+\.", "", name)  # (a replica's state too)
        # MLA: q/kv up (and q) projections column-parallel; its down projections and latent norms replicated
        if base.endswith(("word_embeddings.weight", "output_layer.weight", "output_layer.bias", "linear_qkv.weight",
                          "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias", "linear_q_proj.weight",
                          "linear_q_up_proj.weight", "linear_kv_up_proj.weight", "eh_proj.weight")):
            return 1 if (self.cfg["swiglu"] and "linear_fc1" in base) else 0
        if base.endswith(("linear_proj.weight", "linear_fc2.weight")):
            return 1
        return None

    def add(self, name, t):
        t = t.contiguous()
        stage, dim = self._stage(name), self._split_dim(name, t)
        if dim is None:
            boxes = [(0, (0,) * t.dim(), t)]
        else:
            vocab = "word_embeddings" in name or "output_layer" in name
            n = padded_vocab(t.shape[0], self.cfg["make_vocab_size_divisible_by"], self.tp) if vocab else t.shape[dim]
            per, boxes = n // self.tp, []
            for r in range(self.tp):
                lo, hi = r * per, min((r + 1) * per, t.shape[dim])
                if hi > lo:
                    boxes.append((r, tuple(lo if d == dim else 0 for d in range(t.dim())),
                                  t.narrow(dim, lo, hi - lo).contiguous()))
        e = self.index.setdefault(name, {"dtype": str(t.dtype).replace("torch.", ""), "size": list(t.shape),
                                         "chunks": []})
        for r, offsets, box in boxes:
            rank = r + self.tp * stage
            key = f"{name}@{','.join(map(str, offsets))}"
            self.buffers.setdefault(rank, {})[key] = box
            e["chunks"].append({"offsets": list(offsets), "sizes": list(box.shape), "key": key})
            self.pending.setdefault(rank, []).append(e["chunks"][-1])
            self.buffered += box.numel() * box.element_size()
        if self.buffered >= self.flush_bytes:
            self._flush()

    def _flush(self):
        for rank, tensors in self.buffers.items():
            k = self.files.get(rank, 0)
            name = f"__{rank}_{k}.safetensors"
            _save_file(tensors, os.path.join(self.tmp, name))
            self.files[rank] = k + 1
            for c in self.pending.pop(rank):
                c["file"] = name
        self.buffers, self.buffered = {}, 0

    def close(self, meta):
        self._flush()
        fsync_write(os.path.join(self.tmp, INDEX_FILE),
                    json.dumps({"format": INDEX_FORMAT, "version": 1, "tensors": self.index}, indent=1).encode())
        meta = dict(meta, megalite_version=__version__, has_rng=False, iteration=self.iteration
                    if self.iteration != "release" else 0)
        meta["parallel"] = {"tensor_model_parallel_size": self.tp, "pipeline_model_parallel_size": self.pp,
                            "data_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
                            "use_distributed_optimizer": False, "zero_stage": None, "world_size": self.tp * self.pp}
        fsync_write(os.path.join(self.tmp, META), json.dumps(meta, indent=1).encode())
        shutil.rmtree(self.dir, ignore_errors=True)
        os.rename(self.tmp, self.dir)
        fsync_write(os.path.join(self.root, TRACKER), f"{self.iteration}\n", mode="w")


def reshard(load_dir, save_dir, tp, pp):
    """megalite -> megalite at another TP x PP: every tensor (optimizer state included)."""
    path, meta = find_checkpoint(load_dir)
    src = Reader(path)
    iteration = "release" if os.path.basename(path) == "release" else meta["iteration"]
    w = Writer(save_dir, iteration, meta["model_config"], tp, pp)
    for name in src.names():
        w.add(name, src.get(name))
    w.close(meta)


def import_megatron(load_dir, save_dir, tp, pp, model_config_of, load_optim=True):
    """A Megatron-LM torch_dist --save directory -> a megalite checkpoint at its iteration: weights, iteration,
    consumed samples and, where Megatron saved them (and load_optim), Adam's state, the LR schedule and the loss
    scale. model_config_of(Megatron's args, vocab): the megalite model config (the command line's mapping,
    megalite/cli/megatron_args.py). Returns (the Megatron checkpoint, whether its optimizer state came along)."""
    from megalite.checkpoint.megatron import MegatronCheckpoint
    src = MegatronCheckpoint(load_dir)
    margs = src.args
    vocab = getattr(margs, "vocab_size", None) or getattr(margs, "padded_vocab_size", None)
    if not vocab:
        raise CheckpointError(f"{src.path}: Megatron's args give neither vocab_size nor padded_vocab_size")
    cfg = model_config_of(margs, vocab)
    cfg["make_vocab_size_divisible_by"] = getattr(margs, "make_vocab_size_divisible_by", None) or 128
    optim = load_optim and src.optimizer_format() is not None
    step, states = src.optimizer(cfg) if optim else (0.0, [])
    w = Writer(save_dir, src.iteration, cfg, tp, pp)
    for name, t in src.weights(cfg):
        w.add(name, t)
    for name, t in states:
        w.add(name, t)
    train, valid = src.consumed()
    meta = {"format": "megalite-checkpoint", "version": 1, "model_config": cfg, "dtype": cfg["params_dtype"],
            "consumed_train_samples": train, "consumed_valid_samples": valid, "has_optimizer": optim,
            "source": {"megatron": os.path.abspath(src.path),
                       "checkpoint_version": src.common.get("checkpoint_version")}}
    if optim:
        sched = src.common.get("opt_param_scheduler") or {}
        scaler = src.optimizer_common().get("grad_scaler") or {"scale": 1.0}
        meta.update(optimizer={"step": step, "kind": "adam"},
                    scheduler={k: sched[k] for k in ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps",
                                                     "lr_decay_style", "num_steps", "start_wd", "end_wd",
                                                     "wd_incr_style", "wd_incr_steps") if k in sched},
                    loss_scaler={k: float(v) if k == "scale" else int(v) for k, v in scaler.items()
                                 if k in ("scale", "growth_tracker", "hysteresis_tracker")})
    w.close(meta)
    return src, optim
