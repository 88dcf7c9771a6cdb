"""The command line of FP8 training (megalite/tensor_parallel/fp8.py): Megatron's flags, defaults and meanings,
without Transformer Engine; each user error one line."""

from megalite.cli.compat import print_notices
from megalite.config import ConfigError

FORMATS = ("e4m3", "hybrid")
RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8", "custom")  # (rowwise: megalite's, torchao's)


def add_fp8_flags(a):
    a("--fp8-format", default=None, choices=FORMATS,
      help="FP8 GEMMs in the transformer layers: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 gradients)")
    a("--fp8-recipe", default="delayed", choices=RECIPES,
      help="where the scales come from: delayed (the amax history of earlier iterations, Transformer Engine's "
           "default), tensorwise (each tensor's own amax: current scaling), rowwise (one scale per row of each "
           "GEMM's operands, torchao's rowwise), blockwise (DeepSeek-V3's 1x128 / 128x128 scales)")
    a("--fp8-margin", type=int, default=0, help="scales this many powers of two below the largest value")
    a("--fp8-amax-history-len", type=int, default=1, help="delayed: iterations of amax kept")
    a("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"],
      help="delayed: the scale from the newest amax or the largest of the history")
    a("--fp8-interval", type=int, default=1, help="deprecated in Megatron (scales update every iteration); 1 only")
    a("--no-fp8-wgrad", dest="fp8_wgrad", action="store_false", default=True,
      help="the weight gradient's GEMM in the model's precision (the other two in FP8)")
    a("--fp8-param-gather", action="store_true",
      help="the FP8 layers' weights quantized from the fp32 main weights at each step and all-gathered by ZeRO-1/2 in "
           "FP8 (half the bytes of bf16); needs --use-distributed-optimizer and --bf16 / --fp16")
    a("--first-last-layers-bf16", action="store_true",
      help="keep the first --num-layers-at-start-in-bf16 and last --num-layers-at-end-in-bf16 layers out of FP8")
    a("--num-layers-at-start-in-bf16", type=int, default=1)
    a("--num-layers-at-end-in-bf16", type=int, default=1)


def validate_fp8(args):
    if args.fp8_format is None:
        used = [f for f, on in (("--fp8-param-gather", args.fp8_param_gather),
                                ("--first-last-layers-bf16", args.first_last_layers_bf16)) if on]
        if used:
            raise ConfigError(f"{', '.join(used)} needs --fp8-format e4m3 or hybrid")
        return
    r = args.fp8_recipe
    if r == "mxfp8":
        raise ConfigError("--fp8-recipe mxfp8 needs Blackwell GPUs (sm_100: MX block scales in hardware); megalite "
                          "does not emulate it: use tensorwise, rowwise or delayed")
    if r == "custom":
        raise ConfigError("--fp8-recipe custom (a Transformer Engine quantizer factory) is not built in megalite: use "
                          "tensorwise, rowwise, blockwise or delayed")
    if args.fp8_interval != 1:
        raise ConfigError(f"--fp8-interval {args.fp8_interval}: Megatron deprecated it; scales update every "
                          "iteration (leave it out)")
    if args.fp8_param_gather:
        why = [w for w, bad in (
            ("--use-distributed-optimizer (its parameter all-gather is what moves the FP8 weights)",
             not args.use_distributed_optimizer),
            ("--bf16 or --fp16 (the FP8 weights stand in for the model's half-precision copies; fp32 models step "
             "their weights in place)", not (args.bf16 or args.fp16)),
            ("--fp8-recipe tensorwise or delayed (one scale per weight)", r not in ("tensorwise", "delayed"))) if bad]
        if why:
            raise ConfigError(f"--fp8-param-gather needs {why[0]}")
    if args.fp8_amax_history_len < 1 or args.fp8_margin < 0:
        raise ConfigError(f"--fp8-amax-history-len {args.fp8_amax_history_len} must be >= 1 and --fp8-margin "
                          f"{args.fp8_margin} >= 0")
    if args.first_last_layers_bf16 and min(args.num_layers_at_start_in_bf16, args.num_layers_at_end_in_bf16) < 0:
        raise ConfigError("--num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16 must be >= 0")
    if r in ("rowwise", "blockwise") and args.context_parallel_size > 1:
        raise ConfigError(f"--fp8-recipe {r} with --context-parallel-size {args.context_parallel_size}: its "
                          "weight-gradient scales run along the tokens, which CP shares out; use tensorwise or delayed")
    if args.num_experts and args.moe_grouped_gemm:  # (Megatron's MoE FP8 scripts pass both)
        print_notices(["--moe-grouped-gemm with --fp8-format: the grouped GEMM kernel has no FP8 path yet, so the "
                       "experts' GEMMs run one by one in FP8 (megalite/moe/experts.py)"])
    if args.num_experts:
        etp = args.tensor_model_parallel_size if args.expert_tensor_parallel_size is None else \
            args.expert_tensor_parallel_size
        share = args.tensor_model_parallel_size * args.context_parallel_size
        if (etp * args.expert_model_parallel_size) % share:  # (a micro-batch's TP x CP ranks within ETP x EP's)
            raise ConfigError(f"--fp8-format with MoE experts: an expert would see only part of a micro-batch's tokens "
                              f"(expert-TP x EP = {etp * args.expert_model_parallel_size} ranks, not a multiple of "
                              f"TP x CP = {share}); use --expert-tensor-parallel-size equal to TP or a larger "
                              "--expert-model-parallel-size")
    not_yet = [what for what, on in (
        ("--fp8-param-gather of MoE experts (--num-experts)", args.num_experts and args.fp8_param_gather),
        ("--fp8-param-gather with semi-synchronous replicas", args.semi_sync_method and args.fp8_param_gather),
        ("--fp8-param-gather with fault-tolerant replicas", args.ft_lighthouse and args.fp8_param_gather)) if on]
    if not_yet:
        raise ConfigError(f"--fp8-format with {', '.join(not_yet)} is not built yet in megalite")
