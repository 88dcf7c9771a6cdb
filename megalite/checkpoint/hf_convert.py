"""Offline conversion between megalite and Hugging Face checkpoints, tensor by tensor (convert.py reads and
writes the megalite side): the HF class of each model_type, the class a megalite model exports as, and the two
directions (export_hf, import_hf). An HF config is read field by field (hf_fields.py)."""

import json
import os

from megalite.checkpoint.convert import Reader, Writer, _save_file, find_checkpoint
from megalite.checkpoint.hf import EXPORT_ONLY, GPT2, Bert, Llama
from megalite.checkpoint.hf_deepseek import DeepseekV3
from megalite.checkpoint.hf_dense import Gemma, Mistral, Phi3, Qwen2, Qwen3
from megalite.checkpoint.hf_fields import read_hf_config
from megalite.checkpoint.hf_moe import Mixtral, Qwen2Moe, Qwen3Moe, fused_expert_tensor, moe_arch_for
from megalite.checkpoint.storage import DTYPES, CheckpointError, open_safetensors, read_json

BY_HF_TYPE = {"gpt2": GPT2, "llama": Llama, "mistral": Mistral, "phi3": Phi3, "gemma": Gemma, "qwen2": Qwen2,
              "qwen3": Qwen3, "bert": Bert, "mixtral": Mixtral, "qwen2_moe": Qwen2Moe, "qwen3_moe": Qwen3Moe,
              "deepseek_v3": DeepseekV3}

# architectures not mapped yet -> the nearest one that is, and what the difference is
NEAREST = {"gemma2": "llama (Gemma 2 adds soft-capping, local/global windows and post-norms)",
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
    if config.get("geglu"):
        return Gemma
    return Qwen3 if config.get("qk_layernorm") else Qwen2 if config.get("add_qkv_bias") else Llama


def export_hf(load_dir, save_dir, max_shard_bytes=1 << 30, model_type=None, hf_class=None, dtype=None):
    """megalite -> a Hugging Face directory (config.json + safetensors shards + index).
    model_type ("gpt" or "bert"): for checkpoints that do not record it; must agree with those that do.
    hf_class (--hf-architecture): the class to write where more than one holds the model; default the class an
    imported checkpoint came from, if it holds it, else arch_for's. dtype (--hf-dtype): the weights' ("float32":
    the fp32 main weights a half-precision run's checkpoint holds); default the model's own."""
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
    gemma = {"geglu": cfg.get("geglu", False), "embedding_multiplier": cfg.get("embedding_multiplier", 1.0)}
    if gemma != {"geglu": False, "embedding_multiplier": 1.0} and arch.hf_class != "GemmaForCausalLM":
        raise CheckpointError(f"{arch.hf_class} cannot represent --geglu / --embedding-multiplier ({gemma}); "
                              "GemmaForCausalLM can (--hf-architecture)")
    arch.check(cfg)
    src = Reader(path)
    read = _weights(src, arch.table(cfg), cfg["params_dtype"], dtype)
    cfg["params_dtype"] = dtype or cfg["params_dtype"]
    os.makedirs(save_dir, exist_ok=True)
    shards, current, size, cache = [], {}, 0, {}
    for hf_name, name, to_hf, _ in arch.table(cfg):
        if name not in cache:  # q/k/v and gate/up come from one megalite tensor: read it once
            cache = {name: read(name)}
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


def _weights(src, rows, saved, asked):
    """name -> the tensor export_hf writes: the model's weights in `saved` dtype, or cast to `asked`; asked
    float32 from a half-precision model: the optimizer's fp32 main weights where the checkpoint holds every one."""
    if asked is None or asked == saved:
        print(f"convert: wrote the model's {saved} weights" + ("; --hf-dtype float32 writes the fp32 main weights "
              "its checkpoint holds" if saved != "float32" else ""), flush=True)
        return src.get
    main = asked == "float32" and all(f"optimizer.main_param.{name}" in src.index for _, name, _, _ in rows)
    print("convert: wrote float32 weights from the optimizer's fp32 main weights" if main else
          f"convert: wrote the model's {saved} weights cast to {asked}", flush=True)
    return (lambda name: src.get(f"optimizer.main_param.{name}")) if main else \
        (lambda name: src.get(name).to(DTYPES[asked]))


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
