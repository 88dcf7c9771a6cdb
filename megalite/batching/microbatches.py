"""The global batch of each iteration (Megatron's micro-batch calculator) and the number of
iterations --train-samples implies.

The batch is a function of the samples consumed before the iteration:
- constant: --global-batch-size;
- --rampup-batch-size START INCR SAMPLES: START, growing by INCR in (G - START) / INCR equal
  slices of SAMPLES consumed samples, then G = --global-batch-size (Megatron's rampup
  calculator, float slice length and all);
- --step-batch-size-schedule "THRESHOLD:BS ...": BS from the first consumed-token THRESHOLD
  on (K/M/B/T suffixes; tokens become samples by // --seq-length, as Megatron passes it).
Every batch must split into micro-batches over the data-parallel ranks (and, interleaved,
into a multiple of the pipeline size): checked up front, one line naming the values.
"""

import bisect

from megalite.config import ConfigError

_SUFFIX = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def parse_step_schedule(text, seq_length=None):
    """'0:16 2.4B:320 ...' -> [(threshold in samples, batch size)], sorted, as Megatron parses it."""
    def number(s):
        s = s.strip().upper()
        mult = _SUFFIX.get(s[-1:], 1)
        return int(float(s[:-1] if mult > 1 else s) * mult)

    entries = []
    for entry in text.strip().strip("'\"").replace(",", " ").split():
        try:
            threshold, bs = entry.split(":", 1)
            threshold, bs = number(threshold), number(bs)
        except ValueError:
            raise ConfigError(f"--step-batch-size-schedule {text!r}: entry {entry!r} is not THRESHOLD:BATCH_SIZE "
                              "(e.g. \"0:16 2.4B:320\")") from None
        entries.append((threshold // seq_length if seq_length else threshold, bs))
    entries.sort()
    if not entries or entries[0][0] != 0:
        raise ConfigError(f"--step-batch-size-schedule {text!r}: the first threshold must be 0")
    for (t0, _), (t1, _) in zip(entries, entries[1:]):
        if t1 <= t0:
            raise ConfigError(f"--step-batch-size-schedule {text!r}: thresholds must increase (in samples: "
                              f"{t0} then {t1})")
    if any(bs <= 0 for _, bs in entries):
        raise ConfigError(f"--step-batch-size-schedule {text!r}: batch sizes must be positive")
    return entries


DUALPIPE_V = "dualpipev"  # (interleaving_problem's group for --pipeline-schedule dualpipev: its count rule)


def interleaving_problem(m, pp, group=None):
    """Why m micro-batches cannot run the interleaved schedule, or None. Megatron's rules: groups of
    G contiguous micro-batches per virtual stage (--microbatch-group-size-per-virtual-pipeline-stage,
    default PP), PP <= G <= m, and a last group of 0 or at least PP micro-batches. group DUALPIPE_V:
    DualPipeV's rule instead, at least 2 PP micro-batches (a full V in flight)."""
    if group == DUALPIPE_V:
        return None if m >= 2 * pp else (f"--pipeline-schedule dualpipev needs at least 2 x "
                                         f"--pipeline-model-parallel-size {pp} = {2 * pp} micro-batches, not {m}")
    g = pp if group is None or group is True else group
    if group in (None, True) and m % pp:
        return (f"interleaved pipelining needs the number of micro-batches ({m}) to be a multiple of "
                f"--pipeline-model-parallel-size {pp} (or a --microbatch-group-size-per-virtual-pipeline-stage "
                f"with a last group of 0 or >= {pp})")
    if not pp <= g <= m:
        return (f"--microbatch-group-size-per-virtual-pipeline-stage {g} must lie in [PP={pp}, micro-batches={m}]")
    if 0 < m % g < pp:
        return (f"{m} micro-batches in groups of --microbatch-group-size-per-virtual-pipeline-stage {g} leave a last "
                f"group of {m % g}, fewer than --pipeline-model-parallel-size {pp}")
    return None


class BatchSchedule:
    """global_batch_size(consumed) and num_microbatches(consumed) for the iteration that
    starts after `consumed` samples."""

    def __init__(self, global_batch_size, micro_batch_size, data_parallel_size, rampup=None, steps=None):
        self.micro, self.dp, self.rampup, self.steps = micro_batch_size, data_parallel_size, rampup, steps
        self.final = steps[-1][1] if steps else global_batch_size
        if rampup is not None:
            start, incr, _ = rampup
            flag = f"--rampup-batch-size {' '.join(map(str, rampup))}"
            if start > self.final:
                raise ConfigError(f"{flag}: the start batch {start} exceeds --global-batch-size {self.final}")
            if (self.final - start) % incr:
                raise ConfigError(f"{flag}: --global-batch-size {self.final} minus the start batch {start} "
                                  f"= {self.final - start} is not divisible by the increment {incr}")
            self.increments = (self.final - start) // incr

    def global_batch_size(self, consumed):
        if self.rampup is not None:
            start, incr, samples = self.rampup
            if consumed > samples or self.increments == 0:
                return self.final
            # Megatron's float slice length: the same rounding at slice boundaries.
            return start + int(consumed / (samples / self.increments)) * incr
        if self.steps:
            return self.steps[bisect.bisect_right([t for t, _ in self.steps], consumed) - 1][1]
        return self.final

    def num_microbatches(self, consumed):
        return self.global_batch_size(consumed) // (self.micro * self.dp)

    def is_constant(self):
        return self.rampup is None and not self.steps

    def batch_sizes(self, consumed=0):
        """Every batch size an iteration from `consumed` on can have."""
        if self.rampup is not None:
            start, incr, samples = self.rampup
            first = self.global_batch_size(consumed)
            return list(range(first, self.final, incr)) + [self.final] if consumed <= samples else [self.final]
        if self.steps:
            i = bisect.bisect_right([t for t, _ in self.steps], consumed) - 1
            return [bs for _, bs in self.steps[i:]]
        return [self.final]

    def check(self, consumed=0, pipeline_size=1, interleaved=False, what=None):
        """Each reachable batch splits into micro-batches (interleaved: True, or the micro-batch group
        size: interleaving_problem's rules); else one ConfigError line naming the values."""
        m = self.micro * self.dp
        what = what or ("--global-batch-size" if self.is_constant() else
                        "--rampup-batch-size" if self.rampup is not None else "--step-batch-size-schedule")
        for bs in self.batch_sizes(consumed):
            if bs % m:
                raise ConfigError(f"{what}: global batch {bs} is not divisible by --micro-batch-size {self.micro} x "
                                  f"data-parallel size {self.dp} = {m}")
            if interleaved and (why := interleaving_problem(bs // m, pipeline_size, interleaved)):
                raise ConfigError(f"{what}: global batch {bs}: {why}")

    def iterations_for(self, train_samples):
        """Iterations --train-samples trains: train_samples // G at a constant batch (the partial
        last batch is dropped, as Megatron), else until the consumed samples reach it."""
        if self.is_constant():
            return train_samples // self.final
        n = consumed = 0
        while consumed < train_samples:
            if self.rampup is not None and consumed > self.rampup[2]:  # constant from here: skip ahead
                rest = -(-(train_samples - consumed) // self.final)
                return n + rest
            consumed += self.global_batch_size(consumed)
            n += 1
        return n

    def samples_for(self, iterations, consumed=0):
        """Samples `iterations` iterations consume from `consumed` on."""
        start = consumed
        for done in range(iterations):
            if self.is_constant() or self.rampup is not None and consumed > self.rampup[2]:
                return consumed - start + (iterations - done) * self.final  # constant from here
            consumed += self.global_batch_size(consumed)
        return consumed - start
