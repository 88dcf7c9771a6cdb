"""megalite -> a Megatron-LM `torch_dist` --save directory (tools/convert_checkpoint.py --saver megatron): what
Megatron-LM's `--load` (megatron-core's dist_checkpointing) reads back at any TP / PP of the user's choice.

Written as Megatron-Core's sharded state dict lays it out (megatron_names.py's table, the other way): layers
stacked under one key with a leading layer axis, norms under Transformer Engine's fused names (which the local
spec maps to as well), SwiGLU's fc1 as [gate; up], the vocabulary padded as Megatron pads it at the target TP, an
empty `_extra_state` object per linear layer and layer; each tensor whole (DCP reshards it on load); common.pt
with the iteration and Megatron's argparse namespace of the model's flags (megatron-core reads pickles: this one
is written by torch.save of plain values)."""

import argparse
import json
import os

import torch

from megalite.checkpoint.convert import Reader, find_checkpoint, padded_vocab
from megalite.checkpoint.megatron_names import EXPERT, MOE, layer_suffixes, moe_layers
from megalite.checkpoint.storage import CheckpointError
from megalite.config import CHECKPOINT_ARGS

LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


MEGATRON_ROPE_SCALING_BAND = (1.0, 4.0, 8192)  # (megatron-core's apply_rope_scaling: no flag reaches them)


def _names(cfg, mine, theirs):
    """The Megatron keys one tensor is written under: Transformer Engine's name (which megatron-core's local spec
    maps its dense layers' norms to as well); in an MLA layer, whose specs map no norm, each norm under both
    specs' names (TE's fused `linear_q_up_proj.layer_norm_weight` and the local `q_layernorm.weight`; its input
    norm is `input_layernorm` in both), so Megatron-LM loads it with either."""
    if not cfg.get("multi_latent_attention") or "norm." not in mine:
        return theirs[:1]
    return [t for t in theirs if "linear_qkv." not in t]


def _linears(cfg):
    if not cfg.get("multi_latent_attention"):
        return LINEARS
    q = ["linear_q_proj"] if cfg.get("q_lora_rank") is None else ["linear_q_down_proj", "linear_q_up_proj"]
    return tuple(f"self_attention.{m}" for m in q + ["linear_kv_down_proj", "linear_kv_up_proj"]) + LINEARS[1:]


def megatron_namespace(cfg, tp, iteration, consumed):
    """Megatron's argparse namespace of a megalite model config (the flags megalite records; Megatron's names)."""
    ns = {dest: cfg[field] for dest, field in CHECKPOINT_ARGS.items() if field in cfg and dest != "disable_bias_linear"}
    ns.update(add_bias_linear=cfg["add_bias_linear"], group_query_attention=cfg["num_query_groups"] not in (
        None, cfg["num_attention_heads"]), vocab_size=cfg["vocab_size"],
        make_vocab_size_divisible_by=cfg["make_vocab_size_divisible_by"],
        padded_vocab_size=padded_vocab(cfg["vocab_size"], cfg["make_vocab_size_divisible_by"], tp),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, consumed_train_samples=consumed[0],
        consumed_valid_samples=consumed[1], ckpt_format="torch_dist", iteration=iteration,
        bf16=cfg["params_dtype"] == "bfloat16", fp16=cfg["params_dtype"] == "float16")
    if cfg.get("window_size") is not None:  # (Megatron's --window-size is the pair (keys before, keys after))
        ns["window_size"] = (cfg["window_size"], 0)
    return argparse.Namespace(**ns)


def _layer(src, cfg, i, moe):
    """{Megatron suffix: tensor} of layer i in Megatron's shapes (SwiGLU's fc1 [gate; up], experts stacked on a
    leading expert axis), and the linear layers whose `_extra_state` it keeps ([(name, experts or None)])."""
    def theirs_of(t, mine):
        return t.reshape(-1, *t.shape[2:]) if cfg["swiglu"] and "linear_fc1." in mine else t
    out = {name: theirs_of(src.get(f"decoder.layers.{i}.{mine}"), mine) for mine, theirs in layer_suffixes(cfg)
           if not (moe and mine.startswith("mlp.")) for name in _names(cfg, mine, theirs)}
    linears = [(lin, None) for lin in _linears(cfg) if not (moe and lin.startswith("mlp."))]
    if moe:
        out.update({theirs: theirs_of(src.get(f"decoder.layers.{i}.{mine}"), mine) for mine, theirs in MOE
                    if f"decoder.layers.{i}.{mine}" in src.index})
        n = cfg["num_moe_experts"]
        for mine, theirs in EXPERT:
            out[theirs] = torch.stack([theirs_of(src.get(f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{mine}"),
                                                 mine) for e in range(n)])
        linears += [("mlp.experts.experts.linear_fc1", n), ("mlp.experts.experts.linear_fc2", n)]
    return out, linears


def _layers(src, cfg):
    """Every layer's entries as megatron-core keys them: stacked on a leading layer axis where all layers are
    alike, one key per layer where dense and MoE layers mix (its block spec); with each linear layer's empty
    `_extra_state` object (megatron-core's sharded object: the list of its shards' data, None for its own non-TE
    layers), keyed as that layout keys them."""
    L, moe = cfg["num_layers"], moe_layers(cfg)
    per = [_layer(src, cfg, i, moe[i]) for i in range(L)]
    state = {}
    if len(set(moe)) > 1:
        for i, (tensors, linears) in enumerate(per):
            state.update({f"decoder.layers.{i}.{k}": t for k, t in tensors.items()})
            for lin, n in linears:
                state.update({f"decoder.layers.{i}.{lin}._extra_state/shard_{e}_{n}": [None] for e in range(n)}
                             if n else {f"decoder.layers.{i}.{lin}._extra_state/shard_0_1": [None]})
        return state
    for k in per[0][0]:
        state[f"decoder.layers.{k}"] = torch.stack([tensors[k] for tensors, _ in per])
    for lin, n in per[0][1]:
        for i in range(L):
            state.update({f"decoder.layers.{lin}._extra_state/shard_{i}.{e}_{L}.{n}": [None] for e in range(n)}
                         if n else {f"decoder.layers.{lin}._extra_state/shard_{i}_{L}": [None]})
    return state


def export_megatron(load_dir, save_dir, tp=1):
    """A megalite checkpoint's weights, iteration and data position as a Megatron-LM --save directory."""
    import torch.distributed.checkpoint as dcp
    path, meta = find_checkpoint(load_dir)
    cfg = meta["model_config"]
    if cfg.get("model_type", "gpt") != "gpt" or cfg.get("mtp_num_layers"):
        raise CheckpointError("--saver megatron writes GPT models, dense, MoE or MLA (no MTP or BERT yet)")
    band = tuple(cfg.get(f) for f in ("rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
                                      "rope_scaling_original_max_position_embeddings"))
    if cfg.get("geglu") or cfg.get("embedding_multiplier", 1.0) != 1.0:
        raise CheckpointError("--geglu / --embedding-multiplier (Gemma's) have no Megatron-LM equivalent")
    if cfg.get("use_rope_scaling") and band != MEGATRON_ROPE_SCALING_BAND:
        raise CheckpointError(f"--use-rope-scaling with low/high frequency factors and original context {band}: "
                              f"Megatron's are fixed at {MEGATRON_ROPE_SCALING_BAND}, so it would build another model")
    src = Reader(path)
    vocab = padded_vocab(cfg["vocab_size"], cfg["make_vocab_size_divisible_by"], tp)

    def padded(t):
        return torch.cat([t, t.new_zeros(vocab - t.shape[0], *t.shape[1:])]) if vocab > t.shape[0] else t
    state = {"embedding.word_embeddings.weight": padded(src.get("embedding.word_embeddings.weight"))}
    if cfg["position_embedding_type"] == "learned_absolute":
        state["embedding.position_embeddings.weight"] = src.get("embedding.position_embeddings.weight")
    state.update(_layers(src, cfg))
    for name in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"):
        if name in src.index:
            state[name] = padded(src.get(name)) if name == "output_layer.weight" else src.get(name)
    iteration = meta.get("iteration", 0) if os.path.basename(path) != "release" else 0
    out = os.path.join(save_dir, f"iter_{iteration:07d}")
    os.makedirs(out, exist_ok=True)
    from torch.distributed.checkpoint import DefaultSavePlanner
    # (keys as they are: megatron-core's loader takes a flattening record in the metadata for its own nesting)
    dcp.save(state, checkpoint_id=str(out), no_dist=True, planner=DefaultSavePlanner(flatten_state_dict=False))
    consumed = (meta.get("consumed_train_samples", 0), meta.get("consumed_valid_samples", 0))
    torch.save({"args": megatron_namespace(cfg, tp, iteration, consumed), "checkpoint_version": 3.0,
                "iteration": iteration}, os.path.join(out, "common.pt"))
    with open(os.path.join(out, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return iteration
