"""The command line of fault-tolerant replicas on torchft (megalite/training/ft.py): each replica is its own torchrun
job (its own TP x CP x PP and inner DP); torchft's Lighthouse forms a quorum of the live ones every step, and a
replica that dies does not stop the others. Its flags and their checks, each user error one line."""

import importlib.util
import os

from megalite.config import ConfigError

ENV_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"  # torchft's own variable for the Lighthouse's address


def add_ft_flags(a):
    a("--ft-lighthouse", default=None, metavar="HOST:PORT",
      help=f"torchft's Lighthouse (torchft_lighthouse --min_replicas N): this job is one fault-tolerant replica "
           f"(default: ${ENV_LIGHTHOUSE} when --ft-replica-id is given)")
    a("--ft-replica-id", type=int, default=None,
      help="this replica's number (0, 1, ...): each replica is its own torchrun job with the same flags")
    a("--ft-replica-share", type=_share, default=1,
      help="this replica's weight in the split of each global batch over the live replicas (e.g. 2 for a replica "
           "twice as fast; micro-batches dealt out in proportion, at least one each), or auto: every replica times "
           "its first --ft-share-profile-iters iterations and the batch is split by the measured speeds")
    a("--ft-share-profile-iters", type=int, default=3,
      help="--ft-replica-share auto: the iterations each replica times (its fastest per micro-batch counts)")
    a("--ft-min-replicas", type=int, default=1,
      help="a step commits only with at least this many live replicas; below it training waits (torchft's "
           "min_replica_size)")
    a("--ft-timeout", type=float, default=60.0,
      help="seconds for a cross-replica collective, a commit vote or a heal transfer (torchft's timeout)")
    a("--ft-quorum-timeout", type=float, default=60.0, help="seconds to wait for a quorum (torchft's quorum_timeout)")
    a("--ft-connect-timeout", type=float, default=60.0,
      help="seconds to reach the Lighthouse and the other replicas' managers (torchft's connect_timeout)")
    a("--ft-heartbeat-ms", type=int, default=100,
      help="milliseconds between this replica's heartbeats to the Lighthouse (torchft's heartbeat_interval)")


# what fault-tolerant replicas do not compose with yet: (the flag's dest, how it reads on the command line)
_NOT_YET = (
    ("data_parallel_shares", "--data-parallel-shares"),
    ("data_parallel_micro_batch_sizes", "--data-parallel-micro-batch-sizes"),
    ("rampup_batch_size", "--rampup-batch-size"),
    ("step_batch_size_schedule", "--step-batch-size-schedule"),
    ("optimizer_cpu_offload", "--optimizer-cpu-offload"),
    ("calculate_per_token_loss", "--calculate-per-token-loss"),
)


def _share(text):
    """--ft-replica-share: a positive integer or auto (checked by validate_ft, one line)."""
    return "auto" if text.strip().lower() == "auto" else int(text)


def validate_ft(args):
    """The Lighthouse's address (flag or $TORCHFT_LIGHTHOUSE), torchft installed, the flags that compose."""
    if args.ft_replica_id is not None and args.ft_lighthouse is None:
        args.ft_lighthouse = os.environ.get(ENV_LIGHTHOUSE)
        if not args.ft_lighthouse:
            raise ConfigError(f"--ft-replica-id {args.ft_replica_id} needs --ft-lighthouse HOST:PORT (or "
                              f"${ENV_LIGHTHOUSE}): the torchft_lighthouse every replica reports to")
    if args.ft_lighthouse is None:
        return
    if args.ft_replica_id is None or args.ft_replica_id < 0:
        raise ConfigError("--ft-lighthouse needs --ft-replica-id 0, 1, ...: each replica's own number")
    if args.ft_replica_share != "auto" and args.ft_replica_share < 1:
        raise ConfigError(f"--ft-replica-share {args.ft_replica_share} must be a positive integer or auto")
    if args.ft_share_profile_iters < 1:
        raise ConfigError(f"--ft-share-profile-iters {args.ft_share_profile_iters} must be at least 1")
    if args.ft_min_replicas < 1:
        raise ConfigError(f"--ft-min-replicas {args.ft_min_replicas} must be at least 1")
    for name in ("ft_timeout", "ft_quorum_timeout", "ft_connect_timeout", "ft_heartbeat_ms"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    used = [flag for dest, flag in _NOT_YET if getattr(args, dest, None) not in (None, False)]
    if used:
        raise ConfigError(f"--ft-lighthouse with {', '.join(used)} is not built yet in megalite: fault-tolerant "
                          "replicas deal each global batch out evenly and reduce plain gradients")
    if args.semi_sync_method:
        _validate_rounds(args)
    if args.pipeline_model_parallel_layout == "auto":
        raise ConfigError("--ft-lighthouse with --pipeline-model-parallel-layout auto is not built yet in megalite: "
                          "give the layout")
    if importlib.util.find_spec("torchft") is None:  # (not imported here: training/ft.py sets its log level first)
        raise ConfigError("--ft-lighthouse needs torchft: pip install 'megalite[ft]'")


def _validate_rounds(args):
    """Semi-synchronous replicas under faults: every fault-tolerant replica is one semi-synchronous replica, the
    same H inner steps per round for all, whole outer steps in fp32."""
    if args.ft_replica_share == "auto":
        raise ConfigError("--ft-replica-share auto with --semi-sync-method is not built yet in megalite: give each "
                          "replica's share")
    if args.semi_sync_replicas != 1:
        raise ConfigError(f"--ft-lighthouse with --semi-sync-replicas {args.semi_sync_replicas}: each fault-tolerant "
                          "replica (its own job) is one semi-synchronous replica; drop --semi-sync-replicas")
    bad = [flag for flag, on in (("--semi-sync-steps auto", args.semi_sync_auto),
                                 ("--semi-sync-async", args.semi_sync_async),
                                 ("--semi-sync-quantize", args.semi_sync_quantize),
                                 ("--semi-sync-fragments/-delay/-alpha (streaming)",
                                  args.semi_sync_fragments != 1 or args.semi_sync_fragment_delay
                                  or args.semi_sync_fragment_alpha)) if on]
    if bad:
        raise ConfigError(f"--ft-lighthouse with {', '.join(bad)} is not built yet in megalite: fault-tolerant "
                          "semi-synchronous replicas run whole outer steps in fp32 every --semi-sync-steps H")
