"""Tokenize text into Megatron-format `{output_prefix}_{key}_{document|sentence}.bin/.idx`,
with Megatron-LM's tools/preprocess_data.py flags.

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \\
        --output-prefix out --append-eod --workers 2

--input: a .json/.jsonl/.parquet/.csv/.txt file (or a glob of them, read in sorted order)
read with `datasets.load_dataset`, or a directory written by `Dataset.save_to_disk`. Local only.
--tokenizer-type may be left out when --vocab-file and --merge-file are given: it is then
GPT2BPETokenizer, Megatron's GPT default (Megatron's own tool requires the flag).
--split-sentences uses a rule-based splitter (. ! ? followed by space), not nltk punkt.
--partitions N gives Megatron's document order (round robin over N partitions unless
--keep-sequential-samples); the work itself is shared by --workers, and no partition files
are left behind."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.data.preprocess import (PreprocessConfig, main_guard, partition_order,  # noqa: E402
                                      preprocess_dataset, summary_line)
from megalite.data.text_input import check_keys, load_text_dataset  # noqa: E402
from megalite.data.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402

# Megatron flags megalite does not implement: (argparse kwargs, what to do instead).
# All of them that a command passes are refused in one message, never silently ignored.
_UNSUPPORTED = {
    "--find-optimal-num-workers": ({"action": "store_true"}, "time runs with --workers N instead"),
    "--workers-to-check": ({"nargs": "+"}, "only for --find-optimal-num-workers; remove it"),
    "--max-documents": ({}, "only for --find-optimal-num-workers; remove it"),
    "--tokenizer-metadata": ({}, "remove it"),
    "--tokenizer-special-tokens": ({"nargs": "+"}, "remove it"),
    "--tiktoken-pattern": ({}, "TikTokenizer is not implemented"),
    "--tiktoken-num-special-tokens": ({}, "TikTokenizer is not implemented"),
    "--tokenizer-sentencepiece-legacy": ({"action": "store_true"}, "remove it"),
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces": ({"action": "store_true"}, "remove it"),
    "--tokenizer-hf-no-use-fast": ({"action": "store_true"}, "remove it"),
    "--tokenizer-hf-no-include-special-tokens": ({"action": "store_true"}, "remove it"),
    "--trust-remote-code": ({"action": "store_true"}, "remote code is never run; remove it"),
    "--null-tokenizer-eod-id": ({}, "NullTokenizer's eod is --vocab-size; remove it"),
    "--null-tokenizer-pad-id": ({}, "remove it"),
    "--chat-template": ({}, "remove it"),
    "--use-gigatoken": ({"action": "store_true"}, "remove it"),
}
# Megatron tokenizer flags that only size the model's embedding: no effect on the files.
_NO_EFFECT = {"--padded-vocab-size": {}, "--no-pad-vocab-size": {"action": "store_true"}}


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="file, glob, or save_to_disk directory")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize")
    g.add_argument("--split-sentences", action="store_true", help="one sequence per sentence")
    g.add_argument("--keep-newlines", action="store_true", help="keep newlines inside sentences")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default=None,
                   help=f"one of {', '.join(TOKENIZER_TYPES)}; default GPT2BPETokenizer when "
                        f"--vocab-file and --merge-file are given")
    g.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece .model (SentencePiece/GPTSentencePiece/Llama2) or HF directory")
    g.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    g.add_argument("--vocab-file", default=None,
                   help="GPT2BPETokenizer: vocab.json; BertWordPieceLowerCase/Case: vocab.txt")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--vocab-extra-ids", type=int, default=0, help="T5 extra ids: only 0 is supported")
    g.add_argument("--append-eod", action="store_true", help="append <eod> to every document")
    g.add_argument("--lang", default="english", help="sentence-splitting language: english only")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True)
    g.add_argument("--dataset-impl", default="mmap", choices=["mmap"], help="only mmap exists")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--partitions", type=int, default=1, help="Megatron's document order for N partitions")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="with --partitions: keep the input order")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    for flag, (kw, _) in _UNSUPPORTED.items():
        p.add_argument(flag, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kw)
    for flag, kw in _NO_EFFECT.items():
        p.add_argument(flag, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kw)
    args = p.parse_args(argv)

    refused = [f"{flag} ({what})" for flag, (_, what) in _UNSUPPORTED.items() if hasattr(args, _dest(flag))]
    if args.vocab_extra_ids:
        refused.append(f"--vocab-extra-ids {args.vocab_extra_ids} (T5 extra ids; remove it)")
    if args.lang != "english":
        refused.append(f"--lang {args.lang} (the sentence splitter is rule-based, English punctuation)")
    if refused:
        raise ValueError(f"not implemented in megalite's preprocess_data.py: {'; '.join(refused)}")
    for flag in _NO_EFFECT:
        if hasattr(args, _dest(flag)):
            print(f"note: {flag} only sizes the model's embedding; it does not change preprocessing", flush=True)

    if args.tokenizer_type is None:
        if args.vocab_file is None or args.merge_file is None:
            raise ValueError(f"--tokenizer-type is required unless --vocab-file and --merge-file are "
                             f"given (then GPT2BPETokenizer); choose one of {', '.join(TOKENIZER_TYPES)}")
        args.tokenizer_type = "GPT2BPETokenizer"
    if args.vocab_file is not None and not (args.tokenizer_type == "GPT2BPETokenizer"
                                            or args.tokenizer_type.startswith("BertWordPiece")):
        raise ValueError(f"--vocab-file is for GPT2BPETokenizer or BertWordPieceLowerCase/Case, "
                         f"not --tokenizer-type {args.tokenizer_type}")
    if args.merge_file is not None and args.tokenizer_type != "GPT2BPETokenizer":
        raise ValueError(f"--merge-file is for GPT2BPETokenizer, not --tokenizer-type {args.tokenizer_type}")
    if args.workers < 1:
        raise ValueError(f"--workers {args.workers}: must be at least 1")
    if args.partitions < 1 or args.workers % args.partitions:
        raise ValueError(f"--partitions {args.partitions}: must be >= 1 and divide --workers {args.workers} "
                         f"(as Megatron)")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise FileNotFoundError(f"--output-prefix {args.output_prefix}: directory {out_dir} does not exist")
    return args


def main(argv=None):
    args = get_args(argv)
    # Check the tokenizer before the (possibly slow) load so a bad model fails at once.
    tok = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size,
                          vocab_file=args.vocab_file, merge_file=args.merge_file)
    if args.tokenizer_type.startswith("BertWordPiece") and not args.split_sentences:
        print("note: BERT data is usually built with --split-sentences (Megatron asks the same)", flush=True)
    t0 = time.perf_counter()
    ds = load_text_dataset(args.input)
    check_keys(ds, args.json_keys, args.input)
    print(f"Loaded {len(ds)} documents from {args.input} in {time.perf_counter() - t0:.2f} s; "
          f"tokenizer {tok!r}", flush=True)
    if args.partitions > 1 and not args.keep_sequential_samples:
        ds = ds.select(partition_order(len(ds), args.partitions))
    cfg = PreprocessConfig(json_keys=args.json_keys, tokenizer_type=args.tokenizer_type,
                           tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
                           vocab_file=args.vocab_file, merge_file=args.merge_file,
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
