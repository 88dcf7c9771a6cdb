"""The command line of the profiler (megalite/training/profiler.py): Megatron's --profile flags, names and defaults,
and their checks, each user error one line."""

import torch

from megalite.config import ConfigError


def add_profiling_flags(a):
    a("--profile", action="store_true",
      help="profile iterations --profile-step-start to --profile-step-end: with --use-pytorch-profiler into "
           "--tensorboard-dir, else as nsys' capture range (CUDA)")
    a("--use-pytorch-profiler", action="store_true", help="--profile with torch.profiler (TensorBoard traces)")
    a("--profile-step-start", type=int, default=10)
    a("--profile-step-end", type=int, default=12)
    a("--profile-ranks", type=int, nargs="+", default=[0], help="the global ranks that profile")
    a("--pytorch-profiler-collect-shapes", action="store_true", help="torch.profiler records input shapes")
    a("--pytorch-profiler-collect-callstack", action="store_true", help="torch.profiler records Python stacks")


def validate_profiling(args):
    if not args.profile:
        if args.use_pytorch_profiler:
            raise ConfigError("--use-pytorch-profiler picks --profile's profiler; add --profile")
        return
    if not 0 <= args.profile_step_start < args.profile_step_end:
        raise ConfigError(f"--profile profiles iterations --profile-step-start {args.profile_step_start} to "
                          f"--profile-step-end {args.profile_step_end}: it needs 0 <= start < end")
    if args.use_pytorch_profiler and not args.tensorboard_dir:
        raise ConfigError("--profile --use-pytorch-profiler writes its traces to --tensorboard-dir: give one")
    if not args.use_pytorch_profiler and not torch.cuda.is_available():
        raise ConfigError("--profile without --use-pytorch-profiler opens nsys' capture range (cudaProfilerStart), "
                          "which needs CUDA; add --use-pytorch-profiler")
