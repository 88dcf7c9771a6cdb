"""Megatron's GPT dataset: fixed-length samples of seq_length + 1 tokens cut from the
shuffled stream of documents, with Megatron's three indices:

- document index: the split's documents repeated once per epoch, each epoch shuffled
  (the last epoch shuffled on its own when only a small part of it is used);
- sample index: for sample i, the (document-index position, offset) where it starts; sample
  i covers stream positions [i*L, i*L + L] (inclusive), so consecutive samples share one
  token, as in Megatron;
- shuffle index: a permutation of the samples.

Built with numpy (a cumulative sum and one searchsorted instead of a per-token loop) from a
numpy RandomState(seed) in Megatron's order, so the indices equal Megatron's for the same
inputs, and cached as .npy files keyed by an md5 of everything that defines them."""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np

from .indexed_dataset import IndexedDataset, index_file_path

INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


def parse_split(split: str) -> list[float]:
    """'949,50,1' (or '949/50/1', or fewer parts) -> three weights summing to 1."""
    try:
        parts = [float(s) for s in split.replace("/", ",").split(",") if s.strip()]
    except ValueError:
        parts = []
    if not parts or len(parts) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {split!r}: expected up to three non-negative numbers with a "
                         f"positive sum, e.g. 949,50,1")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_ranges(weights: list[float], num_docs: int) -> list[tuple[int, int]]:
    """Megatron-core's book-ends: boundary k = round(cumulative weight k * num_docs)."""
    cum = np.concatenate(([0.0], np.cumsum(weights)))
    bounds = [int(round(float(c) * num_docs)) for c in cum]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def build_document_index(documents: np.ndarray, num_epochs: int, rng, separate_final_epoch: bool):
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    """[num_samples + 1, 2] rows of (position in document_index, token offset)."""
    cum = np.zeros(len(document_index) + 1, dtype=np.int64)
    np.cumsum(sizes[document_index], out=cum[1:])
    num_samples = (int(cum[-1]) - 1) // seq_length
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right" skips empty documents and puts a start on a boundary at offset 0.
    doc = np.searchsorted(cum, starts, side="right") - 1
    dtype = np.int32 if max(len(document_index), int(sizes.max(initial=0))) < 2**31 else np.int64
    return np.stack((doc, starts - cum[doc]), axis=1).astype(dtype)


def build_shuffle_index(num_samples: int, total_size: int, rng) -> np.ndarray:
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def file_identity(prefix: str) -> dict:
    """What identifies a dataset's contents cheaply: path plus the index file's size/mtime."""
    st = os.stat(index_file_path(prefix))
    return {"path_prefix": os.path.abspath(prefix), "idx_size": st.st_size, "idx_mtime_ns": st.st_mtime_ns}


def save_cached(cache_dir: str, stem: str, description: str, arrays: dict) -> None:
    """Write each array to a temp name and rename, the description last: a reader that
    sees the description sees complete arrays, whatever the builder was doing."""
    os.makedirs(cache_dir, exist_ok=True)
    for name, arr in arrays.items():
        tmp = os.path.join(cache_dir, f".{stem}-{name}.{os.getpid()}.npy")
        np.save(tmp, arr)
        os.replace(tmp, os.path.join(cache_dir, f"{stem}-{name}.npy"))
    tmp = os.path.join(cache_dir, f".{stem}.{os.getpid()}.dsc")
    with open(tmp, "w") as f:
        f.write(description)
    os.replace(tmp, os.path.join(cache_dir, f"{stem}-description.txt"))


def load_cached(cache_dir: str, stem: str, names) -> dict | None:
    if not os.path.isfile(os.path.join(cache_dir, f"{stem}-description.txt")):
        return None
    return {n: np.load(os.path.join(cache_dir, f"{stem}-{n}.npy"), mmap_mode="r") for n in names}


def describe(obj: dict) -> tuple[str, str]:
    text = json.dumps(obj, indent=2, sort_keys=True)
    return text, hashlib.md5(text.encode()).hexdigest()


class GPTDataset:
    """`dataset[i] -> {"text": int64 array of seq_length + 1 tokens}`."""

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: int,
                 seq_length: int, seed: int, cache_dir: str, split_name: str = "train",
                 load_only: bool = False):
        self.indexed, self.seq_length = indexed, int(seq_length)
        documents = np.asarray(documents, dtype=np.int64)
        sizes = indexed.sequence_lengths
        tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
        if tokens_per_epoch == 0:
            raise ValueError(f"{indexed.path_prefix}: the {split_name} split "
                             f"({len(documents)} documents) holds no tokens; change --split")
        self.description, digest = describe({
            "class": "GPTDataset", "dataset": file_identity(indexed.path_prefix),
            "split": split_name, "documents": [int(documents[0]), int(documents[-1]) + 1],
            "num_samples": int(num_samples), "seq_length": self.seq_length, "seed": int(seed)})
        self.cache_dir = cache_dir
        self._stem = stem = f"{digest}-GPTDataset-{split_name}"
        idx = load_cached(cache_dir, stem, INDEX_NAMES)
        if idx is None:
            if load_only:
                raise RuntimeError(f"GPTDataset {split_name} indices for {indexed.path_prefix} are "
                                   f"missing in {cache_dir}: the building rank failed or does not "
                                   f"share this directory; set --data-cache-path to a shared path")
            t0 = time.perf_counter()  # a long step on big corpora: say what is happening
            print(f"megalite: building GPT dataset indices ({split_name}, {int(num_samples):,} samples of "
                  f"{self.seq_length} tokens) for {indexed.path_prefix} ...", flush=True)
            idx = self._build(sizes, documents, int(num_samples), tokens_per_epoch, int(seed))
            save_cached(cache_dir, stem, self.description, idx)
            print(f"megalite: GPT dataset indices ({split_name}) built in {time.perf_counter() - t0:.1f} s, cached "
                  f"in {cache_dir}", flush=True)
        self.document_index = idx["document_index"]
        self.sample_index = idx["sample_index"]
        self.shuffle_index = idx["shuffle_index"]

    def _build(self, sizes, documents, num_samples, tokens_per_epoch, seed) -> dict:
        L = self.seq_length
        # Fewest epochs whose stream yields num_samples samples of L + 1 tokens.
        num_epochs = max(1, -(-(num_samples * L + 1) // tokens_per_epoch))
        separate_final_epoch = False
        if num_epochs > 1:
            before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // L
            per_epoch = (tokens_per_epoch - 1) // L
            separate_final_epoch = (num_samples - before_final) < int(0.80 * per_epoch)
        rng = np.random.RandomState(seed)
        document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
        sample_index = build_sample_index(sizes, document_index, L)
        total = sample_index.shape[0] - 1
        shuffled = ((num_epochs - 1) * tokens_per_epoch - 1) // L if separate_final_epoch else total
        shuffle_index = build_shuffle_index(shuffled, total, rng)
        return {"document_index": document_index, "sample_index": sample_index,
                "shuffle_index": shuffle_index}

    def __getstate__(self):  # pickled (spawned DataLoader workers): re-map the cached indices
        state = dict(self.__dict__)
        for name in INDEX_NAMES:
            state[name] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__dict__.update(load_cached(self.cache_dir, self._stem, INDEX_NAMES))

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int) -> dict:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        i = int(self.shuffle_index[idx])
        (d0, o0), (d1, o1) = self.sample_index[i], self.sample_index[i + 1]
        doc, get = self.document_index, self.indexed.get
        if d0 == d1:
            parts = [get(int(doc[d0]), int(o0), int(o1 - o0 + 1))]
        else:
            parts = [get(int(doc[d0]), int(o0))]
            parts += [get(int(doc[d])) for d in range(d0 + 1, d1)]
            parts.append(get(int(doc[d1]), 0, int(o1) + 1))
        return {"text": np.concatenate(parts).astype(np.int64)}
