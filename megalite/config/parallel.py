"""What the grid (parallel/, parallel_state.initialize_model_parallel) and its process group are built from: the
parallel sizes, their order and nesting, the backend and its timeout, and the seed its RNG streams derive from."""

import dataclasses

from megalite.config.section import Section


@dataclasses.dataclass(frozen=True)
class ParallelConfig(Section):
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int
    pipeline_schedule: str  # (zbv: the stages placed in a V, megalite/parallel/pipeline_stages.py)
    context_parallel_size: int
    hierarchical_context_parallel_sizes: list
    data_parallel_size: int  # (derived by validation from the world size)
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int
    num_experts: int  # (no experts: no expert grid)
    use_tp_pp_dp_mapping: bool
    hierarchical_grad_reduce: bool  # (the node groups it reduces through)
    semi_sync_replicas: int  # replicas, each its own inner grid
    distributed_backend: str
    distributed_timeout_minutes: float
    seed: int  # the tensor-parallel RNG streams (model_parallel_manual_seed)
