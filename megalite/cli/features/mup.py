"""The command line of muP (megalite/mup.py: the rules): Megatron's --mup-* flags and their checks."""

from megalite.cli.compat import print_notices
from megalite.errors import ConfigError

# Megatron's --mup-* flags besides --use-mup: dest -> (type, default, help)
MUP_FLAGS = {"mup_base_hidden_size": (int, None, "the base model's width (default --hidden-size)"),
             "mup_width_mult": (float, 1.0, "derived: --hidden-size / --mup-base-hidden-size"),
             "mup_embedding_mult": (float, 1.0, "embedding output multiplier"),
             "mup_output_mult": (float, 1.0, "logit multiplier (left at 1: 1 / width multiplier)"),
             "mup_base_head_dim": (float, None, "attention scale sqrt(this) / head dim ** --mup-attn-scale-power"),
             "mup_attn_scale_power": (float, 1.0, "attention scale 1 / head dim ** this (0.5: the usual)")}


def validate_mup(args):
    """The --mup-* flags, each problem one line (ModelConfig checks the values again)."""
    given = [f"--{k.replace('_', '-')}" for k, (_, v, _) in MUP_FLAGS.items() if getattr(args, k) != v]
    if not args.use_mup:
        if given:
            raise ConfigError(f"{', '.join(given)} {'have' if len(given) > 1 else 'has'} no effect without "
                              "--use-mup: add --use-mup or remove them")
        return
    if args.model_type != "gpt":
        raise ConfigError(f"--use-mup is implemented for GPT models only in megalite (pretrain_gpt.py), not "
                          f"{args.model_type}")
    if getattr(args, "multi_latent_attention", False):
        raise ConfigError("--use-mup with --multi-latent-attention is not implemented in megalite (MLA's own "
                          "projections and softmax scale are not width-scaled)")
    base = args.hidden_size if args.mup_base_hidden_size is None else args.mup_base_hidden_size
    if base is not None and base <= 0:
        raise ConfigError(f"--mup-base-hidden-size {base} must be positive")
    if args.mup_base_head_dim is not None and args.mup_base_head_dim <= 0:
        raise ConfigError(f"--mup-base-head-dim {args.mup_base_head_dim} must be positive")
    if args.mup_width_mult != 1.0 and base and args.mup_width_mult != args.hidden_size / base:
        raise ConfigError(f"--mup-width-mult {args.mup_width_mult} is derived as --hidden-size / "
                          f"--mup-base-hidden-size = {args.hidden_size / base:g}: set --mup-base-hidden-size "
                          "instead")
    if args.decoupled_lr is not None:
        print_notices(["--decoupled-lr with --use-mup: the embeddings and output layer take --decoupled-lr; muP "
                       "scales only the hidden matrices' LR and Adam eps (as Megatron)"])
