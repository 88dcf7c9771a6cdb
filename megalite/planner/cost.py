"""Memory per GPU and step time of one layout on one cluster, from megalite's own model of the run.

Memory: the exact training-state bytes of each pipeline stage's rank (memory.py), activations of the micro-
batches the schedule keeps in flight there (activations.py; 1F1B: p - i on stage i, interleaved: Megatron's
warm-up count of chunks, each 1/v of the layers), a full-recompute chunk's transient, communication buffers
(ZeRO-2: two buckets' full fp32 gradients, all of them where it reduces once; ZeRO-3: two gathered units, the
prefetch; --optimizer-cpu-offload's host part left out, reported as host) and RESERVED for the
CUDA context and NCCL; a layout fits where that leaves FRAGMENTATION of the GPU free (headroom >= 0).

Time per micro-batch on stage i (its slowest GPU): GEMM FLOPs of its layers (forward, backward 2x, a recompute
pass) at peak x gemm_efficiency x each GEMM's tile and wave utilisation on the GPU's SMs (gemm.py); causal
attention (half the s^2 FLOPs of the convention) at peak x ATTENTION_EFFICIENCY; element-wise passes (norms,
residuals, activation, rope) at memory bandwidth; at least the host's time to launch the operators (the device runs
ahead of the host only while it has more work); the TP collectives ((t-1)/t of [s, b, h] per gather / scatter, four
each way per layer, not overlapped, as megalite runs them, each with the cluster's start-up latency); the CP ring's
k/v blocks beyond what attention hides; the p2p sends. The pipeline takes (m - 1) max_i t_i + sum_i t_i (1F1B), m
max_i t_i + (p - 1) max_i t_i / v (interleaved) or 1F1B's with the share of its bubble the schedule's plan leaves
(zb-h1: a third, m >= p; zbv: (p - 1) / (6m + p - 1) of the step, p = 2, 4); the bubble is what exceeds m max_i t_i.
Data parallelism: ring all-reduce / reduce-scatter of the fp32 gradients, hidden behind the last micro-batch's
backward (ZeRO-2: every micro-batch's; ZeRO-3: also the gathers, each micro-batch's behind its compute) but for
one bucket (--no-overlap-grad-reduce: none of it at ZeRO-0/1), then the parameters' all-gather (ZeRO-1/2; behind
the next forward with --overlap-param-gather) and Adam over this rank's shard at memory bandwidth. Links: a group
inside a node uses the node's link, else the inter-node one. Per data-parallel replica where replicas differ (GPUs,
--data-parallel-micro-batch-sizes, --data-parallel-precisions, an offload fraction each): its micro-batch count
from the run's iteration plan, its activations and state on its own GPUs, its pace; the slowest replica sets the
step."""

import dataclasses

from megalite import parallel_state as ps
from megalite.config import ConfigError
from megalite.planner.flops import num_floating_point_operations, window_share
from megalite.batching.iteration_plan import batch_schedule, training_plan
from megalite.planner import activations, data_parallel, memory, optimizer_step, semi_sync, shares, stages, traffic
from megalite.planner import gemm as gemm_shapes
from megalite.planner.memory import zero_as_run
from megalite.parallel.pipeline_stages import V_SCHEDULES, placement_of
from megalite.pipeline.zero_bubble import make_plan
from megalite.tensor_parallel.layers import padded_vocab_size
from megalite.transformer.pipeline_layers import chunk_layers

PLANNED = ("zb-h1",) + V_SCHEDULES  # (the schedules run by a plan, pipeline/zero_bubble.py)

GiB = 1 << 30
RESERVED = 1.5 * GiB  # CUDA context, NCCL buffers (not modelled in detail)
FRAGMENTATION = 0.05  # of a GPU's memory kept free for the caching allocator's fragmentation
ATTENTION_EFFICIENCY = 0.5  # flash attention's fraction of peak (forward and backward together)
ELEMENTWISE_EFFICIENCY = 0.8  # fraction of memory bandwidth an element-wise kernel reaches
OPS_PER_LAYER = 30  # operators in a transformer layer's forward (norms, GEMMs, rope, attention, residuals)


@dataclasses.dataclass
class Prediction:
    layout: object
    flags: list
    memory: dict  # the largest GPU's bytes by kind, its GPU, headroom
    time: dict  # seconds: compute, tp, cp, pp, dp, optimizer, bubble
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    fits: bool

    @property
    def memory_gib_per_gpu(self):
        return self.memory["total"] / GiB

    def row(self):
        return {"layout": self.layout.describe(), "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu, "memory_gib_per_gpu": self.memory_gib_per_gpu,
                "fits": self.fits, "memory": {k: (v / GiB if k not in ("gpu", "stage") else v)
                                              for k, v in self.memory.items()},
                "time": self.time, "flags": self.flags}


def _ring(bytes_, n, gbps, factor=1):
    """Seconds of a ring collective moving factor x (n-1)/n x bytes per rank at gbps GB/s."""
    return 0.0 if n <= 1 else factor * (n - 1) / n * bytes_ / (gbps * 1e9)


def _ranks(layout, cluster, pp_rank, axis):
    """Global ranks of one group along `axis` (tp, cp, dp, ep; else the stages) at stage pp_rank (Megatron's
    order)."""
    t, c, d = layout.tp, layout.cp, layout.dp
    base = pp_rank * t * c * d
    if axis == "tp":
        return [base + i for i in range(t)]
    if axis == "cp":
        return [base + i * t for i in range(c)]
    if axis == "dp":
        return [base + i * t * c for i in range(d)]
    if axis == "ep":  # expert-TP x EP: consecutive positions of the stage (process_groups' expert grid)
        return [base + j for j in range(layout.ep)]
    return [p * t * c * d for p in range(layout.pp)]


def check_plannable(cfg, cluster, layout=None):
    """One ConfigError line for what the planner cannot price: no vocabulary size, flags it does not model,
    bf16 on GPUs without it."""
    if cfg.vocab_size is None:
        raise ConfigError("give --vocab-size (the planner does not load tokenizers)")
    unmodelled = [flag for flag, given in (
        (f"--semi-sync-method with {semi_sync.refusal(cfg)}", semi_sync.refusal(cfg)),
        ("--grad-compression", cfg.grad_compression != "none")) if given]
    if unmodelled:
        raise ConfigError(f"the planner does not model {', '.join(unmodelled)} yet: plan without, then add it")
    no_bf16 = sorted({g.name for g in cluster.gpus if not g.bf16})
    if cfg.bf16 and no_bf16:
        raise ConfigError(f"{', '.join(no_bf16)} cannot compute in bf16: plan with --fp16 (or give those replicas "
                          "fp16 with --data-parallel-precisions)")
    if layout is not None and cfg.data_parallel_precisions:
        for d, precision in enumerate(cfg.data_parallel_precisions):
            lacking = sorted({g.name for i in range(layout.pp) for g in shares.replica_gpus(layout, cluster, d, i)
                              if not g.bf16})
            if precision == "bf16" and lacking:
                raise ConfigError(f"--data-parallel-precisions: replica {d} runs on {', '.join(lacking)}, which "
                                  "cannot compute in bf16: give it fp16")


def _figures(cfg, layout):
    """(model config, activation bytes per element, padded vocabulary) of the run."""
    c = cfg.model
    e = 2 if (cfg.bf16 or cfg.fp16) else 4
    return c, e, padded_vocab_size(c.vocab_size, c.make_vocab_size_divisible_by, layout.tp)


def predict(cfg, layout, cluster):
    """Prediction for `cfg` (the PlanConfig, config/plan.py: megalite's validated flags at this layout) on
    `cluster`."""
    if cluster.size != layout.world:
        raise ConfigError(f"{layout.describe()} needs {layout.world} GPUs, the cluster has {cluster.size}")
    check_plannable(cfg, cluster, layout)
    c, e, vocab = _figures(cfg, layout)
    v = layout.chunks_per_stage(c.num_layers)
    # micro-batches per DP rank, as the run's iteration plan cuts them (shares, per-replica sizes)
    batching = cfg.batching
    every = training_plan(batching, batch_schedule(batching)).counts_of(cfg.global_batch_size)
    fractions = cfg.optimizer_offload_fraction if cfg.optimizer_cpu_offload else None  # (a list: per replica)
    per_replica_state = isinstance(fractions, (list, tuple)) or len(set(cfg.data_parallel_precisions or ())) > 1
    alike = not (shares.mixed(layout, cluster) or layout.micros or per_replica_state)
    replicas = range(1) if alike else range(layout.dp)  # (alike: one stands for all, the largest share decides)
    counts = [max(every)] if alike else every
    zero = zero_as_run(cfg)  # (ZeRO-2 whose ranks run different counts reduces once, as ZeRO-1)
    # each replica's model config and activation bytes (--data-parallel-precisions: its own), once for all stages
    figures = {d: _figures(cfg.at_rank(d), layout)[:2] for d in replicas}
    stage_times, worst, dp_bytes, opt, outer_elements = [], None, {}, 0.0, []
    inner_dp = layout.dp // semi_sync.replicas(cfg)  # (semi-synchronous replicas: each its own inner DP)
    slow_gpu = min(cluster.gpus, key=lambda g: g.peak_tflops)
    placement = placement_of(c.pipeline_schedule)
    for i in range(layout.pp):
        grid = ps.Grid.of(layout.tp, layout.pp, inner_dp, layout.cp, v if v > 1 else None, layout.ep,
                          layout.expert_tp if layout.ep else None, pp_rank=i, placement=placement)
        gpus = stages.stage_gpus(layout, cluster, i)
        state = memory.training_state(cfg, c, grid)
        outer_elements.append(sum(state.stepped.values()))  # (the main weights a rank sums at an outer step)
        cuts = [chunk_layers(c, i, j, grid) for j in range(v)]
        layers = [n for n, _ in cuts]
        buffers = _buffers(layout, zero, state, c)
        per_replica = []
        for r, d in enumerate(replicas):  # a replica's stage: its micro-batches' activations, its GPUs
            micro = layout.micro_of(d)
            cd, ed = figures[d]
            if d and per_replica_state:  # replica d's own offload fraction or precision: its state bytes
                state = memory.training_state(cfg, c, ps.Grid.of(
                    layout.tp, layout.pp, layout.dp, layout.cp, v if v > 1 else None, layout.ep,
                    layout.expert_tp if layout.ep else None, pp_rank=i, dp_rank=d, placement=placement))
            per_chunk = [activations.chunk_bytes(cd, grid, micro, ed, n, grid.stage_of(j) == 0,
                                                 grid.stage_of(j) == layout.pp * v - 1, vocab, first_layer=first)
                         for j, (n, first) in enumerate(cuts)]
            in_flight = _in_flight(c, layout, i, counts[r], v)
            act = max(per_chunk) * in_flight if v > 1 else per_chunk[0] * in_flight
            device = state.total - state.host  # (--optimizer-cpu-offload: the host part lives in host memory)
            total = device + act + activations.transient_bytes(cd, grid, micro, ed) + buffers + RESERVED
            tightest = min(gpus if alike else shares.replica_gpus(layout, cluster, d, i), key=lambda g: g.memory_gib)
            mem = {"weights": state.weights, "gradients": state.gradients, "optimizer": state.optimizer - state.host,
                   "activations": act, "buffers": buffers, "reserved": RESERVED, "total": total, "gpu": tightest.name,
                   "headroom": (1 - FRAGMENTATION) * tightest.memory_gib * GiB - total, "stage": i,
                   "host": state.host + 4 * state.host_elements}  # (host memory: offloaded states, gradients)
            if worst is None or mem["headroom"] < worst["headroom"]:
                worst = mem
            gpu = min(shares.replica_gpus(layout, cluster, d, i), key=lambda g: g.peak_tflops)  # the slowest
            st = _stage_time(cd, layout, cluster, i, gpu, ed, sum(layers), i == layout.pp - 1, vocab, micro)
            if layout.ep:  # the MoE token dispatch, on the stage's critical path
                st["ep"] = sum(traffic.dispatch_bytes(cfg, c, grid).values()) / (
                    cluster.link_gbps(_ranks(layout, cluster, i, "ep")) * 1e9)
            per_replica.append(st)
            opt = max(opt, optimizer_step.seconds(cfg, state, c, grid, slow_gpu,
                                                  lambda axis: cluster.link_gbps(_ranks(layout, cluster, i, axis))))
        stage_times.append(per_replica)
        dp_bytes = max(dp_bytes, traffic.data_parallel_bytes(cfg, c, grid, every[0]), key=lambda d: sum(d.values()))
    pipes = []
    for r, n in enumerate(counts):  # each replica's pipeline over its own micro-batches
        per_micro = [sum(stage_times[i][r].values()) for i in range(layout.pp)]
        top = max(per_micro)
        pipes.append((n * top + (layout.pp - 1) * top / v if v > 1 and placement == "loop" else
                      n * top + (sum(per_micro) - top) * _bubble_share(c, layout.pp, n), top, r, n,
                      per_micro.index(top)))
    pipe, slowest, r, n, i = max(pipes)
    busy = {k: n * t for k, t in stage_times[i][r].items()}
    dp_ranks = _ranks(layout, cluster, 0, "dp")  # (semi-synchronous: the first replica's inner DP reduces)
    dp_time = data_parallel.dp_time(dp_ranks[:inner_dp], layout.cp, zero, cluster, dp_bytes, slowest, n,
                                    cfg.overlap_grad_reduce, cfg.overlap_param_gather, cfg.hierarchical_grad_reduce)
    step = pipe + dp_time + opt
    outer = max((semi_sync.outer_seconds(cfg, e, cluster.link_gbps(dp_ranks[::inner_dp]), cluster.latency_us * 1e-6,
                                         step) for e in outer_elements), default=0.0)
    step += outer
    time = {**busy, "bubble": pipe - n * slowest, "dp": dp_time, "optimizer": opt, "outer": outer}
    flops = num_floating_point_operations(c, cfg.global_batch_size, vocab)
    if c.recompute_granularity == "full":
        flops *= 4 / 3  # Narayanan et al.'s convention counts the recomputed forward
    tflops = flops / step / cluster.size / 1e12
    low = [p != "fp32" for p in cfg.data_parallel_precisions] if cfg.data_parallel_precisions else [e < 4] * layout.dp
    peak = sum(g.peak_tflops if low[d] else g.fp32_tflops for d in range(layout.dp) for i in range(layout.pp)
               for g in shares.replica_gpus(layout, cluster, d, i)) / cluster.size
    return Prediction(layout, layout.flags(), worst, time, step, cfg.global_batch_size * c.seq_length / step, tflops,
                      tflops / peak, worst["headroom"] >= 0)


def balanced_layout(cfg, layout, cluster):
    """The layout with its layers cut across the pipeline stages by their GPUs' predicted speed and memory
    (stages.py); the layout itself where it is not a plain pipeline or the cut is the even one."""
    from megalite.transformer.pipeline_layers import stage_layer_counts
    if layout.pp == 1 or layout.vp or layout.chunks:
        return layout
    c, e, vocab = _figures(cfg, layout)
    m = cfg.global_batch_size // (layout.micro * layout.dp)

    def seconds(i, gpu, layers, last):
        return sum(_stage_time(c, layout, cluster, i, gpu, e, layers, last, vocab).values())
    counts = stages.balance(cfg, c, layout, cluster, seconds, lambda i: _in_flight(c, layout, i, m, 1), RESERVED,
                            FRAGMENTATION)
    if tuple(counts) == tuple(stage_layer_counts(c.num_layers, layout.pp, None, None)):
        return layout
    return dataclasses.replace(layout, stage_layers=tuple(counts))


def balanced_shares(cfg, layout, cluster):
    """The layout with --data-parallel-shares giving each replica micro-batches by its predicted speed, where
    the replicas hold different GPUs (the layout itself where they do not, or the shares come out equal)."""
    if layout.dp == 1 or not shares.mixed(layout, cluster):
        return layout
    c, e, vocab = _figures(cfg, layout)
    seconds = []
    for d in range(layout.dp):  # a replica's pace: its slowest stage per micro-batch
        per_stage = []
        for i in range(layout.pp):
            grid = ps.Grid.of(layout.tp, layout.pp, layout.dp, layout.cp, None, layout.ep,
                              layout.expert_tp if layout.ep else None, pp_rank=i)
            n = sum(chunk_layers(c, i, j, grid)[0] for j in range(grid.vpp or 1))
            gpu = min(shares.replica_gpus(layout, cluster, d, i), key=lambda g: g.peak_tflops)
            per_stage.append(sum(_stage_time(c, layout, cluster, i, gpu, e, n, i == layout.pp - 1, vocab).values()))
        seconds.append(max(per_stage))
    total = cfg.global_batch_size // layout.micro
    n = shares.counts(total, seconds)
    return layout if len(set(n)) == 1 else dataclasses.replace(layout, shares=tuple(n))


def _bubble_share(c, p, m):
    """The schedule's bubble over 1F1B's, from its plan's unit-cost simulation (pipeline/zero_bubble.py: F = B =
    W, as the paper's): zb-h1 leaves a third of it once m >= p, zbv and dualpipev (costs per chunk, a rank's 6m
    of work) almost none."""
    if c.pipeline_schedule not in PLANNED or p == 1:
        return 1.0
    work = 6 * m if c.pipeline_schedule in V_SCHEDULES else 3 * m
    return (make_plan(c.pipeline_schedule, p, m).makespan - work) / (work / m * (p - 1))


def _in_flight(c, layout, i, m, v):
    """Micro-batches (interleaved: chunks) whose activations stage i holds at its peak (zb-h1: from a forward
    until its weight gradients, the plan's count; zbv, dualpipev: its chunks')."""
    if c.pipeline_schedule in PLANNED and layout.pp > 1:
        return make_plan(c.pipeline_schedule, layout.pp, m).most_alive(i)
    if v == 1:
        return min(layout.pp - i, m)
    return min((layout.pp - i - 1) * 2 + (v - 1) * layout.pp + 1, m * v)


def _buffers(layout, zero, state, c):
    """Transient bytes beside the state: ZeRO-2's full-size gradient buckets (all of them, accumulated over the
    iteration, where it reduces once: zero_as_run 1), ZeRO-3's gathered units."""
    if zero == 1 and layout.zero == 2:
        return state.gradients * layout.dp * layout.cp
    if zero == 2:
        return 2 * min(state.gradients * layout.dp * layout.cp, 40_000_000 * 4)  # two buckets' full fp32 grads
    if zero == 3:
        per_layer = state.weights * layout.dp * layout.cp / max(1, c.num_layers // layout.pp)
        return 2 * per_layer  # two gathered units (the one running, the prefetched one)
    return 0


def _attention_terms(c):
    """(projections, scores) of a layer's attention in flops.py's units (x 12 B s L h^2 per step; the scores'
    term per token of the sequence): QKV and the output projection, then q.k and p.v."""
    h = c.hidden_size
    if c.multi_latent_attention:
        n, dq = c.num_attention_heads, c.qk_head_dim + c.qk_pos_emb_head_dim
        q_term = h * n * dq if c.q_lora_rank is None else c.q_lora_rank * (h + n * dq + 1)
        weights = q_term + c.kv_lora_rank * (h + n * (c.qk_head_dim + c.v_head_dim) + 1) \
            + h * c.qk_pos_emb_head_dim + n * c.v_head_dim * h
        return weights / (2 * h * h), n * (dq + c.v_head_dim) / (2 * h * h) * h
    q = c.kv_channels * c.num_attention_heads / h
    return (1 + c.num_query_groups / c.num_attention_heads) * q, q


def _explicit_scores(c):
    """megalite's attention path (transformer/attention.py): fp16 with --apply-query-key-layer-scaling
    computes the scores in fp16 and softmaxes them explicitly (as Megatron did before flash attention);
    everything else runs flash attention."""
    import torch
    return c.apply_query_key_layer_scaling and c.params_dtype == torch.float16


def _stage_time(c, layout, cluster, i, gpu, e, layers, last, vocab, micro=None):
    """Seconds of one micro-batch (of `micro` samples; default the layout's) forward and backward on stage i, by
    kind."""
    t, cp, b = layout.tp, layout.cp, micro or layout.micro
    s, h = c.seq_length // cp, c.hidden_size
    depth = (c.mtp_num_layers or 0) if last else 0  # multi-token prediction: D more layers and logits here
    layers += depth
    moe = sum(c.is_moe_layer(n) for n in range(1, c.num_layers + 1)) if c.num_moe_experts else 0
    ffn = ((c.num_layers - moe) * c.ffn_hidden_size + moe * c.moe_router_topk * (c.moe_ffn_hidden_size or 0)) \
        / c.num_layers * (1.5 if c.swiglu else 1.0)  # a token's FFN width, MoE layers' k experts (as flops.py)
    proj, score = _attention_terms(c)
    gemm = 4 * b * s * h * h * (proj + ffn / h) * layers / t
    attn = 4 * b * s * c.seq_length * h * score * layers / t * 0.5 * window_share(c)  # causal: half the s^2 term
    passes = 3 + (1 if c.recompute_granularity == "full" else 0)
    # the GEMMs' FLOPs x passes, each pass at its shapes' tile and wave utilisation (gemm.py)
    dense = not (c.multi_latent_attention or moe)
    gemm *= gemm_shapes.time_factor(gemm_shapes.layer_gemms(c, b * s, t), passes - 2, gpu.sms) if dense else passes
    if last:
        gemm += (1 + depth) * 2 * b * s * h * vocab / t * gemm_shapes.time_factor([(b * s, h, vocab // t)],
                                                                                  passes - 2, gpu.sms)
        gemm += depth * 2 * b * s * 2 * h * h / t * passes  # each depth's eh_proj, [emb; h] -> h
    attn_passes = passes + (1 if c.recompute_granularity == "selective" else 0)
    rate = (gpu.peak_tflops if e < 4 else gpu.fp32_tflops) * 1e12  # fp32: no tensor cores (TF32 is off)
    rows = s // t if c.sequence_parallel and t > 1 else s
    elementwise = 3 * layers * b * e * (10 * rows * h + 4 * s * c.ffn_hidden_size / t + 4 * s * h / t)
    if _explicit_scores(c):  # fp16 with query-key layer scaling: the scores materialised, all of them
        scores = b * (c.num_attention_heads // t) * s * c.seq_length * layers
        compute = (gemm + attn_passes * 2 * attn) / (rate * gpu.gemm_efficiency)
        dropout = 2 * e + 1 if c.attention_dropout > 0 else 0  # read, write, the mask
        per_pass = 3 * e + dropout  # the scores written, read and written by the softmax, read by probs @ v
        elementwise += scores * (attn_passes / 3 * per_pass + 2 * (4 * e + dropout))  # backward: about twice
    else:
        compute = gemm / (rate * gpu.gemm_efficiency) + attn_passes * attn / (rate * ATTENTION_EFFICIENCY)
    compute += elementwise / (gpu.memory_gbps * 1e9 * ELEMENTWISE_EFFICIENCY)
    # the host launches each operator: a layer's forward is about OPS_PER_LAYER of them, backward twice that
    host = (passes + (attn_passes > passes)) * OPS_PER_LAYER * layers * gpu.op_overhead_us * 1e-6
    compute = max(compute, host) if gpu.asynchronous else compute + host  # (a CPU runs its ops itself)
    act = s * b * h * e
    alpha = cluster.latency_us * 1e-6  # each collective's start-up, whatever its size
    tp = 0.0
    if t > 1:
        tp_gbps = cluster.link_gbps(_ranks(layout, cluster, i, "tp"))
        # a layer's 4 collectives forward and their 4 adjoints backward; full recompute runs the forward's 4 again
        n = 8 + (4 if c.recompute_granularity == "full" else 0)
        tp = _ring(act, t, tp_gbps, n) + n * alpha
        if c.sequence_parallel:  # backward gathers QKV's and fc1's input rows again, each behind its own
            gather = _ring(act, t, tp_gbps) + alpha  # input-gradient GEMM (output tokens x in)
            qkv, _, fc1, _ = gemm_shapes.layer_gemms(c, b * s, t)
            tp += sum(max(0.0, gather - 2 * m * k * n / gemm_shapes.utilisation(m, k, gpu.sms)
                          / (rate * gpu.gemm_efficiency)) for m, k, n in (qkv, fc1))
        tp *= layers
    kv = s * b * 2 * (c.num_query_groups // t) * c.kv_channels * e
    ring = 3 * (cp - 1) * (kv / (cluster.link_gbps(_ranks(layout, cluster, i, "cp")) * 1e9) + alpha) * layers \
        if cp > 1 else 0
    cp_time = max(0.0, ring - attn_passes * attn / (rate * ATTENTION_EFFICIENCY))
    pp_time = 0.0
    if layout.pp > 1:
        stages = _ranks(layout, cluster, 0, "pp")
        chunks = layout.chunks_per_stage(c.num_layers)  # interleaved: a send per chunk
        pp_time = 2 * chunks * (rows * b * h * e / (cluster.link_gbps(stages[max(0, i - 1):i + 2]) * 1e9) + alpha)
    return {"compute": compute, "tp": tp, "cp": cp_time, "pp": pp_time}
