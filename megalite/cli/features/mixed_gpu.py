"""The command line of mixed GPUs of different memory and precision: a micro-batch size per
data-parallel replica (megalite/batching/iteration_plan.py; `auto`: megalite/training/memory_budget.py), optimizer CPU
offload (megalite/optimizer/offload.py) and a precision per replica, with their checks, each user
error one line."""

from megalite.config import ConfigError


def add_mixed_gpu_flags(a):
    a("--data-parallel-micro-batch-sizes", default=None,
      help="M0,M1,...: DP replica r runs micro-batches of M_r samples (a smaller GPU smaller ones; replaces "
           "--micro-batch-size in training); the update stays the single process's on the whole batch. auto: the "
           "largest that fits each replica's --device-memory-budget, measured before training")
    a("--device-memory-budget", default=None,
      help="GiB per GPU for --data-parallel-micro-batch-sizes auto / --optimizer-offload-fraction auto: one value "
           "or one per DP replica (default on CUDA: 0.9 x the free memory at start; required on CPU); for "
           "--pipeline-model-parallel-layout auto: one value or one per pipeline stage (on CPU: no cap if left out)")
    a("--pipeline-layout-profile-iters", type=int, default=2,
      help="with --pipeline-model-parallel-layout auto: forward-backward passes of one iteration's micro-batches "
           "timed before the stages are re-cut (the fastest counts)")
    a("--data-parallel-precisions", default=None,
      help="P0,P1,...: DP replica r computes in P_r (bf16, fp16 or fp32; e.g. bf16 on A100s, fp16 on V100s) with "
           "fp32 gradient reduction and main weights; any fp16 replica puts every replica under one dynamic loss "
           "scale, so an overflow anywhere skips the step everywhere")
    a("--optimizer-cpu-offload", action="store_true",
      help="keep the fp32 main weights and Adam states of --optimizer-offload-fraction of the optimizer in host "
           "memory and step them there (Megatron's hybrid-device optimizer)")
    a("--optimizer-offload-fraction", default=1.0,
      help="with --optimizer-cpu-offload: the fraction of each rank's optimizer elements on the host, one value "
           "or one per DP replica (e.g. 0,0.6: only replica 1's GPU is short of memory); auto: the smallest that "
           "fits --device-memory-budget")
    a("--overlap-cpu-optimizer-d2h-h2d", action="store_true",
      help="with --optimizer-cpu-offload: copy gradients down and weights up on a side stream, overlapping the "
           "device's part of the step")
    a("--use-torch-optimizer-for-cpu-offload", action="store_true",
      help="accepted: the host part runs torch's elementwise AdamW either way")
    a("--no-pin-cpu-grads", dest="pin_cpu_grads", action="store_false",
      help="accepted: host buffers are pinned on CUDA (needed for asynchronous copies)")
    a("--no-pin-cpu-params", dest="pin_cpu_params", action="store_false",
      help="accepted: host buffers are pinned on CUDA (needed for asynchronous copies)")


def _per_replica(text, flag, dp, convert, what, exact=False, unit="data-parallel"):
    """One value for every DP replica, or one per replica (exact: one per replica only), as a list;
    one ConfigError line. unit "pipeline": one per pipeline stage instead."""
    each = "data-parallel replica" if unit == "data-parallel" else "pipeline stage"
    try:
        values = [convert(v) for v in text.replace(" ", ",").split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give {what}, one value or one per {each}") from None
    if len(values) not in ((dp,) if exact else (1, dp)) or not values:
        raise ConfigError(f"{flag} {text!r} gives {len(values)} values for {unit} size {dp}; give one per {each}")
    return values


def validate_mixed_gpus(args):
    """Parse the lists (args.data_parallel_micro_batch_sizes: None or one int per DP rank;
    args.optimizer_offload_fraction: a float or a list of them) and refuse what does not compose."""
    dp, sizes = args.data_parallel_size, args.data_parallel_micro_batch_sizes
    _validate_budget(args)
    if is_auto(sizes):
        args.data_parallel_micro_batch_sizes = "auto"
    elif sizes is not None:
        flag = "--data-parallel-micro-batch-sizes"
        sizes = _per_replica(sizes, flag, dp, int, "positive integers", exact=True)
        if any(m < 1 for m in sizes):
            raise ConfigError(f"{flag} {args.data_parallel_micro_batch_sizes!r}: every size must be a positive "
                              "integer")
        args.data_parallel_micro_batch_sizes = sizes
    fraction = args.optimizer_offload_fraction
    if is_auto(fraction):
        args.optimizer_offload_fraction = "auto"
    elif isinstance(fraction, (str, float)):  # (a list once parsed)
        fraction = _per_replica(str(fraction), "--optimizer-offload-fraction", dp, float, "fractions in [0, 1]")
        if any(not 0.0 <= f <= 1.0 for f in fraction):
            raise ConfigError(f"--optimizer-offload-fraction {args.optimizer_offload_fraction!r}: every fraction "
                              "must lie in [0, 1]")
        args.optimizer_offload_fraction = fraction[0] if len(fraction) == 1 else fraction
    offload_only = [f for f, on in (("--overlap-cpu-optimizer-d2h-h2d", args.overlap_cpu_optimizer_d2h_h2d),
                                    ("--use-torch-optimizer-for-cpu-offload", args.use_torch_optimizer_for_cpu_offload),
                                    ("--optimizer-offload-fraction", args.optimizer_offload_fraction != 1.0))
                    if on]
    if offload_only and not args.optimizer_cpu_offload:
        raise ConfigError(f"{', '.join(offload_only)} need --optimizer-cpu-offload")


def check_uneven_composes(args, schedule):
    """ZeRO-3's parameter gathers and EP's token dispatches run once per micro-batch on every rank of
    their groups: with unequal shares or micro-batch sizes they compose only where every DP rank runs
    the same number of micro-batches in every reachable batch (e.g. shares 4,1 with sizes 4,1)."""
    from megalite.batching.iteration_plan import training_plan
    from megalite.config.batching import BatchingConfig
    sizes = args.data_parallel_micro_batch_sizes
    axes = [what for what, on in (("ZeRO-3 (its parameter all-gathers)", args.zero_stage == 3),
                                  ("--expert-model-parallel-size > 1 (its token dispatches)",
                                   args.expert_model_parallel_size > 1)) if on]
    if axes and sizes == "auto":
        raise ConfigError(f"--data-parallel-micro-batch-sizes auto with {' and '.join(axes)}: every rank must run the "
                          "same micro-batch count, which sizes chosen by memory do not keep; give the sizes")
    if not axes or args.data_parallel_shares == "auto":
        return
    plan = training_plan(BatchingConfig.of(args), schedule)
    for g in schedule.batch_sizes(0):
        counts = plan.counts_of(g)
        if len(set(counts)) > 1:
            given = " ".join(f for f, v in (("--data-parallel-shares", args.data_parallel_shares),
                                            ("--data-parallel-micro-batch-sizes", sizes)) if v)
            raise ConfigError(f"{given} give DP ranks {','.join(map(str, counts))} micro-batches of global batch {g}: "
                              f"with {' and '.join(axes)} every rank must run the same count; choose shares "
                              "proportional to the sizes, or drop one")


def is_auto(value):
    return isinstance(value, str) and value.strip().lower() == "auto"


def _validate_budget(args):
    """--device-memory-budget: GiB, one or one per DP replica (per pipeline stage for an auto layout);
    only with an `auto` that reads it."""
    budget, dp, pp = args.device_memory_budget, args.data_parallel_size, args.pipeline_model_parallel_size
    autos = [f for f, v in (("--data-parallel-micro-batch-sizes", args.data_parallel_micro_batch_sizes),
                            ("--optimizer-offload-fraction", args.optimizer_offload_fraction)) if is_auto(v)]
    layout_auto = is_auto(args.pipeline_model_parallel_layout)
    if layout_auto and autos:
        raise ConfigError(f"--pipeline-model-parallel-layout auto with {' and '.join(autos)} auto is not implemented "
                          "yet: choose the layout first, then size the replicas at it")
    if layout_auto:
        _validate_auto_layout(args)
    if isinstance(budget, str):  # one per stage for an auto layout, else one per replica
        n = pp if layout_auto else dp
        values = _per_replica(budget, "--device-memory-budget", n, float, "GiB",
                              unit="pipeline" if layout_auto else "data-parallel")
        if any(v <= 0 for v in values):
            raise ConfigError(f"--device-memory-budget {budget!r}: every budget must be positive (GiB)")
        args.device_memory_budget = values * n if len(values) == 1 else values
    if budget is not None and not autos and not layout_auto:
        raise ConfigError("--device-memory-budget sizes --data-parallel-micro-batch-sizes auto, "
                          "--optimizer-offload-fraction auto or --pipeline-model-parallel-layout auto; add one or "
                          "drop the budget")
    if not autos:
        return
    import torch
    if budget is None and not torch.cuda.is_available():
        raise ConfigError(f"{' and '.join(autos)} auto on CPU ranks need --device-memory-budget GiB (one, or one per "
                          "replica): there is no device memory to read")
    refused = [(bool(args.num_experts), "MoE models (profiling would count tokens for the routers)"),
               (args.rampup_batch_size is not None or getattr(args, "step_batch_size_schedule", None),
                "a growing batch (--rampup-batch-size / --step-batch-size-schedule)"),
               (args.semi_sync_method is not None, "semi-synchronous replicas")]
    for bad, what in refused:
        if bad:
            raise ConfigError(f"{' and '.join(autos)} auto does not compose with {what} yet; give the values")


def _validate_auto_layout(args):
    """--pipeline-model-parallel-layout auto (megalite/pipeline/auto_layout.py): what it balances."""
    flag = "--pipeline-model-parallel-layout auto"
    pp, L = args.pipeline_model_parallel_size, args.num_layers
    if args.pipeline_layout_profile_iters < 1:
        raise ConfigError(f"--pipeline-layout-profile-iters {args.pipeline_layout_profile_iters}: profile at least "
                          "one pass")
    if pp < 2:
        raise ConfigError(f"{flag} balances pipeline stages: it needs --pipeline-model-parallel-size > 1")
    if L < pp:
        raise ConfigError(f"{flag}: --num-layers {L} cannot give each of {pp} pipeline stages a layer")
    refused = [(args.num_layers_per_virtual_pipeline_stage is not None or
                (args.num_virtual_stages_per_pipeline_rank or 1) > 1,
                "interleaved stages (it cuts one contiguous stage per pipeline rank; give an interleaved layout "
                "by hand)"),
               (args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None
                or args.account_for_embedding_in_pipeline_split or args.account_for_loss_in_pipeline_split,
                "--decoder-first/last-pipeline-num-layers or --account-for-embedding/loss-in-pipeline-split (it "
                "sets every stage's layers)"),
               (bool(args.num_experts), "MoE models (profiling would count tokens for the routers)"),
               (args.recompute_granularity == "full", "--recompute-granularity full (what a stage keeps and "
                                                      "recomputes depends on the method and its layer count)"),
               (args.data_parallel_shares == "auto", "--data-parallel-shares auto"),
               (args.semi_sync_method is not None, "semi-synchronous replicas")]
    for bad, what in refused:
        if bad:
            raise ConfigError(f"{flag} does not compose with {what} yet")


PRECISIONS = ("bf16", "fp16", "fp32")


def validate_precisions(args):
    """--data-parallel-precisions: one of PRECISIONS per DP replica; refuses what does not compose
    (run after the ZeRO flags are derived)."""
    text = args.data_parallel_precisions
    if text is None or isinstance(text, list):
        return
    values = _per_replica(text, "--data-parallel-precisions", args.data_parallel_size, lambda v: v.strip().lower(),
                          "precisions", exact=True)
    flag = f"--data-parallel-precisions {text!r}"
    if any(v not in PRECISIONS for v in values):
        raise ConfigError(f"{flag}: each must be one of {', '.join(PRECISIONS)}")
    refused = [(args.bf16 or args.fp16, "--bf16 / --fp16 (the list sets each replica's; drop them)"),
               (args.use_distributed_optimizer, "the distributed optimizer (ZeRO all-gathers parameters in the "
                                                "model's dtype, which differs between replicas)"),
               (args.expert_model_parallel_size > 1, "--expert-model-parallel-size > 1 (tokens cross replicas)"),
               (args.semi_sync_method is not None, "semi-synchronous replicas (untested)")]
    for bad, what in refused:
        if bad:
            raise ConfigError(f"{flag} does not compose with {what}")
    args.data_parallel_precisions = values
