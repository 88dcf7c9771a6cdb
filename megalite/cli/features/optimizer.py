"""The command line of the optimizers (megalite/optimizer/): Megatron-LM's `--optimizer` with its SGD,
Lion and Muon flags and defaults, and their checks, each user error one line."""

from megalite.config import ConfigError
from megalite.optimizer.newton_schulz import COEFFICIENTS, PRECISIONS, SCALE_MODES

OPTIMIZERS = ("adam", "sgd", "muon", "lion")
TP_MODES = ("duplicated", "distributed", "blockwise")
# flag -> (dest, default, the optimizers it belongs to)
_OWN = {"--sgd-momentum": ("sgd_momentum", 0.9, ("sgd",)),
        "--lion-beta1": ("lion_beta1", 0.95, ("lion",)), "--lion-beta2": ("lion_beta2", 0.98, ("lion",)),
        "--muon-momentum": ("muon_momentum", 0.9, ("muon",)),
        "--muon-no-split-qkv": ("muon_split_qkv", True, ("muon",)),
        "--muon-nesterov": ("muon_nesterov", False, ("muon",)),
        "--muon-scale-mode": ("muon_scale_mode", "spectral", ("muon",)),
        "--muon-fp32-matmul-prec": ("muon_fp32_matmul_prec", "medium", ("muon",)),
        "--muon-coefficient-type": ("muon_coefficient_type", "quintic", ("muon",)),
        "--muon-num-ns-steps": ("muon_num_ns_steps", 5, ("muon",)),
        "--muon-tp-mode": ("muon_tp_mode", "duplicated", ("muon",)),
        "--muon-extra-scale-factor": ("muon_extra_scale_factor", 1.0, ("muon",)),
        "--muon-scalar-optimizer": ("muon_scalar_optimizer", "adam", ("muon",)),
        "--muon-use-syrk": ("muon_use_syrk", False, ("muon",))}


def add_optimizer_flags(a):
    a("--optimizer", default="adam",
      help="adam (AdamW), sgd (momentum SGD), lion, or muon (Newton-Schulz orthogonalised momentum for the hidden "
           "matrices, --muon-scalar-optimizer for embeddings, output layer, norms, biases and routers)")
    a("--sgd-momentum", type=float, default=0.9)
    a("--lion-beta1", type=float, default=0.95, help="Lion: the sign update's interpolation")
    a("--lion-beta2", type=float, default=0.98, help="Lion: the momentum's EMA")
    a("--muon-momentum", type=float, default=0.9, help="Muon: the momentum's EMA coefficient")
    a("--muon-no-split-qkv", dest="muon_split_qkv", action="store_false", default=True,
      help="Muon: orthogonalise the fused QKV weight as one matrix (default: q, k and v apart)")
    a("--muon-nesterov", action="store_true", help="Muon: Nesterov momentum")
    a("--muon-scale-mode", default="spectral",
      help=f"Muon: the update's scale, {', '.join(SCALE_MODES)} (sqrt(max(out, in)), sqrt(out / in), "
           "sqrt(max(1, out / in)))")
    a("--muon-fp32-matmul-prec", default="medium",
      help="Muon: medium / low run the Newton-Schulz steps in bf16 (Megatron's default), high in fp32")
    a("--muon-coefficient-type", default="quintic", help=f"Muon: Newton-Schulz coefficients, {', '.join(COEFFICIENTS)}")
    a("--muon-num-ns-steps", type=int, default=5, help="Muon: Newton-Schulz steps")
    a("--muon-tp-mode", default="duplicated",
      help="Muon under TP: duplicated (gather the matrix, every TP rank orthogonalises it), distributed (the "
           "Newton-Schulz steps sharded over TP, one Gram all-reduce per step), blockwise (each shard alone: "
           "depends on TP)")
    a("--muon-extra-scale-factor", type=float, default=1.0, help="Muon: a further factor on the update")
    a("--muon-scalar-optimizer", default="adam", help="Muon: adam or lion for the parameters Muon does not take")
    a("--muon-use-syrk", action="store_true", help="accepted: the Gram matrix is a plain matmul")
    a("--qk-clip", action="store_true",
      help="MuonClip (Kimi K2, any optimizer): after each step, a query group whose largest attention logit "
           "passed --qk-clip-threshold gets its q rows x eta^alpha and k rows x eta^(1-alpha), eta = threshold / max")
    a("--qk-clip-threshold", type=float, default=100.0)
    a("--qk-clip-alpha", type=float, default=0.5)
    a("--log-max-attention-logit", action="store_true",
      help="log the step's largest attention logit q.k / sqrt(d) over every layer and head (as --qk-clip sees it)")


def _given(args):
    return [flag for flag, (dest, default, _) in _OWN.items() if getattr(args, dest) != default]


def validate_optimizer(args):
    """Refuse what megalite lacks and flags of another optimizer, one line each."""
    kind = args.optimizer
    if kind == "dist_muon":
        raise ConfigError("--optimizer dist_muon is deprecated in Megatron: use --optimizer muon "
                          "--use-distributed-optimizer")
    if kind not in OPTIMIZERS:
        raise ConfigError(f"--optimizer {kind} is not implemented in megalite (it has {', '.join(OPTIMIZERS)})")
    scalar = args.muon_scalar_optimizer if kind == "muon" else None
    for flag in _given(args):
        owners = _OWN[flag][2] + (("muon",) if flag.startswith("--lion") and scalar == "lion" else ())
        if kind not in owners:
            raise ConfigError(f"{flag} needs --optimizer {owners[0]}"
                              + (" (or --optimizer muon --muon-scalar-optimizer lion)" if flag.startswith("--lion")
                                 else ""))
    for flag, value, allowed in (("--muon-scale-mode", args.muon_scale_mode, SCALE_MODES),
                                 ("--muon-fp32-matmul-prec", args.muon_fp32_matmul_prec, PRECISIONS),
                                 ("--muon-coefficient-type", args.muon_coefficient_type, tuple(COEFFICIENTS)),
                                 ("--muon-tp-mode", args.muon_tp_mode, TP_MODES),
                                 ("--muon-scalar-optimizer", args.muon_scalar_optimizer, ("adam", "lion"))):
        if value not in allowed:
            raise ConfigError(f"{flag} {value} does not exist in megalite (choose from {', '.join(allowed)})")
    _validate_qk_clip(args)
    if args.muon_num_ns_steps < 1:
        raise ConfigError(f"--muon-num-ns-steps {args.muon_num_ns_steps} must be >= 1")
    if kind == "adam":
        return
    if kind == "muon" and args.fp16:
        raise ConfigError("--optimizer muon with --fp16 is not supported (as in Megatron): use --bf16")
    for flag, on in (("--optimizer-cpu-offload", args.optimizer_cpu_offload),
                     ("--semi-sync-method", args.semi_sync_method is not None),
                     ("--use-mup", getattr(args, "use_mup", False))):
        if on:
            raise ConfigError(f"--optimizer {kind} with {flag} is not built in megalite (AdamW only)")


def _validate_qk_clip(args):
    if args.log_max_attention_logit and not args.qk_clip:
        for flag, on in (("--multi-latent-attention", args.multi_latent_attention),
                         ("--reset-attention-mask", getattr(args, "reset_attention_mask", False)),
                         ("BERT (not causal)", args.model_type != "gpt")):
            if on:
                raise ConfigError(f"--log-max-attention-logit with {flag} is not built in megalite")
    if not args.qk_clip:
        given = [f for f, v, d in (("--qk-clip-threshold", args.qk_clip_threshold, 100.0),
                                   ("--qk-clip-alpha", args.qk_clip_alpha, 0.5)) if v != d]
        if given:
            raise ConfigError(f"{', '.join(given)} need --qk-clip")
        return
    if not 0.0 < args.qk_clip_alpha < 1.0 or args.qk_clip_threshold <= 0:
        raise ConfigError(f"--qk-clip-alpha {args.qk_clip_alpha} must be in (0, 1) and --qk-clip-threshold "
                          f"{args.qk_clip_threshold} > 0 (as Megatron)")
    for flag, on in (("--multi-latent-attention", args.multi_latent_attention),
                     ("--qk-layernorm (the normalised q and k would undo the clip)", args.qk_layernorm),
                     ("a QKV bias (the clip scales the weights only; add --disable-bias-linear)",
                      args.add_qkv_bias or not args.disable_bias_linear),
                     ("--reset-attention-mask", getattr(args, "reset_attention_mask", False)),
                     ("BERT (not causal)", args.model_type != "gpt")):
        if on:
            raise ConfigError(f"--qk-clip with {flag} is not built in megalite")
