"""The optimizer step of the busiest rank of a pipeline stage: its seconds, and Muon's bytes.

Element-wise part: the bytes each rule reads and writes per element it steps, at the GPU's memory bandwidth:
AdamW and Muon's momentum + update 30 (fp32 main, gradient, two states or the momentum and the update; the
bf16 copy), SGD and Lion 22 (one state). Muon adds the Newton-Schulz iterations of the matrices the rank
orthogonalises at the GPU's GEMM rate (bf16 steps: the tensor-core peak; `high`: fp32) and the bytes that
bring them together, decided as optimizer/muon.py decides them, from the same bucket plans as memory.py:
under ZeRO each sharding group's matrices get owners by the same balanced assignment, and two all-to-alls
carry a rank's pieces of other ranks' matrices there and its own matrices' pieces back; under TP
(duplicated) each matrix a rank orthogonalises is all-gathered. Without ZeRO every rank does every matrix.
(--muon-tp-mode distributed's Gram all-reduces, s^2 per step, are left out.)"""

from megalite.optimizer.muon import MuonMatrices, balanced_owners, is_muon_matrix, piece_ranges
from megalite.planner.memory import _buckets, build_chunks

BYTES = {"adam": 30, "muon": 30, "sgd": 22, "lion": 22}
ELEMENTWISE_EFFICIENCY = 0.8  # (cost.py's)


def muon_plan(cfg, mcfg, grid):
    """{"flops": Newton-Schulz FLOPs, "muon_all_to_all", "muon_all_gather": wire bytes} of this rank's Muon
    step (what comm counts under those names); zeros without Muon."""
    out = {"flops": 0, "muon_all_to_all": 0.0, "muon_all_gather": 0.0}
    if cfg.optimizer != "muon":
        return out
    zero = (cfg.zero_stage or 1) if cfg.use_distributed_optimizer else 0

    def expert(p):
        return bool(getattr(p, "expert_parallel", False)) and grid.experts
    mm = MuonMatrices([], cfg.training, tp_size=lambda p: grid.etp if expert(p) else grid.tp)
    groups = {False: [], True: []}  # per sharding group (dense, experts): (param, ranges, rank, size)
    for model in build_chunks(mcfg, grid):
        for params, n, d, r in _buckets(model, grid, zero, cfg.ddp_bucket_size):
            offset, shard = 0, n // d
            for p in params:
                k = p.numel()
                if is_muon_matrix(p):
                    ranges = piece_ranges(offset, k, shard, d) if zero else [(0, k)]
                    groups[expert(p)].append((p, ranges, r if zero else 0))
                offset += k
    for is_expert, hs in groups.items():
        mine = [p for p, _, _ in hs]
        if hs and len(hs[0][1]) > 1:
            d, r = len(hs[0][1]), hs[0][2]
            owner = balanced_owners([mm.cost(p) for p, _, _ in hs], d)
            for (p, ranges, _), o in zip(hs, owner):
                held = ranges[r][1] - ranges[r][0]
                out["muon_all_to_all"] += 4 * (held if o != r else p.numel() - held)
            mine = [p for (p, _, _), o in zip(hs, owner) if o == r]
        out["flops"] += sum(mm.cost(p) for p in mine)
        tp = grid.etp if is_expert else grid.tp
        if tp > 1 and cfg.muon_tp_mode == "duplicated":
            out["muon_all_gather"] += sum(4 * p.numel() * (tp - 1) for p in mine
                                          if getattr(p, "tensor_model_parallel", False))
    return out


def seconds(cfg, state, mcfg, grid, gpu, gbps):
    """state: memory.training_state's; gbps(axis): the link speed of this stage's group along 'dp' or 'tp'
    (asked only when bytes cross it). --optimizer-cpu-offload: the host part steps at the GPU's host_step_gbps,
    its fp32 gradients go down and its weights come up over the GPU's host link (behind the device's part of
    the step with --overlap-cpu-optimizer-d2h-h2d, on a device that runs behind its host: a CPU rank has no
    side stream, so its copies are always in the step)."""
    work = sum(n * BYTES[kind] for kind, n in state.stepped.items())
    per_host = BYTES[cfg.optimizer if cfg.optimizer != "muon" else cfg.muon_scalar_optimizer]
    device_gbps = gpu.optimizer_gbps or gpu.memory_gbps * ELEMENTWISE_EFFICIENCY
    t = (work - state.host_elements * per_host) / (device_gbps * 1e9)
    if state.host_elements:
        copies = state.host_elements * (4 + (2 if cfg.bf16 or cfg.fp16 else 4)) / (gpu.host_gbps * 1e9)
        host = state.host_elements * per_host / (gpu.host_step_gbps * 1e9)
        hidden = cfg.overlap_cpu_optimizer_d2h_h2d and gpu.asynchronous
        t = t + host + (max(0.0, copies - t) if hidden else copies)
    if cfg.optimizer != "muon":
        return t
    plan = muon_plan(cfg, mcfg, grid)
    rate = (gpu.peak_tflops if cfg.muon_fp32_matmul_prec != "high" else gpu.fp32_tflops) * 1e12
    t += plan["flops"] / (rate * gpu.gemm_efficiency)
    for op, axis in (("muon_all_to_all", "dp"), ("muon_all_gather", "tp")):
        t += plan[op] / (gbps(axis) * 1e9) if plan[op] else 0.0
    return t
