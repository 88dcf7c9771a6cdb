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

import dataclasses

import torch.distributed as dist

from megalite import parallel_state as ps


@dataclasses.dataclass(frozen=True)
class Facts:
    """One parameter's place in its grid, derived once (DistributedDataParallel stamps it at wrap time)."""
    grid: object
    expert: bool
    data_parallel: tuple  # (group, size, rank): where its gradient is reduced and ZeRO shards it
    tensor_parallel: tuple  # (size, rank, group): what its weight is sharded over (experts: expert-TP)
    counted_once: bool  # counted in whole-model sums on this rank
    first_replica: bool  # this rank holds its first data-parallel replica

    def __deepcopy__(self, memo):  # a copied model keeps its parameters' place (groups are handles)
        return self


def derive(p, grid):
    """p's facts in `grid` (the one derivation: everything else reads them)."""
    expert = bool(getattr(p, "expert_parallel", False)) and grid.experts
    dp = grid.expert_dp() if expert else grid.dp_cp()
    tp = (*grid.expert_tp(), grid.expert_tp_group()) if expert else (grid.tp, grid.tp_rank, grid.tp_group)
    tied_copy = getattr(p, "shared_embedding", False)  # (only a later stage's copy is marked: counted once)
    counted = not tied_copy and (getattr(p, "tensor_model_parallel", False) or tp[1] == 0)
    return Facts(grid, expert, dp, tp, counted, dp[2] == 0)


def stamp(params, grid):
    """Set each parameter's facts in `grid` (DistributedDataParallel's wrap)."""
    for p in params:
        p.megalite_facts = derive(p, grid)


def facts(p):
    """p's stamped facts; a parameter never wrapped (a bare model, a planner's) in the global grid."""
    f = getattr(p, "megalite_facts", None)
    return f if f is not None else derive(p, ps.current_grid())


def grid_of_params(params):
    """The grid of these parameters' facts (all of one model), the global one for none."""
    params = list(params)
    return facts(params[0]).grid if params else ps.current_grid()


def is_expert(p):
    return facts(p).expert


def data_parallel(p):
    """(group, size, rank) over which p's gradient is reduced and ZeRO shards it."""
    return facts(p).data_parallel


def tensor_parallel(p):
    """(size, rank, group) of the tensor-parallel group p is sharded over (experts: expert-TP)."""
    return facts(p).tensor_parallel


def counted_once(p):
    """Whether this rank counts p in whole-model sums: TP-replicated parameters on TP rank 0 only,
    the last pipeline stage's copy of tied word embeddings not at all."""
    return facts(p).counted_once


def first_replica(p):
    """Whether this rank holds the first of p's data-parallel replicas (it writes p's checkpoint
    chunks unless ZeRO-3 shards them; TP ownership is the layout's)."""
    return facts(p).first_replica


def split_dense_expert(params, values):
    """(dense values, expert values) of parallel lists."""
    dense, expert = [], []
    for p, v in zip(params, values):
        (expert if is_expert(p) else dense).append(v)
    return dense, expert


def _all_reduce(t, group, size):
    if size > 1 and dist.is_initialized():
        dist.all_reduce(t, group=group)


def sum_over_model(dense, expert, sharded, grid):
    """World totals of per-rank partial sums (any shape, e.g. squared norms, zero counts) of this
    rank's dense and expert parameters, each element counted once (the caller skips TP duplicates
    and the tied copy). sharded: each rank holds a disjoint ZeRO slice (sum over its DP group too).
    grid: the parameters' (facts(p).grid). The same on every rank."""
    g = grid
    if not g.experts:
        dense, expert = dense + expert, None
    if sharded:
        _all_reduce(dense, *g.dp_cp()[:2])
        if expert is not None:
            _all_reduce(expert, *g.expert_dp()[:2])
    _all_reduce(dense, g.mp_group, g.tp * g.pp)
    if expert is None:
        return dense
    _all_reduce(expert, g.expert_model_group(), g.etp * g.ep * g.pp)
    return dense + expert
