"""How the data-parallel wrapper reduces and shards gradients and parameters (Megatron's
DistributedDataParallelConfig): the typed section DistributedDataParallel is built from (config/from_flags.py makes
it from the flags); what a run's plan decides (the gradient divisor of uneven shares, one reduction per iteration)
and the compressor object stay the wrapper's own arguments."""

from dataclasses import dataclass


@dataclass(frozen=True)
class DistributedDataParallelConfig:
    bucket_size: int = 40_000_000  # --ddp-bucket-size: elements per gradient bucket
    overlap_grad_reduce: bool = True  # buckets reduce during the backward as they fill
    use_distributed_optimizer: bool = False  # ZeRO: gradients reduce-scattered, states sharded
    zero_stage: int = 1  # with the distributed optimizer: 1, 2 (gradients sharded) or 3 (parameters too)
    overlap_param_gather: bool = False  # ZeRO-1/2: the next forward waits per bucket for its all-gather
    hierarchical: bool = False  # --hierarchical-grad-reduce: the plain all-reduce through the node groups
    prefetch: bool = True  # ZeRO-3: the next unit gathered while this one computes (distributed/param_units.py)
    reshard_after_forward: bool = True  # ZeRO-3: a unit's gathered weights freed after its forward
    grad_reduce_in_bf16: bool = False  # --grad-reduce-in-bf16: the buckets sent in bf16 (accumulated in fp32)
