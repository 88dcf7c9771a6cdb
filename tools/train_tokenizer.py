"""Train a sentencepiece tokenizer on the same inputs tools/preprocess_data.py takes.

    python tools/train_tokenizer.py --input corpus.jsonl --json-keys text \
        --model-prefix tok --vocab-size 32000 [--model-type unigram] [--bert-special-tokens] [--fim-special-tokens]

Writes {model-prefix}.model/.vocab for `--tokenizer-type SentencePieceTokenizer`."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.data.preprocess import main_guard  # noqa: E402
from megalite.data.text_input import check_keys, iter_texts, load_text_dataset  # noqa: E402
from megalite.data.tokenizer import SentencePieceTokenizer  # noqa: E402
from megalite.data.tokenizer_training import train_sentencepiece  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="file, glob, or save_to_disk directory")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    p.add_argument("--bert-special-tokens", action="store_true",
                   help="reserve <CLS> <SEP> <MASK> (as well as <EOD>) inside the vocabulary")
    p.add_argument("--fim-special-tokens", action="store_true",
                   help="reserve <fim_prefix> <fim_middle> <fim_suffix> <fim_pad> (pretrain_gpt.py --fim-data)")
    p.add_argument("--input-sentence-size", type=int, default=2_000_000,
                   help="lines sampled for training (bounds memory and time)")
    p.add_argument("--character-coverage", type=float, default=0.9999)
    p.add_argument("--normalization", default="identity", choices=["identity", "nfkc", "nmt_nfkc"])
    p.add_argument("--workers", type=int, default=None, help="training threads (default: all cores)")
    args = p.parse_args(argv)

    ds = load_text_dataset(args.input)
    check_keys(ds, args.json_keys, args.input)
    t0 = time.perf_counter()
    model = train_sentencepiece(iter_texts(ds, args.json_keys), args.model_prefix,
                                vocab_size=args.vocab_size, model_type=args.model_type,
                                bert_special_tokens=args.bert_special_tokens,
                                fim_special_tokens=args.fim_special_tokens,
                                input_sentence_size=args.input_sentence_size,
                                character_coverage=args.character_coverage,
                                normalization=args.normalization, num_threads=args.workers)
    tok = SentencePieceTokenizer(model)
    print(f"Wrote {model} in {time.perf_counter() - t0:.1f} s: vocab_size {tok.vocab_size} "
          f"(eod {tok.eod}, pad {tok.pad}, cls {tok.cls}, sep {tok.sep}, mask {tok.mask})")


if __name__ == "__main__":
    main_guard(main)
