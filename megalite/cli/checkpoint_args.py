"""--use-checkpoint-args (Megatron's load_args_from_checkpoint): the model flags that --load's newest
checkpoint recorded (its metadata's model config) go into args before validation, so every rank derives
the same args once, and a fine-tuning command needs no size flags. Works alike for checkpoints written by
training and by tools/convert_checkpoint.py (a Hugging Face import), and for a Megatron-LM torch_dist directory
(its saved arguments, mapped as --load maps them: megalite/cli/megatron_args.py)."""

import os

from megalite.checkpoint.storage import CheckpointError, read_json
from megalite.config import CHECKPOINT_ARGS
from megalite.checkpoint.manager import META, TRACKER, iteration_dir, read_tracker
from megalite.checkpoint.megatron import is_megatron_checkpoint

# Command-line dest -> the ModelConfig field a checkpoint records (config.Field(restored=True): Megatron's list for
# what megalite has, and MLA's; disable_bias_linear is add_bias_linear negated). The checkpoint's value replaces
# the command line's, as Megatron's _set_arg(force=True) does for the architecture flags. Megatron keeps the sizes a
# command line gives (its _set_arg without force); megalite keeps --seq-length and --max-position-embeddings that
# way (fine-tuning at another length), and takes the checkpoint's layers, hidden, heads, FFN and kv-channels,
# since a size other than the checkpoint's could only fail to load (it is named in the notice).
CHECKPOINT_ARGS_IF_UNSET = ("seq_length", "max_position_embeddings")


def use_checkpoint_args(args, defaults):
    """--use-checkpoint-args, run before validation (so every rank derives the same args once): the model
    flags as --load's newest checkpoint recorded them go into args, and the vocabulary size where neither
    --vocab-size nor a tokenizer gives it. defaults: the parser's, to name the command line's flags replaced.
    Returns (checkpoint directory, [those flags]), or (None, []) when --load holds no checkpoint (then the
    command line stands, as in Megatron, if it gives the model's sizes)."""
    root = args.load
    if not root:
        raise CheckpointError("--use-checkpoint-args needs --load DIR (the checkpoint whose model flags to use)")
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"--load {root} is a file; give the checkpoint directory (the one holding {TRACKER})")
    if is_megatron_checkpoint(root):
        path, saved = _megatron_model_config(root)
        return path, _take(args, saved, defaults)
    it = read_tracker(root) if os.path.isdir(root) else None
    if it is None:
        missing = [f"--{f.replace('_', '-')}" for f in ("num_layers", "hidden_size", "num_attention_heads",
                                                        "seq_length") if getattr(args, f) is None]
        if missing:
            where = "does not exist" if not os.path.exists(root) else f"holds no checkpoint ({TRACKER} is missing)"
            raise CheckpointError(f"--use-checkpoint-args: --load {root} {where}, so nothing gives "
                                  f"{', '.join(missing)}; point --load at a checkpoint directory or pass them")
        return None, []
    path = iteration_dir(root, it)
    meta = read_json(os.path.join(path, META), "checkpoint metadata")
    saved = meta.get("model_config") if isinstance(meta, dict) else None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{os.path.join(path, META)} records no model config for --use-checkpoint-args")
    return path, _take(args, saved, defaults)


def _megatron_model_config(root):
    """(its iteration directory, the model fields of its saved arguments, as a megalite checkpoint's model config
    holds them) of the Megatron-LM checkpoint at root: megalite's flags are Megatron's (megalite/cli/megatron_args.py
    maps them the same way for --load); validation then checks them as any command line's."""
    from megalite.checkpoint.megatron import MegatronCheckpoint
    src = MegatronCheckpoint(root)
    saved = {}
    for dest, field in CHECKPOINT_ARGS.items():
        value = getattr(src.args, field if dest == "disable_bias_linear" else dest, None)  # (add_bias_linear)
        if value is not None:
            saved[field] = value
    saved["vocab_size"] = getattr(src.args, "vocab_size", None) or getattr(src.args, "padded_vocab_size", None)
    return src.path, saved


def _take(args, saved, defaults):
    """The checkpoint's model flags (saved: a model config JSON) into args; [the command line's flags replaced]."""
    replaced = []
    for dest, field in CHECKPOINT_ARGS.items():
        if field not in saved or (dest in CHECKPOINT_ARGS_IF_UNSET and getattr(args, dest) is not None):
            continue
        value, mine = (not saved[field]) if dest == "disable_bias_linear" else saved[field], getattr(args, dest)
        if mine not in (value, defaults.get(dest)):
            replaced.append(f"--{dest.replace('_', '-')}" + ("" if isinstance(mine, bool) else f" {mine}"))
        setattr(args, dest, value)
    if "num_query_groups" in saved:
        args.group_query_attention = args.num_query_groups not in (None, args.num_attention_heads)
    if args.vocab_size is None and args.tokenizer_type is None and saved.get("vocab_size"):
        args.vocab_size = saved["vocab_size"]
    return replaced
