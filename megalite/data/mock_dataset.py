"""--mock-data: deterministic random tokens, sample i drawn from a generator seeded by (seed, i).

A sample does not depend on how many ranks read it or in which order, so runs with
different parallel layouts see exactly the same global batches.
"""

import numpy as np


class MockGPTDataset:
    def __init__(self, num_samples, seq_length, vocab_size, seed, split_id=0):
        self.num_samples, self.seq_length, self.vocab_size = int(num_samples), int(seq_length), int(vocab_size)
        self.seed, self.split_id = int(seed), int(split_id)

    def __len__(self):
        return self.num_samples

    def __getitem__(self, i):
        if not 0 <= i < self.num_samples:
            raise IndexError(f"mock sample {i} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, self.split_id, int(i)])
        return {"text": rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)}
