"""The command line of the pipeline's schedule (megalite/pipeline/schedules.py; zero-bubble plans:
megalite/pipeline/zero_bubble.py): its flags and their checks, each user error one line."""

from megalite.config import ConfigError

SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
NOT_BUILT = ("zbv", "dualpipev")  # two chunks per rank in a V: the layout, checkpoints and tools do not know it yet


def add_pipeline_schedule_flags(a):
    a("--pipeline-schedule", default=None, choices=SCHEDULES,
      help="the pipeline's schedule (default 1f1b, interleaved with virtual stages); zb-h1: each backward split into "
           "B (the input gradient, sent at once) and W (the weight gradients, placed in the bubble): a third of "
           "1F1B's bubble at its activation memory (Qi et al., ICLR 2024)")
    a("--delay-wgrad-compute", action="store_true",
      help="Megatron's: the weight gradients computed apart from the input gradients; with a pipeline, "
           "--pipeline-schedule zb-h1")


def validate_pipeline_schedule(args):
    """Derive args.pipeline_schedule (one of SCHEDULES); refuse what it does not compose with, one line each."""
    pp, vp, given = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size, args.pipeline_schedule
    if args.delay_wgrad_compute:
        if given not in (None, "zb-h1"):
            raise ConfigError(f"--delay-wgrad-compute is --pipeline-schedule zb-h1's split, not {given}'s")
        given = "zb-h1"
    if given in NOT_BUILT:
        raise ConfigError(f"--pipeline-schedule {given} is not built yet in megalite (its two chunks per rank in a V): "
                          "use zb-h1, or interleaved for virtual stages")
    schedule = given or ("interleaved" if vp else "1f1b")
    if schedule == "interleaved" and not vp:
        raise ConfigError("--pipeline-schedule interleaved needs virtual stages (--num-layers-per-virtual-pipeline-"
                          "stage or --num-virtual-stages-per-pipeline-rank)")
    if schedule in ("1f1b", "zb-h1") and vp:
        raise ConfigError(f"--pipeline-schedule {schedule} runs one model chunk per rank: leave out the virtual "
                          "stages, or use interleaved")
    if schedule == "zb-h1":
        _check_zero_bubble(args, pp, "--delay-wgrad-compute" if args.delay_wgrad_compute and
                           not args.pipeline_schedule else "--pipeline-schedule zb-h1")
    args.pipeline_schedule = schedule


def _check_zero_bubble(args, pp, flag):
    if pp == 1:
        raise ConfigError(f"{flag} fills a pipeline's bubble: it needs --pipeline-model-parallel-size > 1")
    unbuilt = [other for other, given in (
        ("--recompute-granularity full", args.recompute_granularity == "full"),
        ("--zero-stage 3", args.use_distributed_optimizer and args.zero_stage == 3),
        ("--fp8-format", args.fp8_format is not None),
        ("--pipeline-model-parallel-layout auto", args.pipeline_model_parallel_layout == "auto")) if given]
    if unbuilt:
        raise ConfigError(f"{flag} with {unbuilt[0]} is not built yet in megalite")
