"""Bytes one rank's data-parallel collectives move per step, from the same bucket plans as memory.py, in
distributed/comm.py's terms (wire bytes of a ring: all-reduce 2(d-1)/d, reduce-scatter and all-gather
(d-1)/d of the payload), so that the prediction equals comm.counts() after a step:

  plain DP   one all-reduce of each fp32 gradient bucket per step
  ZeRO-1     one reduce-scatter of each fp32 bucket, then one all-gather of its parameters
  ZeRO-2     a reduce-scatter per micro-batch (the full-size gradients are not kept), one all-gather; as
             ZeRO-1 where DP ranks run different micro-batch counts (shares, per-replica sizes)
  ZeRO-3     per micro-batch each unit's parameters gathered for its forward and again for its backward
             (resharded after the forward) and its gradients reduce-scattered

Buckets of experts go over expert-DP, the rest over DP x CP; a group of one rank moves nothing. With tied
embeddings on one stage, ZeRO-3 gathers the embedding's bucket once more per micro-batch (the output layer's
forward needs it after the embedding freed it; its backward keeps it until the embedding's own).

MoE layers' allgather token dispatch (moe/dispatcher.py) counts in the same collectives: per layer and
micro-batch, over the n = ETP x EP ranks, the T tokens of this rank gathered with their fp32 probabilities and
routing map, the experts' output reduce-scattered; backward the adjoints (no gradient for the map)."""

from megalite.planner.memory import _buckets, _tied, build_chunks, chunk_routers, zero_as_run
from megalite.planner.optimizer_step import muon_plan


def dp_wire_bytes(cfg, mcfg, grid, micro_batches):
    """{"all_reduce", "reduce_scatter", "all_gather", "muon_all_to_all", "muon_all_gather": wire bytes} of
    this rank for one step (what comm counts: the data-parallel collectives, the MoE dispatch's, Muon's)."""
    dp, ep = data_parallel_bytes(cfg, mcfg, grid, micro_batches), dispatch_bytes(cfg, mcfg, grid)
    muon = muon_plan(cfg, mcfg, grid)
    return {**{op: dp[op] + ep.get(op, 0.0) * micro_batches for op in dp},
            "muon_all_to_all": muon["muon_all_to_all"], "muon_all_gather": muon["muon_all_gather"]}


def dispatch_bytes(cfg, mcfg, grid):
    """{op: wire bytes} of one micro-batch's MoE token dispatch on this rank (all its chunks)."""
    e = 2 if (cfg.bf16 or cfg.fp16) else 4
    out = {}
    for model in build_chunks(mcfg, grid):
        for op, b in _dispatch(mcfg, grid, model, e, cfg.micro_batch_size).items():
            out[op] = out.get(op, 0.0) + b
    return out


def data_parallel_bytes(cfg, mcfg, grid, micro_batches):
    """{"all_reduce", "reduce_scatter", "all_gather": wire bytes} of this rank's data-parallel collectives
    for one step."""
    zero = zero_as_run(cfg)
    e = 2 if (cfg.bf16 or cfg.fp16) else 4
    out = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0}
    for model in build_chunks(mcfg, grid):
        for _, n, d, _ in _buckets(model, grid, zero, cfg.ddp_bucket_size):
            if d == 1:
                continue
            ring = (d - 1) / d
            if zero == 0:
                out["all_reduce"] += 2 * ring * 4 * n
            elif zero in (1, 2):
                out["reduce_scatter"] += ring * 4 * n * (micro_batches if zero == 2 else 1)
                out["all_gather"] += ring * e * n
            else:
                out["reduce_scatter"] += ring * 4 * n * micro_batches
                out["all_gather"] += 2 * ring * e * n * micro_batches
        if zero == 3 and _tied(model, grid) is None and getattr(model, "share_embeddings_and_output_weights", False) \
                and model.pre_process and model.post_process:
            word = model.embedding.word_embeddings.weight
            for params, n, d, _ in _buckets(model, grid, zero, cfg.ddp_bucket_size):
                if any(p is word for p in params):
                    out["all_gather"] += (d - 1) / d * e * n * micro_batches
    return out


def _dispatch(c, grid, model, e, micro):
    """Wire bytes of one micro-batch's MoE token dispatch (allgather dispatcher) on this chunk."""
    n = grid.ep * grid.expert_tp()[0] if grid.experts else 1
    layers = chunk_routers(model)
    if n == 1 or not layers or c.moe_token_dispatcher_type != "allgather":
        return {}
    t = c.seq_length // grid.cp * micro
    t = t // grid.tp if c.sequence_parallel and grid.tp > 1 else t
    h, experts = c.hidden_size, c.num_moe_experts
    return {"all_gather": layers * (n - 1) * t * (2 * h * e + experts * 4 + experts),
            "reduce_scatter": layers * (n - 1) * t * (2 * h * e + experts * 4)}
