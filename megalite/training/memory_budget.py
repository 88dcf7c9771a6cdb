"""--data-parallel-micro-batch-sizes auto and --optimizer-offload-fraction auto under
--device-memory-budget: each data-parallel replica sizes its micro-batches, and where that is not
enough its optimizer offload, to the memory its GPU has.

Before training, each rank measures what it holds: the training state on the device (weights,
gradient buffers, the optimizer's part not offloaded; megalite.optimizer.memory) and what one
micro-batch of M samples adds, from one forward-backward at M = 1 and one at M = 2 on the run's own
first samples (on CUDA the peak allocated above the start; on CPU the bytes autograd saves for
backward, through saved-tensor hooks, parameters excluded): activations(M) = fixed + per_sample x M.
A pipeline stage holds up to min(PP - stage, micro-batches) of them at once (1F1B; PP - stage
with --data-parallel-shares auto, which sets the counts later, by speed at the chosen sizes). A replica takes
the largest M that divides its samples of each batch and fits every one of its ranks' budgets:
states + in_flight x activations(M) <= budget. With the fraction `auto`, a replica whose chosen (or
given) size does not fit moves the smallest fraction of its optimizer (fp32 main weights and Adam
states) to the host that makes it fit. The profiling steps leave no trace: gradients are zeroed
before the first iteration, nothing is stepped, and the data they read is read again by training.
"""

import math

import torch

from megalite import parallel_state as ps
from megalite.config import ConfigError
from megalite.batching.microbatches import interleaving_problem

GIB = 2 ** 30


def saved_activation_bytes(run_one, params):
    """Bytes one forward-backward keeps for backward (see the module docstring)."""
    if ps.get_device().type == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run_one()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    skip = {p.untyped_storage().data_ptr() for p in params}  # weights saved for backward are states
    seen, total = set(), [0]

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total[0] += s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_one()
    return total[0]


def offloadable_bytes(optimizer):
    """Device bytes an offload of everything would move: the optimizer's own fp32 buffers (main
    weights where they are copies, Adam's m and v)."""
    return sum(t.untyped_storage().nbytes() for g in optimizer._flat if g.grad is None
               for t in (None if g.own else g.main, *g.states.values()) if t is not None)


class Profile:
    """One rank's measurement: states (device bytes), fixed + per_sample x M activations, in-flight rule.
    `last`: the latest (profile, budget in bytes, chosen sizes, offload fraction), for tests and benchmarks."""
    last = None

    def __init__(self, states, at1, at2, pp_size, pp_rank):
        self.states, self.per_sample = states, max(at2 - at1, 0)
        self.fixed = max(at1 - self.per_sample, 0)
        self.pp_size, self.pp_rank = pp_size, pp_rank
        self.any_count = False  # --data-parallel-shares auto: the count is chosen later, so a stage may fill up

    def need(self, m, samples, states=None):
        in_flight = self.pp_size - self.pp_rank if self.any_count else min(self.pp_size - self.pp_rank, samples // m)
        return (self.states if states is None else states) + in_flight * (self.fixed + self.per_sample * m)

    def largest_fitting(self, budget, samples, pipeline_size=1, interleaved=False):
        """The largest M dividing `samples` whose need fits `budget` (interleaving's count rule too); 0: none."""
        for m in range(samples, 0, -1):
            if samples % m == 0 and not (interleaved and interleaving_problem(samples // m, pipeline_size,
                                                                               interleaved)):
                if self.need(m, samples) <= budget:
                    return m
        return 0

    def fraction_for(self, m, samples, budget, offloadable):
        """The smallest offload fraction (in hundredths, rounded up) under which size m fits; None: none does."""
        over = self.need(m, samples) - budget
        if over <= 0:
            return 0.0
        if over > offloadable:
            return None
        return min(1.0, math.ceil(100 * over / offloadable) / 100)


def describe(profile):
    return (f"states {profile.states / GIB:.3f} GiB, activations {profile.fixed / GIB:.4f} GiB + "
            f"{profile.per_sample / GIB:.4f} GiB per sample")


def choose(profile, budget, samples, size, fraction_auto, offloadable, pipeline_size, interleaved, replica):
    """(micro-batch size, offload fraction or None) for this rank: size None -> the largest that fits;
    raises ConfigError (one line) where nothing fits even with full offload."""
    m = size or profile.largest_fitting(budget, samples, pipeline_size, interleaved)
    if size is None and m == 0 and fraction_auto:
        m = 1  # the smallest micro-batch, with as much offload as it takes
    if m and profile.need(m, samples) <= budget:
        return m, 0.0 if fraction_auto else None
    if fraction_auto and (f := profile.fraction_for(m, samples, budget, offloadable)) is not None:
        return m, f
    full = " even with the whole optimizer offloaded" if fraction_auto else \
        " (add --optimizer-cpu-offload --optimizer-offload-fraction auto)"
    raise ConfigError(f"--device-memory-budget {budget / GIB:g} GiB: data-parallel replica {replica} cannot fit a "
                      f"micro-batch of {m or 1}{full}: {describe(profile)}")


def fit_to_budget(cfg, plan, mcfg, chunks, optimizer, dataset, forward_step_func):
    """cfg: the MixedGpuConfig. Profile this rank, choose its replica's micro-batch size
    (--data-parallel-micro-batch-sizes auto: plan.micros set, the same on every rank) and its offload fraction (auto;
    else None). Returns (fraction, this rank's Profile, its budget in bytes). Collective: every rank runs the same
    profiling steps."""
    from megalite.batching.data_iterators import data_iterators
    from megalite.distributed import finalize_model_grads
    from megalite.distributed.collectives import max_per_data_parallel_rank
    from megalite.pipeline.schedules import run_forward_backward
    from megalite.batching.iteration_plan import interleaving
    from megalite.optimizer.memory import state_bytes_by_place
    from megalite.pipeline.schedules import pipeline_tensor_shape
    grid = ps.grid_of(chunks)
    dp_rank = grid.data_rank()
    samples = plan.samples_of(plan.schedule.final)[dp_rank]
    params = [p for c in chunks for p in c.parameters()]
    at = {}
    for m in (1, 2) if samples >= 2 else (1,):
        its = data_iterators(dataset, 0, cfg.loader, chunks, micro_batch_size=m)
        at[m] = saved_activation_bytes(lambda: run_forward_backward(
            forward_step_func, its, chunks, 1, pipeline_tensor_shape(mcfg, m, grid), mcfg.params_dtype,
            loss_scale=optimizer.loss_scale, loss_divisor=1), params)
        finalize_model_grads(chunks)  # the reductions it started end here, as after a training step
        for c in chunks:
            c.zero_grad_buffer()
    profile = Profile(state_bytes_by_place(chunks, optimizer)[0], at[1], at.get(2, 2 * at[1]),
                      grid.pp, grid.pp_rank)
    profile.offloadable = offloadable_bytes(optimizer)
    profile.any_count = cfg.data_parallel_shares == "auto"
    budget = cfg.device_memory_budget[dp_rank] * GIB if cfg.device_memory_budget else \
        0.9 * (torch.cuda.mem_get_info()[0] + profile.states)  # (CUDA only: validated) free at start
    auto_sizes = cfg.data_parallel_micro_batch_sizes == "auto"
    m, fraction = choose(profile, budget, samples, None if auto_sizes else plan.micro_of(dp_rank),
                         cfg.optimizer_offload_fraction == "auto", profile.offloadable,
                         cfg.pipeline_model_parallel_size, interleaving(cfg.batching), dp_rank)
    if auto_sizes:  # every rank of a replica takes the smallest size any of them fits
        plan.micros = [round(1 / v) for v in max_per_data_parallel_rank(1 / m, grid)]
    return fraction, profile, budget


def report_fit(cfg, plan, fraction, profile, budget, grid):
    """The choice as explicit flags (every replica's), so that a run can be repeated exactly."""
    from megalite.distributed.collectives import max_per_data_parallel_rank
    from megalite.logger import print_rank_last
    flags = [f"--data-parallel-micro-batch-sizes {','.join(map(str, plan.micros))}"] \
        if cfg.data_parallel_micro_batch_sizes == "auto" else []
    if cfg.optimizer_offload_fraction == "auto":  # a replica offloads what its neediest rank needs
        fractions = max_per_data_parallel_rank(fraction or 0.0, grid)
        flags.append("--optimizer-cpu-offload --optimizer-offload-fraction " + ",".join(f"{f:g}" for f in fractions))
    print_rank_last(f"megalite: memory budget {budget / GIB:.3f} GiB here ({describe(profile)}) -> {' '.join(flags)}")
