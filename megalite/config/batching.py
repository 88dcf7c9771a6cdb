"""What the run's batches are planned from (batching/iteration_plan.py): the global batch and its schedule
(ramp-up or steps), the micro-batch size, the data-parallel ranks and their shares or sizes (mixed GPUs), the
pipeline's interleaving groups, and semi-synchronous replicas."""

import dataclasses

from megalite.config.section import Section


@dataclasses.dataclass(frozen=True)
class BatchingConfig(Section):
    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int
    rampup_batch_size: list
    step_batch_size_schedule: str
    seq_length: int  # (a step schedule's thresholds may be in tokens)
    data_parallel_shares: object  # a list, "auto" or None
    data_parallel_micro_batch_sizes: object  # a list, "auto" or None
    data_parallel_shares_profile_iters: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int
    microbatch_group_size_per_virtual_pipeline_stage: int
    pipeline_schedule: str  # (zbv's two chunks per rank are not interleaving: any micro-batch count)
    semi_sync_replicas: int
