"""The command line of the LR and weight-decay schedule (megalite/optimizer/lr_scheduler.py): --lr-decay-style and
WSD's flags, the weight decay's increment, Megatron's names and defaults, and their checks, each user error one
line."""

from megalite.config import ConfigError


def add_lr_schedule_flags(a):
    a("--lr-decay-style", default="linear", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
      help="WSD: warmup, --lr held, then annealed over the last --lr-wsd-decay-iters/samples of the decay")
    a("--lr-wsd-decay-style", default="exponential", choices=["exponential", "linear", "cosine", "minus_sqrt"])
    a("--lr-wsd-decay-iters", type=int, default=None, help="WSD's annealing iterations (with --train-iters)")
    a("--lr-wsd-decay-samples", type=int, default=None, help="WSD's annealing samples (with --train-samples)")
    a("--start-weight-decay", type=float, default=None, help="the weight decay at the start (linear/cosine increment)")
    a("--end-weight-decay", type=float, default=None, help="... and at the end of training")
    a("--weight-decay-incr-style", default="constant", choices=["constant", "linear", "cosine"],
      help="the weight decay from --start-weight-decay to --end-weight-decay over training (constant: --weight-decay)")


def validate_lr_schedule(args):
    _validate_weight_decay(args)
    _validate_wsd(args)


def _validate_weight_decay(args):
    """Megatron's rule: a constant weight decay is --weight-decay; an increment needs both ends."""
    given = [f for f, v in (("--start-weight-decay", args.start_weight_decay),
                            ("--end-weight-decay", args.end_weight_decay)) if v is not None]
    if args.weight_decay_incr_style == "constant":
        if given:
            raise ConfigError(f"{given[0]} is for --weight-decay-incr-style linear or cosine; a constant weight "
                              "decay is --weight-decay")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    elif len(given) < 2:
        raise ConfigError(f"--weight-decay-incr-style {args.weight_decay_incr_style} goes from --start-weight-decay "
                          "to --end-weight-decay: give both")
    elif not 0 <= args.start_weight_decay <= args.end_weight_decay:
        raise ConfigError(f"--weight-decay-incr-style {args.weight_decay_incr_style} increases the weight decay: "
                          f"0 <= --start-weight-decay {args.start_weight_decay} <= --end-weight-decay "
                          f"{args.end_weight_decay} does not hold")


def _validate_wsd(args):
    """--lr-decay-style WSD's annealing length: iterations with --train-iters, samples with --train-samples (as
    Megatron, which reads only that one); either one without WSD would do nothing."""
    given = [f for f, v in (("--lr-wsd-decay-iters", args.lr_wsd_decay_iters),
                            ("--lr-wsd-decay-samples", args.lr_wsd_decay_samples)) if v is not None]
    if args.lr_decay_style != "WSD":
        if given:
            raise ConfigError(f"{given[0]} is --lr-decay-style WSD's annealing length; add --lr-decay-style WSD or "
                              "drop it")
        return
    want = "--lr-wsd-decay-samples" if args.train_samples is not None else "--lr-wsd-decay-iters"
    if len(given) == 2 or given and want not in given:
        unread = [f for f in given if f != want][0]
        raise ConfigError(f"{unread} is not read with --{'train-samples' if 'samples' in want else 'train-iters'} "
                          f"(as Megatron): give {want} instead")
    if want not in given:
        raise ConfigError(f"--lr-decay-style WSD with --{'train-samples' if 'samples' in want else 'train-iters'} "
                          f"anneals over its last {want}: give it")
