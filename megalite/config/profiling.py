"""What the profiler part of the loop (training/profiler.py) is built from: Megatron's profiling flags."""

import dataclasses

from megalite.config.section import Section


@dataclasses.dataclass(frozen=True)
class ProfilingConfig(Section):
    profile: bool
    use_pytorch_profiler: bool  # (else nsys' capture range: cudaProfilerStart / Stop, NVTX ranges)
    profile_step_start: int
    profile_step_end: int
    profile_ranks: list  # global ranks that profile
    pytorch_profiler_collect_shapes: bool
    pytorch_profiler_collect_callstack: bool
    tensorboard_dir: str  # where torch.profiler's traces go (TensorBoard's profile plugin reads them)
