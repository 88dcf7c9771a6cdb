"""The layouts worth trying on a cluster, each checked by megalite's own validation, predicted, and ranked by
predicted step time among those that fit.

Candidates: TP over the divisors of the GPUs per node (a TP group stays in a node), CP 1 (or powers of two
up to 8 for sequences of 8k tokens and more), PP over the divisors of the layer count, plain or interleaved
with 1 or 2 layers per virtual stage (only where that gives at least 2 chunks per stage; --pipeline-schedule zbv
or dualpipev: their two chunks per stage instead), DP the rest, EP over
the divisors of the experts that divide DP x CP x TP (MoE) with the experts' TP 1 or TP, ZeRO 0-3, recompute
none / selective / full and micro-batch sizes 1, 2, 4, 8 that divide the batch per DP rank. On mixed clusters
the layers go to the stages and the micro-batches to the replicas by their GPUs' speed, and a replica on a GPU
that runs out of memory gets smaller micro-batches, then its optimizer on the host."""

import dataclasses

from megalite.config import ConfigError
from megalite.parallel.pipeline_stages import V_SCHEDULES
from megalite.planner import shares
from megalite.planner.cost import balanced_layout, balanced_shares, check_plannable, predict
from megalite.planner.layout import Layout


def _divisors(n, limit=None):
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def candidates(cfg, world, gpus_per_node, recomputes=(None, "selective", "full"), zeros=(0, 1, 2, 3), v_shaped=False):
    """The layouts to try (the module's docstring); v_shaped (--pipeline-schedule zbv or dualpipev asked): the
    pipelines of two chunks per stage instead of the interleaved ones."""
    L, gbs = cfg.num_layers, cfg.global_batch_size
    cps = [1] + ([2, 4, 8] if cfg.seq_length >= 8192 else [])
    experts = cfg.num_experts or 0
    for tp in _divisors(min(world, gpus_per_node)):
        for cp in cps:
            for pp in _divisors(L):
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                vps = [None] + [k for k in (1, 2) if pp > 1 and L % (pp * k) == 0 and L // (pp * k) >= 2] \
                    if not v_shaped else [None] + ([L // (2 * pp)] if pp > 1 and L % (2 * pp) == 0 else [])
                eps = [None] if not experts else [e for e in _divisors(experts) if (tp * cp * dp) % e == 0]
                for vp in vps:
                    for ep in eps:
                        for zero in [z for z in zeros if z == 0 or dp * cp > 1]:
                            for rc in recomputes:
                                for micro in (1, 2, 4, 8):
                                    if gbs % (micro * dp) == 0:
                                        for etp in sorted({1, tp}) if ep else [None]:  # experts' TP: 1 or TP
                                            yield Layout(tp, pp, cp, dp, vp, ep, zero, rc, micro, tp > 1, etp=etp)


def _fit_replicas(model_argv, cfg, lay, cluster, validate):
    """The layout's prediction; where it does not fit and its replicas hold different GPUs, the replicas on the
    GPU type that runs out get halved micro-batches (--data-parallel-micro-batch-sizes) until it fits, the sizes
    come out equal (a layout of its own) or megalite would not launch them (samples not whole micro-batches);
    then, where the layout chose no offload, half and then all of their optimizer on the host
    (--optimizer-cpu-offload)."""
    p = predict(cfg, lay, cluster)
    if p.fits or lay.dp == 1 or not shares.mixed(lay, cluster):
        return p

    def short(p, lay):
        return [d for d in range(lay.dp) if any(g.name == p.memory["gpu"] for i in range(lay.pp)
                                                for g in shares.replica_gpus(lay, cluster, d, i))]

    def tried(changed):
        try:
            return changed, predict(validate(model_argv, changed, cluster.size), changed, cluster)
        except ConfigError:
            return None, None
    micros = [lay.micro_of(d) for d in range(lay.dp)]
    while not p.fits:
        halved = [d for d in short(p, lay) if micros[d] > 1]
        for d in halved:
            micros[d] //= 2
        if not halved or len(set(micros)) == 1:
            break
        smaller, q = tried(dataclasses.replace(lay, micros=tuple(micros)))
        if smaller is None:
            break
        lay, p = smaller, q
    for fraction in (0.5, 1.0) if lay.offload is None else ():
        if p.fits:
            break
        low = short(p, lay)
        offloaded, q = tried(dataclasses.replace(lay, offload=tuple(fraction if d in low else 0.0
                                                                   for d in range(lay.dp))))
        if offloaded is not None:
            lay, p = offloaded, q
    return p


def _given_offload(model_argv):
    """The user's --optimizer-cpu-offload fraction for every candidate (None without it)."""
    if "--optimizer-cpu-offload" not in model_argv:
        return None
    i = model_argv.index("--optimizer-offload-fraction") if "--optimizer-offload-fraction" in model_argv else -1
    text = model_argv[i + 1] if i >= 0 else "1.0"
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"--optimizer-offload-fraction {text}: the search takes one fraction for every layout (or "
                          "none: then it offloads where a replica's GPU runs out)") from None


def search(model_argv, cluster, top=5, limit=None, *, validate, **choices):
    """[(Prediction)] of the `top` fastest layouts that fit (or, if none fits, the `top` tightest), and the
    count of layouts megalite would launch. choices: candidates' recomputes= and zeros= (default: all).
    validate(model_argv, layout, world_size): the PlanConfig (config/plan.py) of a layout, ConfigError where
    megalite would refuse it (megalite/cli/plan.py's: the command line's own checks)."""
    cfg0 = validate(model_argv, Layout(), 1)  # the model's and batch's own figures (one GPU's view)
    check_plannable(cfg0, cluster)
    fits, tight, n = [], [], 0
    offload = _given_offload(model_argv)
    v_shaped = any(a.removeprefix("--pipeline-schedule=") in V_SCHEDULES for a in model_argv)
    for lay in candidates(cfg0, cluster.size, cluster.gpus_per_node, v_shaped=v_shaped, **choices):
        if offload is not None:
            lay = dataclasses.replace(lay, offload=(offload,) * lay.dp)
        try:
            cfg = validate(model_argv, lay, cluster.size)
            try:
                cut = balanced_layout(cfg, lay, cluster)  # layers by the stages' GPUs (and the embedding, loss)
            except ConfigError:  # no cut fits every stage: the even split, priced as it is (it will not fit)
                cut = lay
            if cut is not lay:
                lay, cfg = cut, validate(model_argv, cut, cluster.size)
            shared = balanced_shares(cfg, lay, cluster)  # micro-batches by the replicas' GPUs
            if shared is not lay:
                try:
                    lay, cfg = shared, validate(model_argv, shared, cluster.size)
                except ConfigError:  # a combination megalite does not run with shares: equal ones
                    pass
        except ConfigError:
            continue
        n += 1
        p = _fit_replicas(model_argv, cfg, lay, cluster, validate)
        (fits if p.fits else tight).append(p)
        if limit and n >= limit:
            break
    if fits:
        return sorted(fits, key=lambda p: p.step_time_s)[:top], n
    return sorted(tight, key=lambda p: -p.memory["headroom"])[:top], n
