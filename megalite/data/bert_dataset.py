"""Megatron's BERT dataset over sentence-split documents (`preprocess_data.py --split-sentences`).

Samples mapping (cached like the GPT indices): documents are walked sentence by sentence,
epoch after epoch, and a sample is cut whenever its sentences reach a target length
(seq_length - 3 for `[CLS] A [SEP] B [SEP]`, seq_length - 2 without the binary head; with
probability short_seq_prob a shorter random target, as Megatron). With the binary head a
sample needs two sentences (documents with one are skipped). The mapping is shuffled.

A sample is a pure function of (index, seed): `RandomState(seed + index)` picks the split
point between A and B, swaps them with probability 0.5 (sentence order: is_random = 1),
truncates the longer side from a random end, and chooses round(mask_prob x candidates)
positions for MLM among the non-special tokens: 80% become [MASK], 10% a random non-special
token, 10% stay. Output (int64 arrays of seq_length): text, types, labels (-1 where not
predicted), loss_mask, padding_mask (1 = token); is_random and truncated (scalars).
"""

from __future__ import annotations

import math

import numpy as np

from .blended_dataset import BlendedDataset
from .builder import SPLIT_NAMES, default_cache_dir, parse_data_path
from .gpt_dataset import describe, file_identity, load_cached, parse_split, save_cached, split_ranges
from .indexed_dataset import IndexedDataset

MAPPING = ("samples_mapping",)


def special_ids(tokenizer) -> np.ndarray:
    ids = {getattr(tokenizer, n, None) for n in ("cls", "sep", "mask", "pad", "eod", "bos", "eos")}
    return np.array(sorted(i for i in ids if i is not None), dtype=np.int64)


def build_samples_mapping(doc_starts, sizes, num_samples, max_tokens, short_seq_prob, min_sentences, seed):
    """[n, 3] rows of (first sentence, end sentence, target length), shuffled; enough epochs
    over the documents for num_samples (at least one)."""
    rng = np.random.RandomState(seed)
    docs = [(int(a), int(b)) for a, b in zip(doc_starts[:-1], doc_starts[1:]) if b - a >= min_sentences]

    def target():
        return int(rng.randint(2, max_tokens + 1)) if rng.random_sample() < short_seq_prob else max_tokens

    rows = []
    while True:
        for a, b in docs:
            start, size, want = a, 0, target()
            for s in range(a, b):
                size += int(sizes[s])
                if (size >= want or s == b - 1) and s + 1 - start >= min_sentences:
                    rows.append((start, s + 1, want))
                    start, size, want = s + 1, 0, target()
        if not rows:
            raise ValueError(f"no document has {min_sentences} sentences: preprocess with --split-sentences, or use "
                             "--bert-no-binary-head")
        if len(rows) >= num_samples:
            break
    mapping = np.array(rows, dtype=np.int64)
    return mapping[rng.permutation(len(mapping))]


class BertDataset:
    """`dataset[i] -> dict of arrays`, see the module docstring."""

    def __init__(self, indexed: IndexedDataset, documents: tuple[int, int], num_samples: int, seq_length: int,
                 seed: int, cache_dir: str, tokenizer, split_name: str = "train", mask_prob: float = 0.15,
                 short_seq_prob: float = 0.1, binary_head: bool = True, load_only: bool = False):
        self.indexed, self.seq_length, self.seed = indexed, int(seq_length), int(seed)
        self.mask_prob, self.binary_head = float(mask_prob), bool(binary_head)
        for name in ("cls", "sep", "mask", "pad"):
            if getattr(tokenizer, name, None) is None:
                raise ValueError(f"BERT needs a tokenizer with a {name} token; {type(tokenizer).__name__} has none "
                                 "(train a sentencepiece model with tools/train_tokenizer.py --bert-special-tokens)")
        self.cls, self.sep, self.mask, self.pad = tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.pad
        self.specials = special_ids(tokenizer)
        self.random_ids = np.setdiff1d(np.arange(tokenizer.vocab_size, dtype=np.int64), self.specials)
        lo, hi = documents
        self.description, digest = describe({
            "class": "BertDataset", "dataset": file_identity(indexed.path_prefix), "split": split_name,
            "documents": [int(lo), int(hi)], "num_samples": int(num_samples), "seq_length": self.seq_length,
            "seed": self.seed, "short_seq_prob": float(short_seq_prob), "binary_head": self.binary_head})
        self.cache_dir, self._stem = cache_dir, f"{digest}-BertDataset-{split_name}"
        idx = load_cached(cache_dir, self._stem, MAPPING)
        if idx is None:
            if load_only:
                raise RuntimeError(f"BertDataset {split_name} samples mapping for {indexed.path_prefix} is missing in "
                                   f"{cache_dir}: the building rank failed or does not share this directory; set "
                                   "--data-cache-path to a shared path")
            doc_starts = np.asarray(indexed.document_indices[lo:hi + 1], dtype=np.int64)
            idx = {"samples_mapping": build_samples_mapping(
                doc_starts, indexed.sequence_lengths, int(num_samples), self.seq_length - (3 if binary_head else 2),
                float(short_seq_prob), 2 if binary_head else 1, self.seed)}
            save_cached(cache_dir, self._stem, self.description, idx)
        self.samples_mapping = idx["samples_mapping"]

    def __getstate__(self):
        state = dict(self.__dict__)
        state["samples_mapping"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.samples_mapping = load_cached(self.cache_dir, self._stem, MAPPING)["samples_mapping"]

    def __len__(self) -> int:
        return len(self.samples_mapping)

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        start, end, target = (int(v) for v in self.samples_mapping[idx])
        rng = np.random.RandomState((self.seed + idx) % 2 ** 32)
        sents = [np.asarray(self.indexed.get(s), dtype=np.int64) for s in range(start, end)]
        is_random = 0
        if self.binary_head:
            cut = int(rng.randint(1, len(sents)))  # A: sentences [0, cut), B: the rest
            a, b = np.concatenate(sents[:cut]), np.concatenate(sents[cut:])
            if rng.random_sample() < 0.5:
                a, b, is_random = b, a, 1
        else:
            a, b = np.concatenate(sents), np.zeros(0, dtype=np.int64)
        a, b, truncated = truncate_pair(a, b, target, rng)
        if self.binary_head:
            tokens = np.concatenate(([self.cls], a, [self.sep], b, [self.sep]))
            types = np.concatenate((np.zeros(len(a) + 2, np.int64), np.ones(len(b) + 1, np.int64)))
        else:
            tokens = np.concatenate(([self.cls], a, [self.sep]))
            types = np.zeros(len(tokens), np.int64)
        text, labels = self.mask_tokens(tokens, rng)
        n, s = len(tokens), self.seq_length
        out = {"text": np.full(s, self.pad, np.int64), "types": np.zeros(s, np.int64),
               "labels": np.full(s, -1, np.int64), "loss_mask": np.zeros(s, np.int64),
               "padding_mask": np.zeros(s, np.int64)}
        out["text"][:n], out["types"][:n], out["labels"][:n], out["padding_mask"][:n] = text, types, labels, 1
        out["loss_mask"][:n] = labels >= 0
        out["is_random"], out["truncated"] = np.int64(is_random), np.int64(truncated)
        return out

    def mask_tokens(self, tokens, rng):
        return mask_tokens(tokens, rng, self.specials, self.mask, self.random_ids, self.mask_prob)


def mask_tokens(tokens, rng, specials, mask_id, random_ids, mask_prob=0.15):
    """(masked input, labels: the original token where predicted, else -1). round(mask_prob x
    candidates) of the non-special tokens are chosen: 80% become mask_id, 10% a random token
    from random_ids, 10% stay as they are."""
    candidates = np.flatnonzero(~np.isin(tokens, specials))
    labels = np.full(len(tokens), -1, np.int64)
    text = tokens.copy()
    if len(candidates) == 0:
        return text, labels
    k = max(1, int(round(len(candidates) * mask_prob)))
    chosen = np.sort(rng.permutation(candidates)[:k])
    labels[chosen] = tokens[chosen]
    r = rng.random_sample(k)
    text[chosen[r < 0.8]] = mask_id
    rand = chosen[r >= 0.9]
    text[rand] = random_ids[rng.randint(0, len(random_ids), len(rand))]
    return text, labels


def truncate_pair(a, b, max_tokens, rng):
    """Drop tokens from the longer segment, at its front or back at random, until they fit."""
    truncated = len(a) + len(b) > max_tokens
    while len(a) + len(b) > max_tokens:
        if len(a) >= len(b):
            a = a[1:] if rng.random_sample() < 0.5 else a[:-1]
        else:
            b = b[1:] if rng.random_sample() < 0.5 else b[:-1]
    return a, b, truncated


def build_bert_datasets(data_path, split, seq_length, seed, num_samples, cache_path, tokenizer, mask_prob=0.15,
                        short_seq_prob=0.1, binary_head=True, is_builder=True, barrier=lambda: None):
    """(train, valid, test) BertDatasets split by documents (blends as for GPT); None for an
    empty split. Every rank validates; the builder writes the caches; all meet at `barrier`."""
    prefixes, weights = parse_data_path(data_path)
    split_weights = parse_split(split)
    indexed = [IndexedDataset(p) for p in prefixes]
    if weights is None and len(prefixes) > 1:
        weights = [float(d.num_tokens) for d in indexed]
    ranges = [split_ranges(split_weights, d.num_documents) for d in indexed]

    def build_all(load_only):
        out = []
        for s, name in enumerate(SPLIT_NAMES):
            n, parts, part_weights = int(num_samples[s] or 0), [], []
            for i, d in enumerate(indexed):
                lo, hi = ranges[i][s]
                if hi <= lo or (weights and weights[i] == 0):
                    continue
                w = 1.0 if weights is None else weights[i] / sum(weights)
                want = n if weights is None else math.ceil(math.ceil(n * w) * 1.005)
                parts.append(BertDataset(d, (lo, hi), want, seq_length, seed, cache_path or default_cache_dir(
                    d.path_prefix), tokenizer, name, mask_prob, short_seq_prob, binary_head, load_only))
                part_weights.append(w)
            if not parts:
                out.append(None)
            elif weights is None:
                out.append(parts[0])
            else:
                size = n if n > 0 else int(min(len(p) / w for p, w in zip(parts, part_weights)))
                out.append(BlendedDataset(parts, part_weights, size, cache_path or default_cache_dir(prefixes[0]),
                                          name, load_only))
        return tuple(out)

    result, error = None, None
    if is_builder:
        try:
            result = build_all(False)
        except Exception as exc:  # meet the others at the barrier, then raise
            error = exc
    barrier()
    if error is not None:
        raise error
    return result if is_builder else build_all(True)
