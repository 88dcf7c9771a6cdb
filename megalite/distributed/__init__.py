from megalite.distributed.finalize import allreduce_sequence_parallel_grads, finalize_model_grads
from megalite.config.ddp import DistributedDataParallelConfig
from megalite.distributed.grad_buffer import DistributedDataParallel

__all__ = ["DistributedDataParallel", "DistributedDataParallelConfig", "finalize_model_grads",
           "allreduce_sequence_parallel_grads"]
