"""Training a sentencepiece model whose special tokens match `SentencePieceTokenizer`."""

from __future__ import annotations

import os

BERT_SPECIALS = ["<CLS>", "<SEP>", "<MASK>"]
FIM_SPECIALS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]


def training_lines(texts):
    """sentencepiece trains on lines: feed each non-blank line of every document."""
    for text in texts:
        for line in text.split("\n"):
            if line.strip():
                yield line


def train_sentencepiece(texts, model_prefix: str, vocab_size: int = 8192, model_type: str = "bpe",
                        bert_special_tokens: bool = False, input_sentence_size: int = 2_000_000,
                        character_coverage: float = 0.9999, normalization: str = "identity",
                        num_threads: int | None = None, seed: int = 1234, fim_special_tokens: bool = False) -> str:
    """Train on an iterable of documents; return the path of the `.model` file.

    Defaults give a lossless tokenizer for code and prose: no normalization, whitespace
    kept, newline as its own piece, unknown characters fall back to bytes. `<EOD>` is
    always reserved (a control symbol, never produced from text); with
    `bert_special_tokens` so are <CLS>, <SEP>, <MASK>; with `fim_special_tokens` Megatron's
    <fim_prefix> <fim_middle> <fim_suffix> <fim_pad> (--fim-data). pad = id 3."""
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"--model-type {model_type}: choose bpe or unigram")
    if vocab_size < 16:
        raise ValueError(f"--vocab-size {vocab_size}: too small for a sentencepiece model (use >= 16)")
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    controls = ["<EOD>"] + (BERT_SPECIALS if bert_special_tokens else []) + (FIM_SPECIALS if fim_special_tokens else [])
    lines = training_lines(texts)
    first = next(lines, None)
    if first is None:
        raise ValueError("tokenizer training input has no non-empty lines")

    def all_lines():
        yield first
        yield from lines

    spm.set_random_generator_seed(seed)  # sampling of input sentences is reproducible
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=all_lines(), model_prefix=model_prefix, vocab_size=vocab_size,
            model_type=model_type, input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True, character_coverage=character_coverage,
            byte_fallback=True, normalization_rule_name=normalization,
            remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
            user_defined_symbols=["\n"], control_symbols=controls,
            unk_id=0, bos_id=1, eos_id=2, pad_id=3, max_sentence_length=1 << 16,
            num_threads=num_threads or os.cpu_count() or 1, minloglevel=2)
    except RuntimeError as exc:  # e.g. vocab larger than the corpus supports
        msg = str(exc).strip().splitlines()[-1]
        raise ValueError(f"sentencepiece training failed for --vocab-size {vocab_size}: {msg}") from None
    return model_prefix + ".model"
