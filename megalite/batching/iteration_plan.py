"""The iteration plan (DESIGN, Seams): per data-parallel rank, how many micro-batches an
iteration runs, which samples of the global batch they are, and how losses and gradients are
weighted.

Equal shares (the default, as Megatron): each DP rank runs G / (micro x DP) micro-batches of
Megatron's interleaved sample slices, divides each micro-batch loss by that count, and the DP
reduction averages.

--data-parallel-shares S0,S1,...: DP rank r takes G x S_r / sum(S) samples of each global batch,
the contiguous run after those of the ranks before it, as n_r whole micro-batches. Every
micro-batch loss is divided by the global count M = sum(n_r) and the DP reduction sums, so the
gradient is the sum over all M micro-batches of grad(loss) / M: the single process's on the same
batch (never the mean of per-rank means, which over-weights the small shares). A per-token loss
is summed and divided by the global token count. Every rank still reduces once per iteration,
after its own last micro-batch, so all ranks issue the same collectives whatever their counts.

--data-parallel-micro-batch-sizes M0,M1,... (with or without shares): DP rank r runs micro-batches of
M_r samples over its part (equal parts without shares). A micro-batch loss is a mean over its M_r
samples, so it is divided by the replica's samples / M_r: every sample weighs 1/(the replica's
samples), whatever the sizes, and the reduction sums (with equal sizes this is the global count M).

The run's batch schedule from its flags (batch_schedule; validation's derived values: cli/batch_flags.py) is built
and checked here, against the plan, so microbatches.py (the schedule itself) imports nothing of this module.

--data-parallel-shares auto: equal shares for the first K iterations
(--data-parallel-shares-profile-iters), each replica's forward-backward time per micro-batch
measured (after a device sync), then the counts that minimise the slowest replica's time, by a
rule every rank computes from the same gathered times.
"""

import math

from megalite.config import ConfigError
from megalite.batching.microbatches import DUALPIPE_V, BatchSchedule, interleaving_problem, parse_step_schedule


def parse_shares(text, dp):
    """--data-parallel-shares: None, "auto", or dp positive integers (one ConfigError line)."""
    if text is None:
        return None
    if text.strip().lower() == "auto":
        return "auto"
    try:
        shares = [int(s) for s in text.replace(" ", ",").split(",") if s]
    except ValueError:
        raise ConfigError(f"--data-parallel-shares {text!r}: give one positive integer per data-parallel rank "
                          "(e.g. 2,1) or auto") from None
    if len(shares) != dp:
        raise ConfigError(f"--data-parallel-shares {text!r} gives {len(shares)} shares for data-parallel size {dp}; "
                          "give one per data-parallel rank")
    if any(s <= 0 for s in shares):
        raise ConfigError(f"--data-parallel-shares {text!r}: every share must be a positive integer")
    return shares


class IterationPlan:
    """schedule: the run's BatchSchedule (global batch per iteration); shares: None (equal, as
    Megatron) or one positive integer per DP rank; micros: None (the schedule's micro-batch size
    everywhere) or one micro-batch size per DP rank (--data-parallel-micro-batch-sizes). replicas
    (semi-synchronous training): the DP ranks form this many consecutive blocks, each a model copy that
    steps on its own part of the batch, so losses and gradients are normalised within the block
    (ranks are DP ranks across replicas)."""

    def __init__(self, schedule, shares=None, replicas=1, micros=None):
        self.schedule, self.shares, self.replicas = schedule, shares, replicas
        self.dp, self.micro, self.micros = schedule.dp, schedule.micro, micros

    @property
    def uneven(self):
        """Shares or per-rank micro-batch sizes given: contiguous slices, each sample's loss weighed
        1/(the replica's samples), summing reduction."""
        return self.shares is not None or self.micros is not None

    def micro_of(self, rank):
        """DP rank's micro-batch size."""
        return self.micros[rank] if self.micros is not None else self.micro

    def equal_counts(self):
        """Every DP rank runs the same number of micro-batches in every reachable batch (then the
        per-micro-batch collectives of ZeRO-2/3 and EP line up even with unequal shares or sizes)."""
        return all(len(set(self.counts_of(g))) == 1 for g in self.schedule.batch_sizes(0))

    def samples_of(self, g):
        """Samples of every DP rank in an iteration of global batch g (the shares' parts, else equal)."""
        weights = self.shares or [1] * self.dp
        return [g * w // sum(weights) for w in weights]

    def counts_of(self, g):
        """Micro-batches of every DP rank in an iteration of global batch g."""
        return [n // self.micro_of(r) for r, n in enumerate(self.samples_of(g))]

    @property
    def grad_divisor(self):
        """What the DP reduction (within a replica) divides the summed gradients by."""
        return 1 if self.uneven else self.dp // self.replicas

    def replica_ranks(self, rank):
        """The DP ranks of rank's replica."""
        n = self.dp // self.replicas
        return range(rank - rank % n, rank - rank % n + n)

    def global_batch_size(self, consumed):
        return self.schedule.global_batch_size(consumed)

    def counts(self, consumed):
        """Micro-batches of every DP rank in the iteration that starts after `consumed` samples."""
        return self.counts_of(self.schedule.global_batch_size(consumed))

    def total(self, consumed, rank=0):
        """Uneven: what each of rank's micro-batch losses (a mean over its samples) is divided by,
        so that every sample of the replica's batch weighs 1/(its samples): the replica's samples
        over rank's micro-batch size (the global micro-batch count when all sizes are equal).
        Else None: each rank's mean, averaged over DP."""
        if not self.uneven:
            return None
        return self.replica_samples(consumed, rank) / self.micro_of(rank)

    def replica_samples(self, consumed, rank):
        """Samples rank's replica trains on in the iteration after `consumed`."""
        counts = self.counts(consumed)
        return sum(counts[r] * self.micro_of(r) for r in self.replica_ranks(rank))

    def num_microbatches(self, consumed, rank):
        return self.counts(consumed)[rank]

    def loss_divisor(self, consumed, rank):
        """Each micro-batch loss is divided by this: the rank's own count (the reduction then
        averages) or, uneven, `total` (the reduction sums)."""
        return self.total(consumed, rank) or self.num_microbatches(consumed, rank)

    def first_sample(self, consumed, rank):
        """Uneven: the first sample of rank's contiguous slice of the global batch."""
        counts = self.counts(consumed)
        return consumed + sum(counts[r] * self.micro_of(r) for r in range(rank))

    def check(self, consumed=0, pipeline_size=1, interleaved=False, what=None):
        """Every reachable global batch splits into whole micro-batches per share (at least one
        each; a multiple of the pipeline size when interleaved); else one ConfigError line."""
        if not self.uneven:
            return self.schedule.check(consumed, pipeline_size, interleaved, what)
        weights = self.shares or [1] * self.dp
        total, flags = sum(weights), []
        if self.shares:
            flags.append(f"--data-parallel-shares {','.join(map(str, self.shares))}")
        if self.micros:
            flags.append(f"--data-parallel-micro-batch-sizes {','.join(map(str, self.micros))}")
        flag = " ".join(flags) + (f" ({what})" if what else "")
        for g in self.schedule.batch_sizes(consumed):
            for r, s in enumerate(weights):
                m = self.micro_of(r)
                n, rest = divmod(g * s, total * m)
                if rest or n < 1:
                    part = f"share {s} / {total}" if self.shares else f"1 / {self.dp}"
                    unit = f"micro-batches of {m}" if self.micros else f"--micro-batch-size {m} micro-batches"
                    raise ConfigError(f"{flag}: global batch {g} x {part} = {g * s / total:g} samples for "
                                      f"DP rank {r} is not a positive whole number of {unit}; change the "
                                      f"{'sizes' if self.micros else 'shares'} or the batch sizes")
                if interleaved and (why := interleaving_problem(n, pipeline_size, interleaved)):
                    raise ConfigError(f"{flag}: DP rank {r} gets {n} micro-batches of global batch {g}: {why}")


def balanced_counts(seconds, total, unit=1):
    """Micro-batch counts (multiples of `unit`, at least one unit each, summing to `total`) that
    minimise max(count_r x seconds_r): one unit at a time to the replica that would finish it
    first (optimal for equal units on machines of different speeds); ties go to the lower rank,
    so every rank derives the same counts from the same times."""
    units = total // unit
    if units < len(seconds):
        raise ConfigError(f"--data-parallel-shares auto: {total} micro-batches cannot give each of {len(seconds)} "
                          "data-parallel replicas one")
    n = [1] * len(seconds)
    for _ in range(units - len(seconds)):
        r = min(range(len(seconds)), key=lambda i: ((n[i] + 1) * seconds[i], i))
        n[r] += 1
    return [c * unit for c in n]


def training_plan(cfg, schedule):
    """The run's IterationPlan: its shares, per-rank micro-batch sizes and replicas (cfg: the BatchingConfig,
    config/batching.py, as in every function here)."""
    micros = cfg.data_parallel_micro_batch_sizes
    if micros == "auto":  # chosen by memory once the model is built (megalite/training/memory_budget.py)
        micros = [cfg.micro_batch_size] * cfg.data_parallel_size
    return IterationPlan(schedule, initial_shares(cfg), cfg.semi_sync_replicas or 1, micros)


def reduces_once(cfg, plan):
    """Whether ZeRO-2 reduce-scatters once per iteration, as ZeRO-1 does, instead of per micro-batch: the DP
    ranks run different micro-batch counts (or may, under auto), and every rank must issue the same
    collectives."""
    return bool(plan and plan.uneven and ("auto" in (cfg.data_parallel_shares, cfg.data_parallel_micro_batch_sizes)
                                          or not plan.equal_counts()))


def initial_shares(cfg):
    """The shares the run starts with: the flag's, equal ones for auto (profiled first), or None."""
    shares = cfg.data_parallel_shares
    return [1] * cfg.data_parallel_size if shares == "auto" else shares


def evaluation_plan(cfg, plan, global_batch, micro_batch, micro_sizes):
    """Evaluation follows the given shares; with auto it runs at equal shares (the profile is the
    training's, at the training's micro-batch). micro_sizes: the evaluation's per replica (or None)."""
    shares = plan.shares if cfg.data_parallel_shares != "auto" else None
    return IterationPlan(BatchSchedule(global_batch, micro_batch, plan.dp), shares, plan.replicas,
                         micro_sizes)


def auto_shares(cfg, plan, grid):
    """The AutoShares of --data-parallel-shares auto (balancing in units of PP micro-batches when
    interleaved), else None."""
    if cfg.data_parallel_shares != "auto":
        return None
    unit = cfg.pipeline_model_parallel_size if interleaving(cfg) not in (False, DUALPIPE_V) else 1
    return AutoShares(plan, cfg.data_parallel_shares_profile_iters, unit, grid)


class AutoShares:
    """--data-parallel-shares auto: record this rank's forward-backward seconds per micro-batch
    for `iters` iterations, then set the plan's shares from every replica's fastest iteration
    (a replica is as slow as its slowest rank). With a micro-batch size per replica the batch is
    balanced in units of lcm(sizes) samples (x `unit` micro-batches when interleaved): a unit costs
    replica r (unit / M_r) x its seconds per micro-batch."""

    def __init__(self, plan, iters, unit, grid):
        self.plan, self.iters, self.unit, self.times, self.grid = plan, iters, unit, [], grid  # grid: the DP ranks'
        # (the equal shares it profiles at passed IterationPlan.check: lcm x unit divides each replica's part)
        self.sizes = [plan.micro_of(r) for r in range(plan.dp)]
        self.samples = math.lcm(*self.sizes) * unit

    @property
    def done(self):
        return len(self.times) >= self.iters

    def observe(self, seconds, microbatches, consumed):
        """Record one iteration; after the last profiled one return (per-replica seconds per
        micro-batch, new counts) and switch the plan to the counts, else None."""
        from megalite.distributed.collectives import max_per_data_parallel_rank
        self.times.append(seconds / microbatches)
        if not self.done:
            return None
        per_replica = max_per_data_parallel_rank(min(self.times), self.grid)
        sizes, samples = self.sizes, self.samples
        per_unit = [t * samples / m for t, m in zip(per_replica, sizes)]  # a unit: whole micro-batches everywhere
        units = balanced_counts(per_unit, self.plan.global_batch_size(consumed) // samples)
        self.plan.shares = units  # samples in proportion to the units
        counts = [u * samples // m for u, m in zip(units, sizes)]
        return per_replica, counts


def batch_schedule(cfg):
    """The run's BatchSchedule from its flags, checked (every batch from sample 0 on). It only reads them:
    validation (cli/validate.py) sets what it derives (once)."""
    steps = cfg.step_batch_size_schedule
    if steps is not None:
        if cfg.rampup_batch_size is not None:
            raise ConfigError("--rampup-batch-size and --step-batch-size-schedule are exclusive; pick one")
        steps = parse_step_schedule(steps, cfg.seq_length)
        final, default = steps[-1][1], cfg.micro_batch_size * cfg.data_parallel_size
        if cfg.global_batch_size not in (final, default):
            raise ConfigError(f"--global-batch-size {cfg.global_batch_size} differs from the last batch size {final} "
                              "of --step-batch-size-schedule; remove --global-batch-size")
    schedule = BatchSchedule(cfg.global_batch_size, cfg.micro_batch_size, cfg.data_parallel_size,
                             cfg.rampup_batch_size, steps)
    training_plan(cfg, schedule).check(0, cfg.pipeline_model_parallel_size, interleaving(cfg))
    return schedule


def interleaving(cfg):
    """The `interleaved` argument of the checks: False, True (groups of PP), the group size, or DUALPIPE_V
    (training only: evaluation runs the V's forwards, any count)."""
    if cfg.pipeline_schedule == "dualpipev":
        return DUALPIPE_V
    if cfg.virtual_pipeline_model_parallel_size is None or cfg.pipeline_schedule == "zbv":
        return False
    return cfg.microbatch_group_size_per_virtual_pipeline_stage or True


def evaluation_interleaving(cfg):
    """interleaving(cfg) for the evaluation's forwards (DualPipeV's: ZB-V's, any micro-batch count)."""
    return False if (rule := interleaving(cfg)) == DUALPIPE_V else rule
