"""The command line of the pipeline's schedule (megalite/pipeline/schedules.py; zero-bubble plans:
megalite/pipeline/zero_bubble.py): its flags and their checks, each user error one line."""

from megalite.config import ConfigError
from megalite.parallel.pipeline_stages import V_SCHEDULES

SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")


def add_pipeline_schedule_flags(a):
    a("--pipeline-schedule", default=None, choices=SCHEDULES,
      help="the pipeline's schedule (default 1f1b, interleaved with virtual stages); zb-h1: each backward split into "
           "B (the input gradient, sent at once) and W (the weight gradients, placed in the bubble): a third of "
           "1F1B's bubble at its activation memory (Qi et al., ICLR 2024); zbv: the same split over two model chunks "
           "per rank placed in a V (the last rank holds the first and the last stage): almost no bubble, at 1F1B's "
           "activation memory; dualpipev: ZB-V's V in DeepSeek's DualPipe order (one chunk's forward beside the "
           "other's backward), at least 2 x PP micro-batches")
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
    if schedule in V_SCHEDULES:
        _check_zero_bubble(args, pp, f"--pipeline-schedule {schedule}")
        _check_v(args, vp, schedule)
    if schedule == "dualpipev" and args.data_parallel_shares == "auto":
        raise ConfigError("--pipeline-schedule dualpipev with --data-parallel-shares auto is not built yet in "
                          "megalite (a share could fall below its 2 x PP micro-batches): give the shares")
    args.pipeline_schedule = schedule


def v_split(args):
    """--pipeline-schedule zbv | dualpipev with the layers left to split (no virtual stages, no layout given): two
    chunks per rank, the layers even over the 2 PP stages (megalite/parallel/pipeline_stages.py places them)."""
    pp, L = args.pipeline_model_parallel_size, args.num_layers
    if pp == 1 or args.decoder_first_pipeline_num_layers is not None or \
            args.decoder_last_pipeline_num_layers is not None:
        return  # (refused by validate_pipeline_schedule, one line)
    if L % (2 * pp):
        raise ConfigError(f"--pipeline-schedule {args.pipeline_schedule} cuts the model into 2 x "
                          f"--pipeline-model-parallel-size {pp} = {2 * pp} stages: --num-layers {L} does not divide "
                          "evenly; change one, or give every stage's layers with --pipeline-model-parallel-layout")
    args.virtual_pipeline_model_parallel_size = 2


def _check_v(args, vp, schedule):
    if args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None:
        raise ConfigError(f"--pipeline-schedule {schedule} with --decoder-first/last-pipeline-num-layers: its V puts "
                          "the first and the last stage on one rank; give every stage's layers with "
                          "--pipeline-model-parallel-layout instead")
    if vp != 2:
        raise ConfigError(f"--pipeline-schedule {schedule} runs two model chunks per rank (its V), not {vp or 1}: "
                          "leave out the virtual stages, or give 2 per rank (a --pipeline-model-parallel-layout of "
                          f"{2 * args.pipeline_model_parallel_size} stages)")
    if args.microbatch_group_size_per_virtual_pipeline_stage is not None:
        raise ConfigError("--microbatch-group-size-per-virtual-pipeline-stage groups interleaved 1F1B's "
                          f"micro-batches; --pipeline-schedule {schedule} has its own plan: leave it out")


def _check_zero_bubble(args, pp, flag):
    if pp == 1:
        raise ConfigError(f"{flag} fills a pipeline's bubble: it needs --pipeline-model-parallel-size > 1")
    if args.pipeline_model_parallel_layout == "auto":
        raise ConfigError(f"{flag} with --pipeline-model-parallel-layout auto is not built yet in megalite")
