from megalite.distributed.finalize import allreduce_sequence_parallel_grads, finalize_model_grads
from megalite.distributed.grad_buffer import DistributedDataParallel

__all__ = ["DistributedDataParallel", "finalize_model_grads", "allreduce_sequence_parallel_grads"]
