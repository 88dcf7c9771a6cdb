"""Data-parallel replicas on GPUs of different speeds: which GPUs each replica holds, and the micro-batches
each should take (--data-parallel-shares) so that the slowest replica finishes first as late as possible,
as megalite/batching/iteration_plan.py's `auto` rule does from measured times, here from predicted ones."""

import heapq


def replica_gpus(layout, cluster, d, i):
    """The GPUs of DP replica d on pipeline stage i (Megatron's order: TP, CP, DP, PP)."""
    t, c = layout.tp, layout.cp
    base = i * layout.world // layout.pp + d * t * c
    return [cluster.gpus[base + j] for j in range(t * c)]


def mixed(layout, cluster):
    """Whether the replicas hold different GPUs (then their speeds differ)."""
    kinds = {tuple(sorted({g.name for i in range(layout.pp) for g in replica_gpus(layout, cluster, d, i)}))
             for d in range(layout.dp)}
    return len(kinds) > 1


def counts(total, seconds):
    """Micro-batches per replica (each at least one) minimising the slowest replica's total time, given each
    replica's seconds per micro-batch: one at a time to the replica that would finish it earliest."""
    n = [1] * len(seconds)
    heap = [(2 * s, r) for r, s in enumerate(seconds)]
    heapq.heapify(heap)
    for _ in range(total - len(seconds)):
        _, r = heapq.heappop(heap)
        n[r] += 1
        heapq.heappush(heap, ((n[r] + 1) * seconds[r], r))
    return n
