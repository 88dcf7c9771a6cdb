"""Megatron's pretraining sampler: the global sample stream is consumed_samples,
consumed_samples + 1, ...; each step takes micro_batch_size * data_parallel_size of them
and data-parallel rank r reads the r-th micro_batch_size slice. The stream depends only
on consumed_samples, so a resumed run continues exactly, with any data-parallel size."""

from __future__ import annotations


class MegatronPretrainingSampler:
    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise ValueError(f"sampler: no samples to read (total_samples={total_samples}); "
                             f"the dataset is empty")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"sampler: consumed samples {consumed_samples} is not below the "
                             f"dataset's {total_samples} samples; train for fewer iterations "
                             f"or build the dataset with more samples")
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size {micro_batch_size}: must be positive")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"sampler: data-parallel rank {data_parallel_rank} is not in "
                             f"[0, {data_parallel_size})")
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_rank = int(data_parallel_rank)
        self.data_parallel_size = int(data_parallel_size)
        self.drop_last = drop_last
        self._step = self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        return remaining // self._step if self.drop_last else -(-remaining // self._step)

    def __iter__(self):
        lo = self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples, self._step):
            end = start + self._step
            if end > self.total_samples:
                if self.drop_last:
                    return
                # Partial last step, sliced exactly as Megatron slices its short batch.
                batch = list(range(start, self.total_samples))
                if batch[lo:lo + self.micro_batch_size]:
                    yield batch[lo:lo + self.micro_batch_size]
                return
            yield list(range(start + lo, start + lo + self.micro_batch_size))


class SharesPretrainingSampler(MegatronPretrainingSampler):
    """--data-parallel-shares: each global batch (the next G samples of the stream) is cut into
    contiguous runs in DP rank order, rank r's being n_r micro-batches long (the iteration plan,
    megalite/batching/iteration_plan.py, says G and n_r). The runs of one batch are disjoint and cover it,
    and the stream depends only on consumed_samples, so a resumed run continues exactly, also
    with other shares."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, plan):
        super().__init__(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, plan.dp)
        self.plan = plan

    def _iterations(self):
        """(consumed samples at the iteration's start, this rank's micro-batch count) per whole batch."""
        consumed = self.consumed_samples
        while consumed + self.plan.global_batch_size(consumed) <= self.total_samples:
            yield consumed, self.plan.num_microbatches(consumed, self.data_parallel_rank)
            consumed += self.plan.global_batch_size(consumed)

    def __len__(self) -> int:
        if self.plan.schedule.is_constant():
            g = self.plan.global_batch_size(self.consumed_samples)
            n = self.plan.num_microbatches(self.consumed_samples, self.data_parallel_rank)
            return (self.total_samples - self.consumed_samples) // g * n
        return sum(n for _, n in self._iterations())

    def __iter__(self):
        m = self.micro_batch_size
        for consumed, n in self._iterations():
            first = self.plan.first_sample(consumed, self.data_parallel_rank)
            for k in range(n):
                yield list(range(first + k * m, first + (k + 1) * m))
