"""Which ranks form which process group, in Megatron's orders: build_groups fills a parallel_state
grid's groups given its coordinates (at(t, c, d, p) -> global rank) and make(ranks), which every rank
calls for every group in the same order (torch requires it) and which returns the group to its
members only."""

import math


def build_groups(grid, rank, at, make, hierarchical_context_parallel_sizes=None, ranks_per_node=None):
    """The TP, DP, CP (and hierarchical CP), DP x CP, node, TP x CP, PP, embedding and model-parallel
    groups, and with an expert grid (grid.experts) the expert groups (_expert_groups)."""
    tp, cp, dp, pp = grid.tp, grid.cp, grid.dp, grid.pp
    T, C, D, P = range(tp), range(cp), range(dp), range(pp)
    for c, d, p in ((c, d, p) for d in D for p in P for c in C):
        grid.tp_group = make([at(t, c, d, p) for t in T]) or grid.tp_group
    for t, c, p in ((t, c, p) for t in T for p in P for c in C):
        grid.dp_group = make([at(t, c, d, p) for d in D]) or grid.dp_group
    for t, d, p in ((t, d, p) for t in T for d in D for p in P):
        ranks = [at(t, c, d, p) for c in C]
        if (g := make(ranks)) is not None:
            grid.cp_group, grid.cp_ranks = g, ranks
        sizes = hierarchical_context_parallel_sizes or []
        for level, size in enumerate(sizes):  # Megatron's levels: level 0 = runs of consecutive CP ranks
            inner, outer = math.prod(sizes[:level]), math.prod(sizes[level + 1:])
            for lo, u in ((lo, u) for lo in range(outer) for u in range(inner)):
                sub = [ranks[u + inner * (s_ + size * lo)] for s_ in range(size)]
                if (g := make(sub)) is not None:
                    grid.hcp.append((g, sub))
    # At CP = 1 these equal the DP and TP groups, which the accessors then return.
    for t, p in ((t, p) for t in T for p in P if cp > 1):  # gradients and ZeRO shards: DP x CP
        grid.dp_cp_group = make(sorted(at(t, c, d, p) for d in D for c in C)) or grid.dp_cp_group
    for t, p in ((t, p) for t in T for p in P if ranks_per_node):
        nodes = {}
        for r in sorted(at(t, c, d, p) for d in D for c in C):
            nodes.setdefault(r // ranks_per_node, []).append(r)
        if len({len(v) for v in nodes.values()}) > 1:
            raise ValueError(f"--hierarchical-grad-reduce: the data-parallel ranks {sorted(sum(nodes.values(), []))} "
                             f"spread unevenly over nodes of {ranks_per_node} ranks "
                             f"({[len(v) for v in nodes.values()]} per node); use equal nodes")
        for v in nodes.values():
            if (g := make(v)) is not None:
                node = (g, v)
        for i in range(len(v)):
            cross = [v_[i] for v_ in nodes.values()]
            if (g := make(cross)) is not None:
                grid.grad_nodes = node + (g, cross)
    for d, p in ((d, p) for d in D for p in P if cp > 1):  # the batch is read once per TP x CP group
        grid.tp_cp_group = make(sorted(at(t, c, d, p) for c in C for t in T)) or grid.tp_cp_group
    for t, c, d in ((t, c, d) for t in T for d in D for c in C):
        ranks = [at(t, c, d, p) for p in P]
        if (g := make(ranks)) is not None:
            grid.pp_group, grid.pp_ranks = g, ranks
        if pp > 1:  # tied word embeddings live on the first and last stage (one rank in the V)
            st = grid.stages()
            emb = sorted({ranks[st.holder(0)[0]], ranks[st.holder(st.count - 1)[0]]})
            if (g := make(emb)) is not None:
                grid.emb_group, grid.emb_ranks = g, emb
    for c, d in ((c, d) for d in D for c in C):
        grid.mp_group = make(sorted(at(t, c, d, p) for p in P for t in T)) or grid.mp_group
    if grid.experts:
        _expert_groups(grid, [[at(t, c, d, p) for d in D for c in C for t in T] for p in P], rank, make)


def _expert_groups(grid, stages, rank, make):
    """Megatron's expert grid: a stage's ranks, in the dense order j = tp + TP·(cp + CP·dp), are re-read
    as j = etp + ETP·(ep + EP·edp). Expert-TP ranks shard each expert (ETP = TP: the dense TP group; 1:
    none); EP ranks hold different experts (tokens are dispatched among them; the allgather dispatcher
    gathers over ETP x EP); expert-DP ranks hold the same experts (their gradients are reduced, and ZeRO
    shards, over expert-DP); the expert model-parallel group (ETP x EP x PP) holds one copy of every
    expert element (norms)."""
    et, ep, edp = grid.etp, grid.ep, grid.edp

    def at(ranks, t, i, e):
        return ranks[t + et * (i + ep * e)]
    for ranks in stages:  # the routers' token counts are summed over a stage (TP x CP x DP)
        grid.stage_group = make(sorted(ranks)) or grid.stage_group
    for ranks in stages:
        if rank in ranks:
            j = ranks.index(rank)
            grid.etp_rank, grid.ep_rank, grid.edp_rank = j % et, (j // et) % ep, j // (et * ep)
    T, I, E = range(et), range(ep), range(edp)
    for ranks, i, e in ((r, i, e) for r in stages for e in E for i in I):
        grid.etp_group = make([at(ranks, t, i, e) for t in T]) or grid.etp_group
    for ranks, t, e in ((r, t, e) for r in stages for e in E for t in T):
        grid.ep_group = make([at(ranks, t, i, e) for i in I]) or grid.ep_group
    for ranks, e in ((r, e) for r in stages for e in E):
        grid.tp_ep_group = make([at(ranks, t, i, e) for i in I for t in T]) or grid.tp_ep_group
    for ranks, t, i in ((r, t, i) for r in stages for i in I for t in T):
        grid.edp_group = make([at(ranks, t, i, e) for e in E]) or grid.edp_group
    for e in E:
        grid.emp_group = make(sorted(at(r, t, i, e) for r in stages for i in I for t in T)) or grid.emp_group


def build_replica_groups(grid, at_replica, make):
    """Semi-synchronous replicas: every replica's ranks (its world), then per (TP, CP, inner DP, PP)
    coordinate the counterparts across replicas (the outer step's group)."""
    R, T, C, D, P = range(grid.replicas), range(grid.tp), range(grid.cp), range(grid.dp), range(grid.pp)
    for r in R:
        ranks = sorted(at_replica(r)(t, c, d, p) for p in P for d in D for c in C for t in T)
        if (g := make(ranks)) is not None:
            grid.replica_world_group, grid.replica_world_ranks = g, ranks
    grid.replica_counterparts = [[at_replica(r)(t, c, d, p) for r in R] for p in P for d in D for c in C for t in T]
    for ranks in grid.replica_counterparts:
        grid.replica_group = make(ranks) or grid.replica_group
