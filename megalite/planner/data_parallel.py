"""The data-parallel collectives' exposed seconds per step (cost.py's DP term): what the gradient reduction and
ZeRO's parameter gathers leave uncovered by compute, on the DP group's link."""


def _hierarchical_seconds(ranks, cluster, all_reduce):
    """--hierarchical-grad-reduce's seconds for the plain all-reduce of `all_reduce` wire bytes (a flat ring's,
    traffic.py): a reduce-scatter and an all-gather among the k ranks of a node on its link, and an all-reduce
    of 1/k of the bytes across the n nodes; None where the group does not leave a node (then it runs flat)."""
    nodes = {}
    for r in ranks:
        nodes.setdefault(cluster.node_of(r), []).append(r)
    if len(nodes) == 1:
        return None
    d, n = len(ranks), len(nodes)
    k, payload = d // n, all_reduce / (2 * (d - 1) / d)
    intra = cluster.link_gbps(next(iter(nodes.values()))) * 1e9
    across = cluster.link_gbps([group[0] for group in nodes.values()]) * 1e9
    return 2 * (k - 1) / k * payload / intra + 2 * (n - 1) / n * payload / k / across


def dp_time(ranks, cp, zero, cluster, wire, slowest, m, overlap_reduce=True, overlap_gather=False, hierarchical=False):
    """Exposed seconds of the DP collectives per step (wire: data-parallel bytes by op, traffic.py): the
    gradient reduction hides behind backward (the last micro-batch's, or each one's with ZeRO-2/3) but for
    one bucket, all of it after the backward under --no-overlap-grad-reduce (ZeRO-0/1; ZeRO-2/3 reduce as they
    go either way); ZeRO-1/2's parameter all-gather follows the step, or hides behind the next step's first
    forward but for one bucket (--overlap-param-gather); ZeRO-3's gathers hide behind compute.
    --hierarchical-grad-reduce: the plain all-reduce through the nodes (_hierarchical_seconds)."""
    if len(ranks) * cp <= 1 or not wire:
        return 0.0
    gbps = cluster.link_gbps(ranks) * 1e9
    reduce = (wire["all_reduce"] + wire["reduce_scatter"]) / gbps
    if hierarchical and zero == 0:
        reduce = _hierarchical_seconds(ranks, cluster, wire["all_reduce"]) or reduce
    gather = wire["all_gather"] / gbps
    if overlap_gather and zero in (1, 2):
        gather = max(gather - slowest / 3, min(gather, 40_000_000 * 4 / gbps))
    backward = slowest * 2 / 3
    if zero in (0, 1) and not overlap_reduce:
        return reduce + (gather if zero else 0.0)
    if zero == 0:
        return max(reduce - backward, min(reduce, 40_000_000 * 8 / gbps))
    if zero == 1:
        return max(reduce - backward, min(reduce, 40_000_000 * 4 / gbps)) + gather
    if zero == 2:
        return max(reduce - m * backward, min(reduce / m, 40_000_000 * 4 / gbps)) + gather
    return max(reduce + gather - m * slowest, min(reduce / m, 40_000_000 * 4 / gbps))  # (the last unit's reduction)
