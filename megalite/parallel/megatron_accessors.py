"""Megatron-LM's parallel_state accessors over the global grid (initialize_model_parallel's), for code written
against Megatron's API: a user's own model or loop calls `parallel_state.get_tensor_model_parallel_rank()` and the
like (re-exported there). megalite's own code below the entry point is handed its grid instead (parallel/grid.py);
tests/test_house.py counts what still reads these."""

from megalite.parallel.global_grid import global_grid

__all__ = ["get_tensor_model_parallel_group", "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size",
           "get_pipeline_model_parallel_group", "get_pipeline_model_parallel_rank",
           "get_pipeline_model_parallel_world_size", "get_pipeline_model_parallel_ranks", "get_data_parallel_group",
           "get_data_parallel_rank", "get_data_parallel_world_size", "get_data_parallel_rank_across_replicas",
           "get_replica_rank", "get_replica_world_size", "get_replica_group", "get_replica_counterparts",
           "get_replica_world_group", "get_context_parallel_group", "get_context_parallel_rank",
           "get_context_parallel_world_size", "get_context_parallel_global_ranks", "uses_tp_pp_dp_mapping",
           "get_gradient_node_groups", "get_hierarchical_context_parallel_groups", "has_expertglobal_grid",
           "get_expert_model_parallel_group", "get_expert_model_parallel_rank", "get_expert_model_parallel_world_size",
           "get_expert_tensor_parallel_group", "get_expert_tensor_parallel_rank",
           "get_expert_tensor_parallel_world_size", "get_expert_tensor_and_model_parallel_group",
           "get_expert_tensor_and_model_parallel_world_size", "get_expert_data_parallel_group",
           "get_expert_data_parallel_rank", "get_expert_data_parallel_world_size",
           "get_tensor_and_data_parallel_group", "get_expert_tensor_model_pipeline_parallel_group",
           "get_tensor_and_context_parallel_group", "get_tensor_and_context_parallel_rank", "get_model_parallel_group",
           "get_embedding_group", "get_embedding_ranks", "get_virtual_pipeline_model_parallel_world_size",
           "get_virtual_pipeline_model_parallel_rank", "set_virtual_pipeline_model_parallel_rank",
           "is_pipeline_first_stage", "is_pipeline_last_stage"]


def get_tensor_model_parallel_group():
    return global_grid().tp_group


def get_tensor_model_parallel_rank():
    return global_grid().tp_rank


def get_tensor_model_parallel_world_size():
    return global_grid().tp


def get_pipeline_model_parallel_group():
    return global_grid().pp_group


def get_pipeline_model_parallel_rank():
    return global_grid().pp_rank


def get_pipeline_model_parallel_world_size():
    return global_grid().pp


def get_pipeline_model_parallel_ranks():
    return list(global_grid().pp_ranks)


def get_data_parallel_group(with_context_parallel=False):
    """DP; with_context_parallel: DP x CP (gradient reduction and ZeRO shards, as Megatron)."""
    return global_grid().dp_cp()[0] if with_context_parallel else global_grid().dp_group


def get_data_parallel_rank(with_context_parallel=False):
    return global_grid().dp_cp()[2] if with_context_parallel else global_grid().dp_rank


def get_data_parallel_world_size(with_context_parallel=False):
    return global_grid().dp_cp()[1] if with_context_parallel else global_grid().dp


def get_data_parallel_rank_across_replicas():
    """This rank's DP index over every replica (replica x inner DP): what it reads of each global batch."""
    return global_grid().data_rank()


def get_replica_rank():
    """Semi-synchronous training: which replica this rank belongs to (0 without)."""
    return global_grid().replica_rank


def get_replica_world_size():
    """The number of semi-synchronous replicas (1 without)."""
    return global_grid().replicas


def get_replica_group():
    """This rank and its counterparts (same TP, CP, inner DP, PP coordinates) in the other replicas:
    the group of the outer step. None with one replica."""
    return global_grid().replica_group


def get_replica_counterparts():
    """Every position's counterparts across the replicas (lists of global ranks in replica order; [] without)."""
    return global_grid().replica_counterparts


def get_replica_world_group():
    """Every rank of this replica and their global ranks ((None, None) with one replica: the world)."""
    g = global_grid()
    return g.replica_world_group, g.replica_world_ranks


def get_context_parallel_group():
    return global_grid().cp_group


def get_context_parallel_rank():
    return global_grid().cp_rank


def get_context_parallel_world_size():
    return global_grid().cp


def get_context_parallel_global_ranks():
    return list(global_grid().cp_ranks)


def uses_tp_pp_dp_mapping():
    """Whether the rank order is TP, CP, PP, DP (--use-tp-pp-dp-mapping)."""
    return global_grid().pp_before_dp


def get_gradient_node_groups():
    """--hierarchical-grad-reduce: (group of this rank's gradient-reduction peers on its node, their
    global ranks, group of its counterparts on the other nodes, their ranks); None without."""
    return global_grid().grad_nodes


def get_hierarchical_context_parallel_groups():
    """[(group, global ranks)] per level of --hierarchical-context-parallel-sizes ([] without)."""
    return list(global_grid().hcp)


def has_expertglobal_grid():
    """Whether expert groups exist (an MoE job); without, experts reduce like dense parameters."""
    return global_grid().experts


def get_expert_model_parallel_group():
    return global_grid().ep_group


def get_expert_model_parallel_rank():
    return global_grid().ep_rank


def get_expert_model_parallel_world_size():
    return global_grid().ep


def get_expert_tensor_parallel_group():
    return global_grid().expert_tp_group()


def get_expert_tensor_parallel_rank():
    return global_grid().expert_tp()[1]


def get_expert_tensor_parallel_world_size():
    """Without an expert grid: the dense TP size (experts are then dense parameters)."""
    return global_grid().expert_tp()[0]


def get_expert_tensor_and_model_parallel_group():
    """ETP x EP: the ranks among which the allgather dispatcher gathers tokens."""
    return global_grid().tp_ep_group


def get_expert_tensor_and_model_parallel_world_size():
    g = global_grid()
    return g.etp * g.ep


def get_expert_data_parallel_group():
    """The ranks that hold the same experts: expert gradients are reduced, and ZeRO shards, here."""
    return global_grid().expert_dp()[0]


def get_expert_data_parallel_rank():
    return global_grid().expert_dp()[2]


def get_expert_data_parallel_world_size():
    return global_grid().edp


def get_tensor_and_data_parallel_group(with_context_parallel=True):
    return global_grid().stage_dp_group(with_context_parallel)


def get_expert_tensor_model_pipeline_parallel_group():
    """ETP x EP x PP (Megatron's name): every expert element once; the norms sum over it."""
    return global_grid().expert_model_group()


def get_tensor_and_context_parallel_group():
    """TP x CP: the ranks that read one batch (each CP rank then keeps its part)."""
    g = global_grid()
    return g.tp_cp_group if g.cp > 1 else g.tp_group


def get_tensor_and_context_parallel_rank():
    return global_grid().tp_cp_rank()


def get_model_parallel_group():
    return global_grid().mp_group


def get_embedding_group():
    return global_grid().emb_group


def get_embedding_ranks():
    return list(global_grid().emb_ranks)


def get_virtual_pipeline_model_parallel_world_size():
    return global_grid().vpp


def get_virtual_pipeline_model_parallel_rank():
    return global_grid().virtual_rank


def set_virtual_pipeline_model_parallel_rank(rank):
    global_grid().virtual_rank = rank


def is_pipeline_first_stage(ignore_virtual=False):
    g = global_grid()
    if not ignore_virtual and g.vpp is not None and g.virtual_rank != 0:
        return False
    return g.first_stage()


def is_pipeline_last_stage(ignore_virtual=False):
    g = global_grid()
    if not ignore_virtual and g.vpp is not None and g.virtual_rank != g.vpp - 1:
        return False
    return g.last_stage()
