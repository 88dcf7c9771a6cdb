"""`build_gpt_datasets`: --data-path / --split / sample counts -> (train, valid, test).

Every rank validates the inputs (so a user error is raised everywhere, before any
barrier); the builder rank writes the index caches; all ranks meet at `barrier`; the
others then load the caches. If the builder fails it still reaches the barrier, so no
rank hangs: the others report the missing cache."""

from __future__ import annotations

import math
import os
from typing import Callable

import numpy as np

from .blended_dataset import BlendedDataset
from .gpt_dataset import GPTDataset, parse_split, split_ranges
from .indexed_dataset import IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's forms: [prefix], [w1, p1, w2, p2, ...], or [p1, p2, ...] (no weights)."""
    if isinstance(data_path, str):
        data_path = data_path.split()
    data_path = [str(x) for x in data_path]
    if not data_path:
        raise ValueError("--data-path is empty; give a prefix such as out_text_document")
    if len(data_path) == 1:
        return data_path, None

    def weight(s):
        try:
            return float(s)
        except ValueError:
            return None

    if weight(data_path[0]) is None:  # plain list of prefixes: blend by size
        return data_path, None
    if len(data_path) % 2:
        raise ValueError(f"--data-path {' '.join(data_path)}: expected weight/prefix pairs "
                         f"(got an odd number of values)")
    weights, prefixes = [], []
    for w, p in zip(data_path[0::2], data_path[1::2]):
        if weight(w) is None or weight(w) < 0:
            raise ValueError(f"--data-path: {w!r} is not a non-negative weight (before prefix {p})")
        weights.append(weight(w))
        prefixes.append(p)
    if sum(weights) <= 0:
        raise ValueError(f"--data-path: the weights {weights} sum to zero")
    return prefixes, weights


def default_cache_dir(prefix: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", "GPTDataset_indices")


def split_document_counts(data_path: list[str], split: str, documents: bool = False) -> tuple[list[int], int]:
    """([train, valid, test] documents --split gives each split, total) over --data-path's
    prefixes. GPT splits sequences, as Megatron; BERT whole documents (documents=True)."""
    prefixes, _ = parse_data_path(data_path)
    weights, counts, total = parse_split(split), [0, 0, 0], 0
    for p in prefixes:
        d = IndexedDataset(p)
        n = d.num_documents if documents else len(d)
        total += n
        for s, (lo, hi) in enumerate(split_ranges(weights, n)):
            counts[s] += hi - lo
    return counts, total


def build_gpt_datasets(data_path: list[str], split: str, seq_length: int, seed: int,
                       num_samples: tuple[int, int, int], cache_path: str | None,
                       is_builder: bool = True, barrier: Callable[[], None] = lambda: None):
    """Return (train, valid, test); None for a split with no documents. A sample count
    <= 0 means one epoch of that split (blends: as many samples as the weights allow)."""
    if seq_length <= 0:
        raise ValueError(f"--seq-length {seq_length}: must be positive")
    prefixes, weights = parse_data_path(data_path)
    split_weights = parse_split(split)
    indexed = [IndexedDataset(p) for p in prefixes]  # validated on every rank
    if weights is None and len(prefixes) > 1:
        weights = [float(d.num_tokens) for d in indexed]
    ranges = [split_ranges(split_weights, len(d)) for d in indexed]
    for d, rs in zip(indexed, ranges):
        for (lo, hi), name in zip(rs, SPLIT_NAMES):
            if hi > lo and int(d.sequence_lengths[lo:hi].sum(dtype=np.int64)) == 0:
                raise ValueError(f"{d.path_prefix}: the {name} split (documents {lo}..{hi}) holds no "
                                 f"tokens; change --split")
    if split_weights[0] > 0 and all(r[0][1] == r[0][0] for r in ranges):
        raise ValueError(f"--split {split}: the train split gets no documents from {prefixes}")

    def build_all(load_only: bool):
        out = []
        for s, name in enumerate(SPLIT_NAMES):
            n = int(num_samples[s]) if num_samples[s] is not None else 0
            parts, part_weights = [], []
            for i, d in enumerate(indexed):
                lo, hi = ranges[i][s]
                if hi <= lo or split_weights[s] == 0 or (weights and weights[i] == 0):
                    continue
                w = 1.0 if weights is None else weights[i] / sum(weights)
                # As Megatron: ask each blended part for 0.5% more than its share.
                want = n if weights is None else (math.ceil(math.ceil(n * w) * 1.005) if n > 0 else 0)
                cache = cache_path or default_cache_dir(d.path_prefix)
                parts.append(GPTDataset(d, np.arange(lo, hi), want, seq_length, seed, cache,
                                        name, load_only))
                part_weights.append(w)
            if not parts:
                out.append(None)
            elif weights is None:
                out.append(parts[0])
            else:
                size = n if n > 0 else int(min(len(p) / w for p, w in zip(parts, part_weights)
                                               if w > 0))
                cache = cache_path or default_cache_dir(prefixes[0])
                out.append(BlendedDataset(parts, part_weights, size, cache, name, load_only))
        return tuple(out)

    result, error = None, None
    if is_builder:
        try:
            result = build_all(load_only=False)
        except Exception as exc:  # still meet the others at the barrier, then raise
            error = exc
    barrier()
    if error is not None:
        raise error
    if not is_builder:
        result = build_all(load_only=True)
    return result



def build_gpt_datasets_per_split(paths, seq_length, seed, num_samples, cache_path, is_builder=True,
                                 barrier=lambda: None):
    """(train, valid, test) from a data path per split (Megatron's --train/--valid/--test-data-path: each a prefix or
    a blend, all of its documents that split's); None for a split without one."""
    out = []
    for s, path in enumerate(paths):
        if not path:
            out.append(None)
            continue
        whole = ",".join("1" if i == s else "0" for i in range(3))  # (every document to this split)
        wanted = tuple(n if i == s else 0 for i, n in enumerate(num_samples))
        out.append(build_gpt_datasets(path, whole, seq_length, seed, wanted, cache_path, is_builder, barrier)[s])
    return tuple(out)
