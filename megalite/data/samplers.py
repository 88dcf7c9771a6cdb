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
