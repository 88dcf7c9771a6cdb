"""The command line of semi-synchronous training (megalite/distributed/semi_sync.py): its flags and
their checks, each user error one line."""

from megalite.config import ConfigError

METHODS = ("local_sgd", "diloco")
DEFAULT_STEPS = 100


def add_semi_sync_flags(a):
    a("--semi-sync-method", default=None, choices=METHODS,
      help="replicas train on their own and meet every --semi-sync-steps inner steps: local_sgd averages "
           "their weights, diloco applies an outer Nesterov SGD step to their averaged pseudo-gradient")
    a("--semi-sync-replicas", type=int, default=None,
      help="model copies (consecutive blocks of data-parallel ranks; default: one per DP rank)")
    a("--semi-sync-steps", default=None,
      help=f"inner steps between outer steps: H, or H0,H1,... one per replica (a faster replica runs more), or "
           f"auto[:H] (the first round H steps each, timed; then the fastest replica H, the others in proportion "
           f"to their speed); default {DEFAULT_STEPS}")
    a("--semi-sync-fragments", type=int, default=1,
      help="Streaming DiLoCo: K fragments of contiguous layers, fragment i synced at its own offset in the round")
    a("--semi-sync-fragment-delay", type=int, default=0,
      help="Streaming: a fragment's outer all-reduce overlaps this many inner steps before it is applied")
    a("--semi-sync-fragment-alpha", type=float, default=0.0,
      help="Streaming: the local weights become alpha x local + (1 - alpha) x global at a fragment's update")
    a("--semi-sync-quantize", default=None, choices=["bf16", "fp8"],
      help="send the outer step's contributions in bf16 or fp8 (e4m3, a scale per row of 256), all-gathered and "
           "summed in fp32; the outer step itself stays fp32")
    a("--semi-sync-async", action="store_true",
      help="asynchronous outer updates: a replica that finished its inner steps sends its pseudo-gradient and goes "
           "on from the newest global weights without waiting (delayed Nesterov; not deterministic)")
    a("--semi-sync-max-staleness", type=int, default=None,
      help="--semi-sync-async: a replica runs at most this many rounds ahead of the slowest one (default 1; 0 is "
           "the synchronous schedule)")
    a("--outer-lr", type=float, default=None, help="diloco: the outer SGD's learning rate (default 0.7)")
    a("--outer-momentum", type=float, default=None, help="diloco: the outer SGD's momentum (default 0.9)")
    a("--no-outer-nesterov", dest="outer_nesterov", action="store_false", default=True,
      help="diloco: plain momentum instead of Nesterov's")


def validate_semi_sync(args):
    """Derive args.semi_sync_replicas (an int) and args.semi_sync_steps (one int per replica); refuse what
    does not compose, one line each."""
    given = [f for f, v in (("--semi-sync-replicas", args.semi_sync_replicas),
                            ("--semi-sync-steps", args.semi_sync_steps),
                            ("--outer-lr", args.outer_lr), ("--outer-momentum", args.outer_momentum),
                            ("--semi-sync-quantize", args.semi_sync_quantize),
                            ("--no-outer-nesterov", None if args.outer_nesterov else True),
                            ("--semi-sync-async", args.semi_sync_async or None),
                            ("--semi-sync-max-staleness", args.semi_sync_max_staleness)) if v is not None]
    streaming = [f for f, v, d in (("--semi-sync-fragments", args.semi_sync_fragments, 1),
                                   ("--semi-sync-fragment-delay", args.semi_sync_fragment_delay, 0),
                                   ("--semi-sync-fragment-alpha", args.semi_sync_fragment_alpha, 0.0)) if v != d]
    given += streaming
    if args.semi_sync_method is None:
        if given:
            raise ConfigError(f"{', '.join(given)} need --semi-sync-method local_sgd or diloco")
        args.semi_sync_replicas, args.semi_sync_steps, args.semi_sync_auto = 1, None, False
        return
    dp = args.data_parallel_size
    fault_tolerant = args.ft_lighthouse is not None or args.ft_replica_id is not None  # each job one replica
    r = (1 if fault_tolerant else dp) if args.semi_sync_replicas is None else args.semi_sync_replicas
    if r < 1 or dp % r:
        raise ConfigError(f"--semi-sync-replicas {r} must divide the data-parallel size {dp} (each replica is a block "
                          "of consecutive DP ranks)")
    args.semi_sync_replicas = r
    args.semi_sync_auto = str(args.semi_sync_steps).strip().lower().startswith("auto")
    args.semi_sync_steps = _steps(args.semi_sync_steps, r)
    if args.semi_sync_method == "local_sgd":
        if args.semi_sync_quantize:
            raise ConfigError("--semi-sync-quantize sends pseudo-gradients in low precision; local_sgd sends weights: "
                              "use --semi-sync-method diloco --outer-lr 1 --outer-momentum 0 (the same average)")
        wrong = [f for f in given if f in ("--outer-lr", "--outer-momentum", "--no-outer-nesterov")]
        if wrong:
            raise ConfigError(f"{', '.join(wrong)}: local_sgd averages the replicas' weights (no outer optimizer); "
                              "use --semi-sync-method diloco for an outer SGD")
        args.outer_lr, args.outer_momentum = 1.0, 0.0
    else:
        args.outer_lr = 0.7 if args.outer_lr is None else args.outer_lr
        args.outer_momentum = 0.9 if args.outer_momentum is None else args.outer_momentum
        if args.outer_lr <= 0 or not 0 <= args.outer_momentum < 1:
            raise ConfigError(f"--outer-lr {args.outer_lr} must be > 0 and --outer-momentum {args.outer_momentum} in "
                              "[0, 1)")
    round_ = max(args.semi_sync_steps)
    if streaming:
        _validate_streaming(args, round_)
    if args.semi_sync_async:
        _validate_async(args, given)
    elif args.semi_sync_max_staleness is not None:
        raise ConfigError("--semi-sync-max-staleness bounds --semi-sync-async; add it or drop the staleness")
    for flag in ("eval_interval", "save_interval", "exit_interval"):
        v = getattr(args, flag, None)
        if v and v % round_:
            raise ConfigError(f"--{flag.replace('_', '-')} {v} must be a multiple of the outer-step interval "
                              f"{round_} (--semi-sync-steps): replicas hold the global weights only after an outer "
                              "step")
    refused = [(args.data_parallel_shares == "auto", "--data-parallel-shares auto (it times all DP ranks each step)"),
               (args.hierarchical_grad_reduce, "--hierarchical-grad-reduce"),
               (args.data_parallel_micro_batch_sizes == "auto", "--data-parallel-micro-batch-sizes auto"),
               (args.grad_compression != "none", "--grad-compression"),
               (args.train_samples is not None, "--train-samples (rounds count inner steps: use --train-iters)"),
               (args.moe_router_enable_expert_bias and (streaming or args.semi_sync_async),
                "--moe-router-enable-expert-bias with streaming or --semi-sync-async (the bias is averaged over the "
                "replicas at whole outer steps only)"),
               (getattr(args, "rerun_mode", "disabled") != "disabled", "--rerun-mode (its checks span the world)"),
               (args.exit_signal_handler or args.exit_duration_in_mins, "--exit-signal-handler / "
                                                                        "--exit-duration-in-mins")]
    for bad, what in refused:
        if bad:
            raise ConfigError(f"--semi-sync-method {args.semi_sync_method} does not compose with {what} yet")


def _validate_streaming(args, round_):
    k, tau, alpha = args.semi_sync_fragments, args.semi_sync_fragment_delay, args.semi_sync_fragment_alpha
    if k < 1 or k > round_ or k > args.num_layers:
        raise ConfigError(f"--semi-sync-fragments {k} must be between 1 and the inner steps per round ({round_}) and "
                          f"the layers ({args.num_layers})")
    if tau < 0 or tau >= round_ / k:
        raise ConfigError(f"--semi-sync-fragment-delay {tau} must be >= 0 and below the steps between two fragments' "
                          f"syncs (--semi-sync-steps {round_} / --semi-sync-fragments {k} = {round_ / k:g})")
    if not 0 <= alpha < 1:
        raise ConfigError(f"--semi-sync-fragment-alpha {alpha} must be in [0, 1)")
    if len(set(args.semi_sync_steps)) > 1 or args.semi_sync_auto:
        raise ConfigError("streaming (--semi-sync-fragments / -delay / -alpha) needs one --semi-sync-steps H for "
                          "every replica (not uneven counts or auto)")
    given = [f"--{f.replace('_', '-')}" for f in ("eval_interval", "save_interval", "exit_interval")
             if getattr(args, f, None)]
    if given:
        raise ConfigError(f"{', '.join(given)}: with streaming the replicas hold the global weights only at the end "
                          "of training (fragments sync at staggered steps); evaluate and save at the end")


def _validate_async(args, given):
    s = args.semi_sync_max_staleness = 1 if args.semi_sync_max_staleness is None else args.semi_sync_max_staleness
    if s < 0:
        raise ConfigError(f"--semi-sync-max-staleness {s} must be >= 0 (rounds a replica may run ahead)")
    h = args.semi_sync_steps[0]
    if len(set(args.semi_sync_steps)) > 1 or args.semi_sync_auto:
        raise ConfigError("--semi-sync-async needs one --semi-sync-steps H (a faster replica trains more rounds "
                          "instead of more steps per round)")
    if args.train_iters is None or args.train_iters % h:
        raise ConfigError(f"--semi-sync-async: --train-iters {args.train_iters} must be a multiple of "
                          f"--semi-sync-steps {h} (the work is cut into rounds of H inner steps)")
    bad = [f for f in given if f.startswith("--semi-sync-fragment") or f == "--semi-sync-quantize"]
    bad += [f"--{f.replace('_', '-')}" for f in ("eval_interval", "save_interval", "exit_interval")
            if getattr(args, f, None) and getattr(args, f) < args.train_iters]
    bad += ["--data-parallel-shares"] if args.data_parallel_shares else []
    bad += ["--rampup-batch-size"] if getattr(args, "rampup_batch_size", None) else []
    if bad:
        raise ConfigError(f"--semi-sync-async does not compose with {', '.join(bad)}: replicas hold the same weights "
                          "only at the end (evaluate and save there), train equal parts of each round and send fp32")


def _steps(text, replicas):
    if text is None:
        return [DEFAULT_STEPS] * replicas
    if text.strip().lower().startswith("auto"):
        h = text.strip()[4:].lstrip(":") or str(DEFAULT_STEPS)
        if not h.isdigit() or int(h) < 2:
            raise ConfigError(f"--semi-sync-steps {text!r}: auto or auto:H with H >= 2 inner steps per round")
        return [int(h)] * replicas
    try:
        steps = [int(s) for s in text.replace(" ", ",").split(",") if s]
    except ValueError:
        raise ConfigError(f"--semi-sync-steps {text!r}: give a positive integer, or one per replica") from None
    if len(steps) == 1:
        steps *= replicas
    if len(steps) != replicas or any(h < 1 for h in steps):
        raise ConfigError(f"--semi-sync-steps {text!r}: give one positive integer, or one per replica "
                          f"({replicas} replicas)")
    return steps
