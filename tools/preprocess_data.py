"""Tokenize text into Megatron-format `{output_prefix}_{key}_{document|sentence}.bin/.idx`.

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \
        --output-prefix out --append-eod --workers 2

--input: a .json/.jsonl/.parquet/.csv/.txt file (or a glob of them) read with
`datasets.load_dataset`, or a directory written by `Dataset.save_to_disk`. Local only."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.data.preprocess import (PreprocessConfig, main_guard, preprocess_dataset,  # noqa: E402
                                      summary_line)
from megalite.data.text_input import check_keys, load_text_dataset  # noqa: E402
from megalite.data.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402

# Megatron flags megalite does not implement: refused by name, never silently ignored.
_UNSUPPORTED = {"--merge-file": "GPT-2 BPE merges", "--vocab-extra-ids": "T5 extra ids",
                "--partitions": "partitioned preprocessing", "--lang": "nltk languages",
                "--keep-sequential-samples": "sequential partition samples"}


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="file, glob, or save_to_disk directory")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize")
    g.add_argument("--split-sentences", action="store_true", help="one sequence per sentence")
    g.add_argument("--keep-newlines", action="store_true", help="keep newlines inside sentences")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None, help="sentencepiece .model or HF directory")
    g.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    g.add_argument("--vocab-file", default=None, help="for BertWordPieceLowerCase/Case: a WordPiece vocab.txt")
    g.add_argument("--append-eod", action="store_true", help="append <eod> to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True)
    g.add_argument("--dataset-impl", default="mmap", choices=["mmap"], help="only mmap exists")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    for flag in _UNSUPPORTED:
        p.add_argument(flag, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for flag, what in _UNSUPPORTED.items():
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            raise ValueError(f"{flag}: {what} are not supported by megalite; "
                             f"use --tokenizer-type SentencePieceTokenizer or HuggingFaceTokenizer")
    if args.vocab_file is not None:
        if not args.tokenizer_type.startswith("BertWordPiece"):
            raise ValueError(f"--vocab-file is for BertWordPieceLowerCase/Case, not --tokenizer-type {args.tokenizer_type}")
        args.tokenizer_model = args.vocab_file
    if args.workers < 1:
        raise ValueError(f"--workers {args.workers}: must be at least 1")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise FileNotFoundError(f"--output-prefix {args.output_prefix}: directory {out_dir} does not exist")
    return args


def main(argv=None):
    args = get_args(argv)
    # Check the tokenizer before the (possibly slow) load so a bad model fails at once.
    build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    t0 = time.perf_counter()
    ds = load_text_dataset(args.input)
    check_keys(ds, args.json_keys, args.input)
    print(f"Loaded {len(ds)} documents from {args.input} in {time.perf_counter() - t0:.2f} s", flush=True)
    cfg = PreprocessConfig(json_keys=args.json_keys, tokenizer_type=args.tokenizer_type,
                           tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
                           append_eod=args.append_eod, split_sentences=args.split_sentences,
                           keep_newlines=args.keep_newlines, workers=args.workers,
                           log_interval=args.log_interval)
    stats = preprocess_dataset(ds, args.output_prefix, cfg, log=lambda s: print(s, flush=True))
    if stats["tokens"] == 0:
        raise ValueError(f"--input {args.input}: the documents produced no tokens (all empty?)")
    print(summary_line(stats, args.workers), flush=True)
    return stats


if __name__ == "__main__":
    main_guard(main)
