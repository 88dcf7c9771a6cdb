"""Offline conversion, tensor by tensor: megalite <-> megalite (another TP/PP), megalite <-> HF.

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
from megalite.checkpoint.hf import EXPORT_ONLY, GPT2, Bert, Llama
from megalite.checkpoint.hf_deepseek import DeepseekV3
from megalite.checkpoint.hf_dense import Mistral, Phi3, Qwen2, Qwen3
from megalite.checkpoint.hf_fields import read_hf_config
from megalite.checkpoint.hf_moe import Mixtral, Qwen2Moe, Qwen3Moe, fused_expert_tensor, moe_arch_for
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
BY_HF_TYPE = {"gpt2": GPT2, "llama": Llama, "mistral": Mistral, "phi3": Phi3, "qwen2": Qwen2, "qwen3": Qwen3,
              "bert": Bert, "mixtral": Mixtral, "qwen2_moe": Qwen2Moe, "qwen3_moe": Qwen3Moe, "deepseek_v3": DeepseekV3}

# architectures not mapped yet -> the nearest one that is, and what the difference is
NEAREST = {"gemma": "llama (Gemma scales the embedding and uses (1 + w) RMSNorm and GeLU-tanh)",
           "gemma2": "llama (Gemma 2 adds soft-capping, local/global windows and post-norms)",
           "gemma3_text": "llama (Gemma 3 adds local/global windows, QK-norm and post-norms)",
           "olmo2": "qwen3 (OLMo 2 normalises after attention and the MLP, and q/k over all heads)",
           "gpt_neox": "gpt2 (GPT-NeoX has rotary positions and a parallel residual)", "qwen2_vl": "qwen2 (text only)",
           "deepseek_v2": "deepseek_v3 (V2 routes by softmax)"}


def arch_for(config, asked=None):
    """The architecture a megalite model config maps to (configs before model_type: GPT); asked: an HF class name
    that must hold it instead (one whose `same_models_as` is that architecture's: Mistral for Llama)."""
    arch = _arch_for(config)
    if asked in (None, arch.hf_class):
        return arch
    for a in _alike(arch):
        if a.hf_class == asked:
            return a
    raise CheckpointError(f"--hf-architecture {asked} cannot hold this model: it is a {arch.hf_class}"
                          + "".join(f" (or {a.hf_class})" for a in _alike(arch)))


def _alike(arch):
    """The other architectures that hold exactly arch's models."""
    return [a for a in BY_HF_TYPE.values() if getattr(a, "same_models_as", None) == arch.hf_class]


def _arch_for(config):
    if config.get("model_type", "gpt") == "bert":
        return Bert
    if config.get("multi_latent_attention"):
        return DeepseekV3
    if config.get("num_moe_experts"):
        return moe_arch_for(config)
    if config["position_embedding_type"] != "rope":
        return GPT2
    return Qwen3 if config.get("qk_layernorm") else Qwen2 if config.get("add_qkv_bias") else Llama
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


def export_hf(load_dir, save_dir, max_shard_bytes=1 << 30, model_type=None, hf_class=None):
    """megalite -> a Hugging Face directory (config.json + safetensors shards + index).
    model_type ("gpt" or "bert"): for checkpoints that do not record it; must agree with those that do.
    hf_class (--hf-architecture): the class to write where more than one holds the model; default the class an
    imported checkpoint came from, if it holds it, else arch_for's."""
    path, meta = find_checkpoint(load_dir)
    cfg = dict(meta["model_config"])
    if model_type is not None:
        if cfg.setdefault("model_type", model_type) != model_type:
            raise CheckpointError(f"--model-type {model_type.upper()}: the checkpoint is a {cfg['model_type'].upper()} "
                                  "model; drop --model-type or pick that one")
    if cfg.get("use_mup"):  # its embedding / logit multipliers and attention scale have no HF field
        raise CheckpointError("Hugging Face models cannot represent a muP model (--use-mup: embedding and logit "
                              "multipliers, attention scale); convert a model trained without --use-mup")
    arch = arch_for(cfg, hf_class)
    if hf_class is None:  # an imported checkpoint goes back as the class it came from, where that one holds it
        source = meta.get("source", {}).get("hf_class")
        arch = next((a for a in _alike(arch) if a.hf_class == source), arch)
    if cfg.get("mtp_num_layers") and not getattr(arch, "holds_mtp", False):
        raise CheckpointError(f"{arch.hf_class} cannot hold the {cfg['mtp_num_layers']} multi-token prediction layers "
                              "(--mtp-num-layers); DeepseekV3ForCausalLM's layout can")
    arch.check(cfg)
    src = Reader(path)
    os.makedirs(save_dir, exist_ok=True)
    shards, current, size, cache = [], {}, 0, {}
    for hf_name, name, to_hf, _ in arch.table(cfg):
        if name not in cache:  # q/k/v and gate/up come from one megalite tensor: read it once
            cache = {name: src.get(name)}
        current[hf_name] = to_hf(cache[name]).contiguous()
        size += current[hf_name].numel() * current[hf_name].element_size()
        if size >= max_shard_bytes:
            shards.append(current)
            _save_file(current, os.path.join(save_dir, f"shard-{len(shards)}.tmp"))
            shards[-1], current, size = list(current), {}, 0  # keep only the names
    if current or not shards:
        shards.append(list(current))
        _save_file(current, os.path.join(save_dir, f"shard-{len(shards)}.tmp"))
    n, weight_map = len(shards), {}
    for i, tensors in enumerate(shards, 1):
        final = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(save_dir, f"shard-{i}.tmp"), os.path.join(save_dir, final))
        weight_map.update({k: final for k in tensors})
    if n > 1:
        with open(os.path.join(save_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(save_dir, "config.json"), "w") as f:
        json.dump(arch.hf_config(cfg), f, indent=1)


class HFReader:
    """Tensors of a save_pretrained directory (safetensors only: nothing is unpickled)."""

    def __init__(self, path):
        self.config = read_json(os.path.join(path, "config.json"), "Hugging Face config")
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            files = read_json(index, "safetensors index")["weight_map"]
        elif os.path.isfile(os.path.join(path, "model.safetensors")):
            files = None
        else:
            raise CheckpointError(f"{path} has no model.safetensors (pytorch_model.bin is a pickle: re-save it with "
                                  "save_pretrained(..., safe_serialization=True))")
        self.path, self.files, self._open = path, files, {}

    def _slice(self, name):
        """A lazy view of tensor `name` (only what is indexed is read), or None."""
        file = "model.safetensors" if self.files is None else self.files.get(name)
        if file is None:
            return None
        if file not in self._open:
            self._open[file] = open_safetensors(os.path.join(self.path, file))
        return self._open[file].get_slice(name) if name in self._open[file].keys() else None

    def has(self, name):
        return self._slice(name) is not None

    def get(self, name):
        s = self._slice(name)
        if s is not None:
            return s[:]
        t = fused_expert_tensor(name, self._slice)  # an MoE expert's weight in the fused layout
        if t is None:
            raise CheckpointError(f"{self.path} has no tensor {name!r}")
        return t


def import_hf(load_dir, save_dir, tp, pp, divisible_by=128):
    """A Hugging Face directory -> a megalite "release" checkpoint (weights only)."""
    src = HFReader(load_dir)
    h = src.config
    arch = BY_HF_TYPE.get(h.get("model_type"))
    if arch is None:
        kind = h.get("model_type")
        near = NEAREST.get(kind)
        raise CheckpointError(f"model_type {kind!r} ({', '.join(h.get('architectures') or ['no architectures'])}) "
                              "is not one megalite converts" + (f"; the nearest it has is {near}" if near else "")
                              + f" (it converts {', '.join(BY_HF_TYPE)})")
    cfg = dict(read_hf_config(h, arch, h["model_type"]), make_vocab_size_divisible_by=divisible_by)
    if cfg.get("mtp_num_layers") and not src.has(arch.mtp_probe(cfg)):
        print(f"convert: {load_dir} has no multi-token prediction weights (num_nextn_predict_layers "
              f"{cfg['mtp_num_layers']}; transformers does not save them): imported without MTP", flush=True)
        cfg["mtp_num_layers"] = None
    dtype = str(h.get("torch_dtype") or h.get("dtype") or "float32")
    cfg["params_dtype"] = dtype
    w = Writer(save_dir, "release", cfg, tp, pp)
    held = {}
    for hf_name, name, _, from_hf in arch.table(cfg):
        if from_hf == EXPORT_ONLY:
            continue
        t = src.get(hf_name)
        if from_hf is None:
            held[hf_name] = t
        elif isinstance(from_hf, tuple):
            w.add(name, from_hf[2](*[held.pop(n) for n in from_hf[1]], t))
        else:
            w.add(name, from_hf(t))
    meta = {"format": "megalite-checkpoint", "version": 1, "model_config": cfg, "dtype": dtype,
            "consumed_train_samples": 0, "consumed_valid_samples": 0, "has_optimizer": False,
            "source": {"hf_class": arch.hf_class, "path": os.path.abspath(load_dir)}}
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
                                                     "lr_decay_style", "num_steps") if k in sched},
                    loss_scaler={k: float(v) if k == "scale" else int(v) for k, v in scaler.items()
                                 if k in ("scale", "growth_tracker", "hysteresis_tracker")})
    w.close(meta)
    return src, optim
