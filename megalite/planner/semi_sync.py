"""Semi-synchronous replicas priced (--semi-sync-method local_sgd | diloco; distributed/semi_sync.py): R replicas of
dp / R inner data-parallel ranks each. Inside a replica everything is an ordinary run, which cost.py prices with the
inner DP (its gradient reduction, its ZeRO shards). Every round of H inner steps each rank sums the fp32 main
weights it steps with its counterparts in the other replicas: a ring all-reduce over the R replicas on the link
between them, in buckets of 2^24 elements, after a one-element all-reduce of the samples; --semi-sync-quantize
all-gathers bf16 / fp8 payloads instead. Streaming (--semi-sync-fragments K) syncs a K-th of the weights at K
offsets of the round, each hidden behind --semi-sync-fragment-delay inner steps. Per step: the round's exposed
seconds / H."""

import math

BUCKET = 1 << 24  # elements per outer all-reduce (distributed/semi_sync.py)
PAYLOAD = {None: 4, "bf16": 2, "fp8": 1}  # bytes per element on the wire


def replicas(cfg):
    """R: the semi-synchronous replicas (1 without --semi-sync-method)."""
    return (cfg.semi_sync_replicas or 1) if cfg.semi_sync_method else 1


def refusal(cfg):
    """What of semi-synchronous training the planner does not price (one line), or None."""
    if not cfg.semi_sync_method:
        return None
    if cfg.semi_sync_async:
        return "--semi-sync-async (replicas at their own pace)"
    if cfg.semi_sync_auto or len(set(cfg.semi_sync_steps)) > 1:
        return "--semi-sync-steps auto or a count per replica (give one H)"
    return None


def outer_seconds(cfg, elements, counterparts_gbps, latency_s, inner_step_s):
    """Exposed seconds per inner step of the outer step, for a rank stepping `elements` main weights whose
    counterparts in the other replicas are reached at counterparts_gbps."""
    r = replicas(cfg)
    if r <= 1 or not elements:
        return 0.0
    h = max(cfg.semi_sync_steps)
    q = getattr(cfg, "semi_sync_quantize", None)
    wire = (r - 1) * PAYLOAD[q] * elements if q else 2 * (r - 1) / r * 4 * elements
    k = getattr(cfg, "semi_sync_fragments", 1) or 1
    per_fragment = wire / k / (counterparts_gbps * 1e9) + latency_s * math.ceil(elements / k / BUCKET)
    hidden = getattr(cfg, "semi_sync_fragment_delay", 0) * inner_step_s
    round_s = latency_s + k * max(0.0, per_fragment - hidden)  # (the samples' one-element all-reduce first)
    return round_s / h
