"""The command line of the LR schedule's decay styles (megalite/optimizer/lr_scheduler.py): --lr-decay-style and
WSD's flags, Megatron's names and defaults, and their checks, each user error one line."""

from megalite.config import ConfigError


def add_lr_schedule_flags(a):
    a("--lr-decay-style", default="linear", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
      help="WSD: warmup, --lr held, then annealed over the last --lr-wsd-decay-iters/samples of the decay")
    a("--lr-wsd-decay-style", default="exponential", choices=["exponential", "linear", "cosine", "minus_sqrt"])
    a("--lr-wsd-decay-iters", type=int, default=None, help="WSD's annealing iterations (with --train-iters)")
    a("--lr-wsd-decay-samples", type=int, default=None, help="WSD's annealing samples (with --train-samples)")


def validate_lr_schedule(args):
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
    if want not in given:
        raise ConfigError(f"--lr-decay-style WSD with --{'train-samples' if 'samples' in want else 'train-iters'} "
                          f"anneals over its last {want}: give it")
