"""Megatron's BlendedDataset: sample k comes from the dataset whose share is furthest behind
its weight (greedy sampling-error assignment), so every prefix of the sample stream
matches the weights as closely as whole samples allow."""

from __future__ import annotations

import numpy as np

from .gpt_dataset import describe, load_cached, save_cached


def build_blending_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each sample k: (dataset id, sample index within that dataset). Sequential by
    nature (each pick depends on all earlier ones); plain Python floats keep it ~1 us/pick."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    ids = np.empty(size, dtype=np.int16 if len(w) < 2**15 else np.int32)
    within = np.empty(size, dtype=np.int64)
    rng_k = range(len(w))
    for k in range(size):
        n = float(max(k, 1))
        best, best_err = 0, w[0] * n - counts[0]
        for i in rng_k:
            err = w[i] * n - counts[i]
            if err > best_err:  # strict: ties go to the lowest id, as Megatron
                best, best_err = i, err
        ids[k] = best
        within[k] = counts[best]
        counts[best] += 1
    return ids, within


class BlendedDataset:
    """`size` samples drawn from `datasets` in proportion to `weights` (normalised)."""

    def __init__(self, datasets: list, weights: list[float], size: int, cache_dir: str,
                 split_name: str = "train", load_only: bool = False):
        total = float(sum(weights))
        self.datasets, self.weights = datasets, [float(w) / total for w in weights]
        self.size = int(size)
        self.description, digest = describe({
            "class": "BlendedDataset", "split": split_name, "size": self.size,
            "weights": self.weights, "datasets": [d.description for d in datasets]})
        stem = f"{digest}-BlendedDataset-{split_name}"
        idx = load_cached(cache_dir, stem, ("dataset_index", "dataset_sample_index"))
        if idx is None:
            if load_only:
                raise RuntimeError(f"BlendedDataset {split_name} indices are missing in {cache_dir}: "
                                   f"the building rank failed or does not share this directory")
            ids, within = build_blending_indices(self.weights, self.size)
            for i, d in enumerate(datasets):
                used = int(within[ids == i].max(initial=-1)) + 1
                if used > len(d):
                    raise ValueError(f"blend needs {used} samples from dataset {i} "
                                     f"but it has {len(d)}; raise its num_samples")
            idx = {"dataset_index": ids, "dataset_sample_index": within}
            save_cached(cache_dir, stem, self.description, idx)
        self.dataset_index = idx["dataset_index"]
        self.dataset_sample_index = idx["dataset_sample_index"]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        if not -self.size <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for {self.size} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
