"""Per-parameter facts the distributed machinery reads (DESIGN.md, "Seams"), in one place.

Models mark their parameters (tensor_model_parallel, sequence_parallel, shared_embedding,
expert_parallel); buckets, the optimizer, norms, replica checks and checkpoint writers ask here
which group a parameter belongs to and never re-derive it from names.
- Dense parameters: gradients reduced (averaged over DP, summed over CP) and ZeRO-sharded over
  DP x CP; one copy of each over TP x PP (TP-replicated ones counted on TP rank 0).
- Expert parameters (an MoE job's expert grid, process_groups._expert_groups): tensor-parallel over
  expert-TP; reduced and sharded over expert-DP, with the same divisor (DP: each EP rank's experts
  already summed the tokens of every EP rank's batch); one copy of each element over ETP x EP x PP.
Without an expert grid experts are dense parameters (expert-parallel size 1).
"""

import torch.distributed as dist

from megalite import parallel_state as ps


def is_expert(p):
    return bool(getattr(p, "expert_parallel", False)) and ps.has_expert_grid()


def data_parallel(p):
    """(group, size, rank) over which p's gradient is reduced and ZeRO shards it."""
    if is_expert(p):
        return (ps.get_expert_data_parallel_group(), ps.get_expert_data_parallel_world_size(),
                ps.get_expert_data_parallel_rank())
    return (ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_data_parallel_world_size(with_context_parallel=True),
            ps.get_data_parallel_rank(with_context_parallel=True))


def tensor_parallel(p):
    """(size, rank, group) of the tensor-parallel group p is sharded over (experts: expert-TP)."""
    if is_expert(p):
        return (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_group())


def counted_once(p):
    """Whether this rank counts p in whole-model sums: TP-replicated parameters on TP rank 0 only,
    the last pipeline stage's copy of tied word embeddings not at all."""
    if getattr(p, "shared_embedding", False) and not ps.is_pipeline_first_stage(ignore_virtual=True):
        return False
    return getattr(p, "tensor_model_parallel", False) or tensor_parallel(p)[1] == 0


def first_replica(p):
    """Whether this rank holds the first of p's data-parallel replicas (it writes p's checkpoint
    chunks unless ZeRO-3 shards them; TP ownership is the layout's)."""
    return data_parallel(p)[2] == 0


def split_dense_expert(params, values):
    """(dense values, expert values) of parallel lists."""
    dense, expert = [], []
    for p, v in zip(params, values):
        (expert if is_expert(p) else dense).append(v)
    return dense, expert


def _all_reduce(t, group, size):
    if size > 1 and dist.is_initialized():
        dist.all_reduce(t, group=group)


def sum_over_model(dense, expert, sharded):
    """World totals of per-rank partial sums (any shape, e.g. squared norms, zero counts) of this
    rank's dense and expert parameters, each element counted once (the caller skips TP duplicates
    and the tied copy). sharded: each rank holds a disjoint ZeRO slice (sum over its DP group too).
    The same on every rank."""
    if not ps.has_expert_grid():
        dense, expert = dense + expert, None
    if sharded:
        _all_reduce(dense, ps.get_data_parallel_group(with_context_parallel=True),
                    ps.get_data_parallel_world_size(with_context_parallel=True))
        if expert is not None:
            _all_reduce(expert, ps.get_expert_data_parallel_group(), ps.get_expert_data_parallel_world_size())
    mp = ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size()
    _all_reduce(dense, ps.get_model_parallel_group(), mp)
    if expert is None:
        return dense
    emp = ps.get_expert_tensor_and_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size()
    _all_reduce(expert, ps.get_expert_tensor_model_pipeline_parallel_group(), emp)
    return dense + expert
