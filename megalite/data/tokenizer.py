"""Tokenizers with Megatron-LM's semantics and one uniform surface:
`.vocab_size` (unpadded), `.eod`, `.pad`, `.cls`, `.sep`, `.mask` (None where undefined),
`.tokenize(text) -> list[int]`, `.detokenize(ids) -> str`."""

from __future__ import annotations

import os

from .tokenizer_bpe import GPT2BPETokenizer

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "Llama2Tokenizer", "HuggingFaceTokenizer", "NullTokenizer",
                   "BertWordPieceLowerCase", "BertWordPieceCase")
# Megatron-LM's other types: named as not implemented rather than unknown.
_MEGATRON_ONLY = ("TikTokenizer", "MultimodalTokenizer", "NullMultimodalTokenizer", "SFTTokenizer")


class _Base:
    eod = pad = cls = sep = mask = bos = eos = None
    vocab_size: int

    def __repr__(self):
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. Megatron's FIM tokens), None if it has none."""
        return None


def _load_sentencepiece(model_file: str | None, tokenizer_type: str):
    if not model_file:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model FILE "
                         f"(a sentencepiece .model; train one with tools/train_tokenizer.py)")
    if not os.path.isfile(model_file):
        raise FileNotFoundError(f"--tokenizer-model {model_file}: file not found")
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(model_file)
    except Exception as exc:  # sentencepiece raises OSError/RuntimeError with C++ text
        raise ValueError(f"--tokenizer-model {model_file}: not a sentencepiece model "
                         f"({str(exc).splitlines()[0]})") from None
    return sp


class SentencePieceTokenizer(_Base):
    """Megatron's `SentencePieceTokenizer`: the model's pieces, plus the special tokens
    <CLS> <SEP> <EOD> <MASK> (and pad/bos/eos) appended after the model's vocabulary
    when the model does not already define them (tools/train_tokenizer.py reserves them)."""

    def __init__(self, model_file: str | None):
        self.model_file = model_file
        self.sp = _load_sentencepiece(model_file, "SentencePieceTokenizer")
        n = self.sp.GetPieceSize()
        self._piece_to_id = {self.sp.IdToPiece(i): i for i in range(n)}
        self._specials: dict[int, str] = {}  # every special id -> its text

        def special(piece: str) -> int:
            if piece not in self._piece_to_id:
                self._piece_to_id[piece] = len(self._piece_to_id)
            i = self._piece_to_id[piece]
            self._specials[i] = piece
            return i

        def model_piece(i: int, fallback: str) -> str:
            return self.sp.IdToPiece(i) if 0 <= i < n else fallback

        self.cls, self.sep = special("<CLS>"), special("<SEP>")
        self.eod, self.mask = special("<EOD>"), special("<MASK>")
        self.pad = special(model_piece(self.sp.pad_id(), "<PAD>"))
        self.bos = special(model_piece(self.sp.bos_id(), "<BOS>"))
        self.eos = special(model_piece(self.sp.eos_id(), "<EOS>"))
        self.vocab_size = len(self._piece_to_id)
        self._model_size = n

    def tokenize(self, text: str) -> list[int]:
        return self.sp.EncodeAsIds(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.EncodeAsIds(texts)

    def token_to_id(self, token: str) -> int | None:
        return self._piece_to_id.get(token)

    def detokenize(self, ids) -> str:
        # sentencepiece drops control pieces and cannot decode appended ids: decode the
        # runs between special tokens and spell the specials out.
        out, run = [], []
        for i in (int(t) for t in ids):
            if i in self._specials:
                if run:
                    out.append(self.sp.DecodeIds(run))
                    run = []
                out.append(self._specials[i])
            else:
                run.append(i)
        if run:
            out.append(self.sp.DecodeIds(run))
        return "".join(out)


class GPTSentencePieceTokenizer(_Base):
    """Megatron's `GPTSentencePieceTokenizer`: the model's vocabulary only; eod = eos."""

    def __init__(self, model_file: str | None):
        self.model_file = model_file
        self.sp = _load_sentencepiece(model_file, "GPTSentencePieceTokenizer")
        self.vocab_size = self.sp.GetPieceSize()
        as_id = lambda i: i if i >= 0 else None  # noqa: E731  (sentencepiece uses -1 for "none")
        self.eod = self.eos = as_id(self.sp.eos_id())
        self.bos, self.pad = as_id(self.sp.bos_id()), as_id(self.sp.pad_id())

    def tokenize(self, text: str) -> list[int]:
        return self.sp.EncodeAsIds(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.EncodeAsIds(texts)

    def detokenize(self, ids) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.PieceToId(token)
        return i if self.sp.IdToPiece(i) == token else None


class Llama2Tokenizer(_Base):
    """Megatron's `Llama2Tokenizer`: the sentencepiece model's vocabulary; tokenize
    prepends BOS (no EOS), eod = eos."""

    def __init__(self, model_file: str | None):
        self.model_file = model_file
        self.sp = _load_sentencepiece(model_file, "Llama2Tokenizer")
        self.vocab_size = self.sp.GetPieceSize()
        if self.sp.bos_id() < 0 or self.sp.eos_id() < 0:
            raise ValueError(f"--tokenizer-model {model_file}: Llama2Tokenizer needs a model with BOS "
                             f"and EOS ids (bos_id={self.sp.bos_id()}, eos_id={self.sp.eos_id()})")
        self.bos, self.eod = self.sp.bos_id(), self.sp.eos_id()
        self.eos = self.eod
        self.pad = self.sp.pad_id() if self.sp.pad_id() >= 0 else None

    def tokenize(self, text: str) -> list[int]:
        return [self.bos] + self.sp.EncodeAsIds(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [[self.bos] + ids for ids in self.sp.EncodeAsIds(texts)]

    def detokenize(self, ids) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.PieceToId(token)
        return i if self.sp.IdToPiece(i) == token else None


class HuggingFaceTokenizer(_Base):
    """A `transformers` tokenizer from a local directory (no hub access)."""

    batch_encodes_faster = True  # fast (Rust) tokenizers encode a list on several threads

    def __init__(self, path: str | None):
        if not path:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"--tokenizer-model {path}: directory not found "
                                    f"(HuggingFaceTokenizer loads local directories only)")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ModuleNotFoundError("HuggingFaceTokenizer needs the transformers package: "
                                      "pip install 'megalite[hf]'") from None
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self.tok)
        t = self.tok
        self.eod = self.eos = t.eos_token_id
        self.bos, self.pad, self.cls = t.bos_token_id, t.pad_token_id, t.cls_token_id
        self.sep, self.mask = t.sep_token_id, t.mask_token_id

    def tokenize(self, text: str) -> list[int]:
        return self.tok(text).input_ids  # as Megatron: the tokenizer's own special tokens

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts).input_ids

    def detokenize(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])

    def token_to_id(self, token: str) -> int | None:
        return self.tok.get_vocab().get(token)


class BertWordPieceTokenizer(_Base):
    """Megatron's `BertWordPieceLowerCase` / `BertWordPieceCase`: a WordPiece vocab.txt
    (--vocab-file) through `transformers`' BertTokenizer, read locally; eod = [SEP]."""

    def __init__(self, vocab_file: str | None, lower_case: bool):
        kind = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        if not vocab_file:
            raise ValueError(f"--tokenizer-type {kind} needs --vocab-file (a WordPiece vocab.txt)")
        if not os.path.isfile(vocab_file):
            raise FileNotFoundError(f"--vocab-file {vocab_file}: file not found")
        try:
            from transformers import BertTokenizer
        except ImportError:
            raise ModuleNotFoundError(f"{kind} needs the transformers package: pip install 'megalite[hf]'") from None
        try:
            self.tok = BertTokenizer(vocab=vocab_file, do_lower_case=lower_case)  # transformers >= 5
        except TypeError:
            self.tok = BertTokenizer(vocab_file=vocab_file, do_lower_case=lower_case)
        t = self.tok
        for name in ("cls", "sep", "mask", "pad"):
            if getattr(t, f"{name}_token") not in t.get_vocab():
                raise ValueError(f"--vocab-file {vocab_file}: no {getattr(t, f'{name}_token')} token")
        self.vocab_size = len(t)
        self.cls, self.sep, self.mask, self.pad = t.cls_token_id, t.sep_token_id, t.mask_token_id, t.pad_token_id
        self.eod = self.sep

    def tokenize(self, text: str) -> list[int]:
        return self.tok.convert_tokens_to_ids(self.tok.tokenize(text))

    def detokenize(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])

    def token_to_id(self, token: str) -> int | None:
        return self.tok.get_vocab().get(token)


class NullTokenizer(_Base):
    """Megatron's `NullTokenizer`: text is space-separated ids; with `--vocab-size V`
    the ids are 0..V-1, eod = V and `.vocab_size` = V + 1 (eod = vocab_size - 1)."""

    def __init__(self, vocab_size: int | None):
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError(f"--tokenizer-type NullTokenizer needs --vocab-size > 0 "
                             f"(got {vocab_size})")
        self.eod = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def token_to_id(self, token: str) -> int | None:
        return int(token) if token.isdigit() and int(token) < self.vocab_size else None


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None,
                    vocab_size: int | None = None, vocab_file: str | None = None,
                    merge_file: str | None = None):
    """Megatron's `build_tokenizer` over its flags; files a type does not use are ignored
    (as Megatron does)."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        cls = {"SentencePieceTokenizer": SentencePieceTokenizer, "Llama2Tokenizer": Llama2Tokenizer,
               "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer}[tokenizer_type]
        return cls(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        # --vocab-file as Megatron; older megalite callers pass the vocab.txt as tokenizer_model.
        return BertWordPieceTokenizer(vocab_file or tokenizer_model, tokenizer_type == "BertWordPieceLowerCase")
    if tokenizer_type is None:
        raise ValueError(f"--tokenizer-type is required: choose one of {', '.join(TOKENIZER_TYPES)}")
    what = "is not implemented in megalite" if tokenizer_type in _MEGATRON_ONLY else "is not a tokenizer type"
    raise ValueError(f"--tokenizer-type {tokenizer_type}: {what}; "
                     f"choose one of {', '.join(TOKENIZER_TYPES)}")
