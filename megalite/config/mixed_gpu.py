"""What replicas on GPUs of other speeds, memories and precisions are built from (training/memory_budget.py, the
replicas' main weights, their checks): shares, micro-batch sizes, precisions, memory budgets, offload fractions."""

import dataclasses

from megalite.config.batching import BatchingConfig
from megalite.config.data import LoaderConfig
from megalite.config.section import DERIVED, Section


@dataclasses.dataclass(frozen=True)
class MixedGpuConfig(Section):
    data_parallel_shares: object  # a list, "auto" or None
    data_parallel_micro_batch_sizes: object  # a list, "auto" or None
    data_parallel_precisions: list
    device_memory_budget: list  # GiB per DP replica (None: the device's free memory)
    optimizer_offload_fraction: object  # a fraction, a list of them or "auto"
    pipeline_model_parallel_size: int
    batching: BatchingConfig = dataclasses.field(metadata=DERIVED)  # (the profiled step's schedule)
    loader: LoaderConfig = dataclasses.field(metadata=DERIVED)  # (the profiled passes' batches)

    @classmethod
    def of(cls, args):
        return super().of(args, batching=BatchingConfig.of(args), loader=LoaderConfig.of(args))
