"""Tokenize a `datasets.Dataset` into Megatron `{prefix}_{key}_{document|sentence}.bin/.idx`.

Parallelism: the documents are cut into contiguous chunks; a pool of forked workers (each
with its own tokenizer, reading its chunk straight from the memory-mapped Arrow table)
returns flat numpy token arrays, and the parent appends them in order. Only compact
arrays cross process boundaries, so each worker spends its time in the tokenizer, which
encodes a whole chunk per call where that is faster (`tokenizers`' Rust encode_batch for
GPT2BPETokenizer and HuggingFaceTokenizer)."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import re
import resource
import sys
import time
from dataclasses import dataclass

import numpy as np

from .indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path, optimal_dtype
from .tokenizer import build_tokenizer

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """Rule-based sentence splitter (Megatron uses nltk punkt, which needs a download)."""
    parts = [s for s in _SENTENCE_END.split(text) if s.strip()]
    return parts if keep_newlines else [" ".join(s.split("\n")) for s in parts]


def split_lines(text: str) -> list[str]:
    """Each non-blank line (with its newline) as a sentence: how code splits into sentences."""
    return [line + "\n" for line in text.split("\n") if line.strip()]


@dataclass
class PreprocessConfig:
    json_keys: list[str]
    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    append_eod: bool = False
    split_sentences: bool = False
    sentence_splitter: str = "punctuation"  # or "lines" (code: the default corpus for BERT)
    keep_newlines: bool = False
    workers: int = 1
    log_interval: int = 1000
    chunk_docs: int | None = None  # documents per task; None = sized from len and workers

    def build_tokenizer(self):
        return build_tokenizer(self.tokenizer_type, self.tokenizer_model, self.vocab_size,
                               vocab_file=self.vocab_file, merge_file=self.merge_file)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


_W: dict = {}  # per-process worker state (dataset, tokenizer, config)


def _init_worker(ds, cfg: PreprocessConfig) -> None:
    if cfg.workers > 1:  # the worker processes use the cores; Rust threads on top oversubscribe them
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _W["ds"], _W["cfg"] = ds, cfg
    _W["tok"] = cfg.build_tokenizer()
    _W["dtype"] = optimal_dtype(_W["tok"].vocab_size)


def _encode_chunk(bounds: tuple[int, int]):
    """Tokenize documents [start, end); per key: (tokens, sequence lengths, sequences per doc)."""
    ds, cfg, tok = _W["ds"], _W["cfg"], _W["tok"]
    rows = ds[bounds[0]:bounds[1]]
    out, n_chars = {}, 0
    # Batches where encoding runs in Rust off the GIL; sentencepiece's list call costs more CPU.
    batch = tok.tokenize_batch if getattr(tok, "batch_encodes_faster", False) else None
    for key in cfg.json_keys:
        pieces, per_doc = [], []  # every document's pieces, flattened for one batch call
        for text in rows[key]:
            text = "" if text is None else str(text)
            n_chars += len(text)
            if not cfg.split_sentences:
                doc = [text]
            elif cfg.sentence_splitter == "lines":
                doc = split_lines(text)
            else:
                doc = split_sentences(text, cfg.keep_newlines)
            pieces.extend(doc)
            per_doc.append(len(doc))
        encoded = batch(pieces) if batch is not None and pieces else [tok.tokenize(p) for p in pieces]
        seqs, counts, pos = [], [], 0
        for n in per_doc:
            # As Megatron: empty sentences are dropped; eod goes on the document's last one.
            ids = [s for s in encoded[pos:pos + n] if len(s)]
            pos += n
            if ids and cfg.append_eod:
                ids[-1] = list(ids[-1]) + [tok.eod]
            seqs.extend(ids)
            counts.append(len(ids))
        per_doc = counts
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=_W["dtype"],
                           count=int(lengths.sum()))
        out[key] = (flat, lengths, np.asarray(per_doc, dtype=np.int64))
    return bounds[1] - bounds[0], n_chars, out


def partition_order(num_docs: int, partitions: int) -> list[int]:
    """Document order of Megatron's `--partitions N` (without --keep-sequential-samples):
    input line i goes to partition i % N, and the partitions are concatenated in turn."""
    return [i for p in range(partitions) for i in range(p, num_docs, partitions)]


def output_prefixes(output_prefix: str, cfg: PreprocessConfig) -> dict[str, str]:
    level = "sentence" if cfg.split_sentences else "document"
    return {key: f"{output_prefix}_{key}_{level}" for key in cfg.json_keys}


def preprocess_dataset(ds, output_prefix: str, cfg: PreprocessConfig, log=print) -> dict:
    """Write the files; return {"documents", "tokens", "seconds", "tokens_per_second", "prefixes"}."""
    tok = cfg.build_tokenizer()
    if cfg.append_eod and tok.eod is None:
        raise ValueError(f"--append-eod: tokenizer {cfg.tokenizer_type} defines no end-of-document token")
    dtype = optimal_dtype(tok.vocab_size)
    prefixes = output_prefixes(output_prefix, cfg)
    builders = {k: IndexedDatasetBuilder(data_file_path(p), dtype) for k, p in prefixes.items()}

    n = len(ds)
    workers = max(1, int(cfg.workers))
    chunk = cfg.chunk_docs or max(1, min(1024, -(-n // (workers * 64))))  # ~64 tasks/worker: even tail
    tasks = [(s, min(n, s + chunk)) for s in range(0, n, chunk)]
    docs = tokens = chars = 0
    next_log = cfg.log_interval
    t0, cpu0, kids0 = time.perf_counter(), time.process_time(), _children_cpu()
    if workers == 1:
        _init_worker(ds, cfg)
        results, pool = map(_encode_chunk, tasks), None
    else:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(ds, cfg))
        results = pool.imap(_encode_chunk, tasks)
    try:
        for n_docs, n_chars, per_key in results:
            for key, (flat, lengths, per_doc) in per_key.items():
                builders[key].add_arrays(flat, lengths, per_doc)
                tokens += flat.size
            docs += n_docs
            chars += n_chars
            if cfg.log_interval and docs >= next_log:
                next_log += cfg.log_interval * max(1, (docs - next_log) // cfg.log_interval + 1)
                dt = time.perf_counter() - t0
                log(f"Processed {docs}/{n} documents ({docs / dt:.1f} docs/s, "
                    f"{chars / dt / 1e6:.2f} MB/s, {tokens / dt:,.0f} tokens/s).")
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    for key, b in builders.items():
        b.finalize(index_file_path(prefixes[key]))
    seconds = time.perf_counter() - t0
    # CPU seconds of the whole job (this process + its reaped workers, start-up included):
    # unlike wall time it does not depend on what else the machine is running.
    cpu = time.process_time() - cpu0 + _children_cpu() - kids0
    return {"documents": docs, "tokens": tokens, "seconds": seconds,
            "tokens_per_second": tokens / max(seconds, 1e-9), "cpu_seconds": cpu,
            "prefixes": prefixes}


def summary_line(stats: dict, workers: int) -> str:
    return (f"Done: {stats['documents']} documents, {stats['tokens']} tokens in "
            f"{stats['seconds']:.2f} s = {stats['tokens_per_second']:,.0f} tokens/s "
            f"({workers} workers; {stats['tokens'] / max(stats['cpu_seconds'], 1e-9):,.0f} tokens per "
            f"CPU-second) -> {', '.join(p + '.bin/.idx' for p in stats['prefixes'].values())}")


def main_guard(fn):
    """Run a CLI body; a user error becomes one line on stderr and exit status 1."""
    try:
        return fn()
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
