"""A Megatron-LM checkpoint's argparse namespace -> megalite's flags for the same model.

megalite's flags are Megatron's (same names, defaults, meanings), so the architecture a Megatron run was
launched with is its values of the flags megalite records in a checkpoint (config.CHECKPOINT_ARGS), passed
through megalite's own parser and validation: a model megalite cannot build is refused there, in one line."""

from megalite.cli.features.model import ROPE_SCALING_DEFAULTS
from megalite.config import CHECKPOINT_ARGS

# Megatron's dest where it differs from megalite's (Megatron's --disable-bias-linear stores add_bias_linear=False)
_NEGATED = {"disable_bias_linear": "add_bias_linear"}


def model_flags(margs, vocab_size):
    """megalite's command-line flags for the model in Megatron's namespace `margs` (vocabulary: vocab_size)."""
    from megalite.cli.parser import build_parser
    actions = {a.dest: a for a in build_parser()._actions if a.option_strings}
    argv = ["--vocab-size", str(vocab_size), "--make-vocab-size-divisible-by", "1"]
    for dest in list(CHECKPOINT_ARGS) + ["group_query_attention", "bf16", "fp16"]:
        if dest in _NEGATED:
            value = getattr(margs, _NEGATED[dest], None)
            value = None if value is None else not value
        else:
            value = getattr(margs, dest, None)
        a = actions.get(dest)
        if a is None or value is None or (dest in ROPE_SCALING_DEFAULTS and not getattr(margs, "use_rope_scaling",
                                                                                            False)):
            continue  # (Megatron keeps the rope-scaling values, unused, without --use-rope-scaling)
        flag = a.option_strings[0]
        if a.nargs == 0:  # store_true / store_false
            if bool(value) != bool(a.default):
                argv.append(flag)
        elif isinstance(value, (list, tuple)) and a.nargs is None:  # one value that is a list (--moe-layer-freq)
            argv += [flag, "[" + ",".join(map(str, value)) + "]"]
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def model_config_of(margs, vocab_size):
    """megalite's ModelConfig (its checkpoint JSON) of the model in Megatron's namespace, validated by megalite."""
    from megalite.checkpoint.manager import config_json
    from megalite.cli.parser import check_args, model_config
    run = ["--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-4", "--train-iters", "1"]
    args = check_args(model_flags(margs, vocab_size) + run, world_size=1)
    return config_json(model_config(args, vocab_size))
