"""The process-group grid: tensor (TP) x context (CP) x data (DP) x pipeline (PP) parallel.

Rank order follows Megatron-LM: TP varies fastest, then CP, then DP, then PP,
    rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank))
(or, with Megatron's --use-tp-pp-dp-mapping, PP before DP: tp + TP * (cp + CP * (pp + PP * dp)))
so that a TP group is made of neighbouring ranks (one node), and a TP x CP group too.
CP ranks hold the same weights (each a part of every sequence): gradients are reduced and
the distributed optimizer shards over DP x CP, as Megatron's
get_data_parallel_group(with_context_parallel=True).

Without torch.distributed initialised the grid is a single process: every size is 1,
every group is None and the communication primitives become identities. Tests use this
to compute single-process references.
"""

import contextlib

import torch
import torch.distributed as dist

from megalite.parallel.grid import Grid, rank_of  # noqa: F401  (re-exported: ps.Grid, ps.rank_of)
from megalite.parallel.global_grid import global_grid, global_grid_or_none, set_global_grid
from megalite.parallel.launch import initialize_distributed, new_group  # noqa: F401  (ps.initialize_distributed)
from megalite.parallel.megatron_accessors import *  # noqa: F401,F403  (Megatron's accessors: ps.get_..._rank())
from megalite.parallel.process_groups import build_groups, build_replica_groups

# torch >= 2.12 renames the tensor-form collectives; older releases (the GPU machine's 2.11)
# only have the original names.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def shutdown_distributed(barrier=True):
    """End of job: every rank done (barrier), then all groups destroyed in one call, so no
    communication thread is left for the interpreter to tear down at exit. Without the
    barrier on an error path, where peers may never arrive."""
    destroy_model_parallel()
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              virtual_pipeline_model_parallel_size=None, *, context_parallel_size=1,
                              hierarchical_context_parallel_sizes=None, use_tp_pp_dp_mapping=False,
                              ranks_per_node=None, expert_model_parallel_size=None, expert_tensor_parallel_size=None,
                              replicas=1, pipeline_placement="loop"):
    """Build the TP/CP/DP/PP/model-parallel/embedding groups for the current world.
    ranks_per_node (--hierarchical-grad-reduce): also split each gradient-reduction group (DP x CP)
    into its members on one node (global rank // ranks_per_node) and its cross-node groups.
    expert_model_parallel_size (MoE models): also the expert grid, see _expert_groups (its expert-TP size
    defaults to the TP size, as Megatron's). replicas (semi-synchronous training): the DP ranks split into
    this many consecutive blocks, each a whole model copy whose DP groups (gradients, ZeRO) are its block
    (megalite/distributed/semi_sync.py). pipeline_placement: "loop" or "v" (where the stages sit:
    megalite/parallel/pipeline_stages.py). The groups' rank lists: megalite/parallel/process_groups.py."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    for name, v in (("tensor-model", tp), ("pipeline-model", pp), ("context", cp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}-parallel size must be a positive integer, got {v}")
    if world % (tp * cp * pp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by tensor-model-parallel size {tp} x context-parallel size {cp} x "
            f"pipeline-model-parallel size {pp} = {tp * cp * pp}; change --nproc-per-node or the parallel sizes")
    dp = world // (tp * cp * pp)
    if not isinstance(replicas, int) or replicas < 1 or dp % replicas:
        raise ValueError(f"{replicas} semi-synchronous replicas must divide the data-parallel size {dp}")
    full_dp, dp = dp, dp // replicas
    ep = expert_model_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    if ep is not None and (not isinstance(ep, int) or ep < 1 or (tp * cp * dp) % (ep * etp)):
        raise ValueError(f"expert-model-parallel size {ep} x expert-tensor-parallel size {etp} must divide the ranks "
                         f"of a pipeline stage (tensor x context x data parallel = {tp * cp * dp})")
    grid = Grid(tp, pp, dp, cp, virtual_pipeline_model_parallel_size)
    grid.created = []  # this rank's groups, released by destroy_model_parallel
    grid.pp_before_dp = bool(use_tp_pp_dp_mapping)
    grid.pipeline_placement = pipeline_placement
    grid.stages()  # (a placement the sizes cannot hold: ValueError)
    if ep is not None:
        grid.experts, grid.ep, grid.etp, grid.edp = True, ep, etp, tp * cp * dp // (ep * etp)
    if not dist.is_initialized():
        grid.freeze()
        set_global_grid(grid)
        return
    rank = grid.rank = dist.get_rank()
    grid.tp_rank = rank % tp
    grid.cp_rank = (rank // tp) % cp
    if use_tp_pp_dp_mapping:
        grid.pp_rank = (rank // (tp * cp)) % pp
        full_dp_rank = rank // (tp * cp * pp)
    else:
        full_dp_rank = (rank // (tp * cp)) % full_dp
        grid.pp_rank = rank // (tp * cp * full_dp)
    grid.dp_rank, grid.replica_rank, grid.replicas = full_dp_rank % dp, full_dp_rank // dp, replicas

    def at_replica(r):
        return lambda t, c, d, p: rank_of(t, d + dp * r, p, tp, full_dp, c, cp, pp, use_tp_pp_dp_mapping)

    def make(ranks):  # every rank creates every group, in the same order (torch requires it)
        g = new_group(ranks)
        if rank not in ranks:
            return None
        grid.created.append(g)
        return g

    for r in range(replicas):  # each replica's grid, in replica order
        build_groups(grid, rank, at_replica(r), make, hierarchical_context_parallel_sizes, ranks_per_node)
    if replicas > 1:
        build_replica_groups(grid, at_replica, make)
    grid.freeze()
    set_global_grid(grid)


def model_parallel_is_initialized():
    return global_grid_or_none() is not None


def destroy_model_parallel():
    """Forget the grid and release the groups it made (a process that initialises many grids, as the
    tests and benchmarks do, would otherwise keep every group's sockets); re-initialisable."""
    for g in getattr(set_global_grid(None), "created", ()):
        if dist.is_initialized():
            dist.destroy_process_group(g)


def _grid():
    return global_grid()


def current_grid(grid=None):
    """`grid` if given, else the global grid (initialize_model_parallel's): model code's default."""
    return _grid() if grid is None else grid


def grid_of(modules):
    """The grid model chunks were built in (a DDP wrapper's, else the module's own `grid`; default the global one)."""
    for m in modules:
        g = getattr(m, "grid", None) or getattr(getattr(m, "module", None), "grid", None)
        if g is not None:
            return g
    return current_grid()


_BUILD_ON_META = []


@contextlib.contextmanager
def meta_init():
    """Build a model's parameters on the meta device (shapes only): ZeRO-3 then materialises
    only this rank's shards from each parameter's init_recipe."""
    _BUILD_ON_META.append(True)
    try:
        yield
    finally:
        _BUILD_ON_META.pop()


def get_device():
    """The device this rank computes on: its CUDA device under NCCL, else the CPU (meta inside
    meta_init())."""
    if _BUILD_ON_META:
        return torch.device("meta")
    if torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend() == "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier():
    if dist.is_initialized():
        dist.barrier()


def global_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1
