"""GPT-2 byte-level BPE (`--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json
--merge-file merges.txt`) run by Hugging Face `tokenizers` (Rust), and a pure-Python
reference of the same algorithm that tests and benchmarks compare it with.

Semantics are Megatron-LM's: vocab_size = len(vocab.json), eod = id of `<|endoftext|>`,
no prefix space, GPT-2's pre-tokenization regex, decoding with errors="replace". As in
Megatron-LM's current GPT-2 tokenizer (Hugging Face's) and in `transformers`, the literal
text `<|endoftext|>` encodes to the eod id (Megatron's retired pure-Python tokenizer split
it into ordinary pieces instead)."""

from __future__ import annotations

import json
import os

EOD_TOKEN = "<|endoftext|>"
# GPT-2's pre-tokenizer (case-sensitive contractions, as OpenAI's encoder.py); the one
# `tokenizers`' ByteLevel(use_regex=True) uses.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _check_file(path: str | None, flag: str, what: str) -> str:
    if not path:
        raise ValueError(f"--tokenizer-type GPT2BPETokenizer needs {flag} ({what}; GPT-2's are "
                         f"gpt2-vocab.json and gpt2-merges.txt)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: file not found")
    return path


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: cannot be read ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def read_vocab(path: str | None) -> dict[str, int]:
    path = _check_file(path, "--vocab-file", "a GPT-2 vocab.json")
    try:
        vocab = json.loads(_read_text(path, "--vocab-file"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--vocab-file {path}: not a GPT-2 vocab.json (invalid JSON: {exc})") from None
    if not isinstance(vocab, dict) or not vocab or \
            not all(isinstance(k, str) and type(v) is int for k, v in vocab.items()):
        raise ValueError(f"--vocab-file {path}: not a GPT-2 vocab.json (expected a JSON object "
                         f"mapping token strings to integer ids)")
    # The embedding has vocab_size rows: every id must index one of them.
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise ValueError(f"--vocab-file {path}: token ids are not exactly 0..{len(vocab) - 1}")
    if EOD_TOKEN not in vocab:
        raise ValueError(f"--vocab-file {path}: no {EOD_TOKEN} token (GPT2BPETokenizer's end of document)")
    return vocab


def read_merges(path: str | None, vocab: dict[str, int]) -> list[tuple[str, str]]:
    path = _check_file(path, "--merge-file", "a GPT-2 merges.txt")
    merges = []
    for n, line in enumerate(_read_text(path, "--merge-file").split("\n"), start=1):
        if not line.strip() or (n == 1 and line.startswith("#")):  # the "#version: 0.2" header
            continue
        pair = line.split()
        if len(pair) != 2:
            raise ValueError(f"--merge-file {path}: line {n} is not two space-separated tokens: {line[:60]!r}")
        if pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
            raise ValueError(f"--merge-file {path}: line {n} merges {line[:60]!r}, which --vocab-file "
                             f"does not hold (vocab.json and merges.txt of different tokenizers?)")
        merges.append((pair[0], pair[1]))
    return merges


class GPT2BPETokenizer:
    """Megatron's `GPT2BPETokenizer`: byte-level BPE from vocab.json + merges.txt."""

    pad = cls = sep = mask = None
    batch_encodes_faster = True  # encode_batch: Rust threads, no GIL

    def __init__(self, vocab_file: str | None, merge_file: str | None):
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        self.vocab_file, self.merge_file = vocab_file, merge_file
        vocab = read_vocab(vocab_file)
        merges = read_merges(merge_file, vocab)
        tok = Tokenizer(models.BPE(vocab, merges, dropout=None, unk_token=None,
                                   continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False, byte_fallback=False))
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
        self._tok = tok
        self._encode_batch = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no offsets
        self.vocab_size = len(vocab)
        self.eod = self.eos = self.bos = vocab[EOD_TOKEN]

    def __repr__(self):
        return f"GPT2BPETokenizer(vocab_size={self.vocab_size}, eod={self.eod})"

    def tokenize(self, text: str) -> list[int]:
        return self._encode_batch([text], add_special_tokens=False)[0].ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for
    themselves, the other 68 bytes take the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


class PythonGPT2BPE:
    """The GPT-2 BPE algorithm in plain Python (as Megatron's retired gpt2_tokenization.py
    and transformers < 5's slow GPT2Tokenizer run it): an independent reference and the
    speed baseline. `<|endoftext|>` in text encodes to eod, as GPT2BPETokenizer."""

    def __init__(self, vocab_file: str, merge_file: str):
        import regex
        self.encoder = read_vocab(vocab_file)
        self.decoder = {i: t for t, i in self.encoder.items()}
        self.ranks = {pair: r for r, pair in enumerate(read_merges(merge_file, self.encoder))}
        self.byte_map = bytes_to_unicode()
        self.byte_unmap = {c: b for b, c in self.byte_map.items()}
        self.pattern = regex.compile(GPT2_PATTERN)
        self.cache: dict[str, list[str]] = {}

    def _bpe(self, word: str) -> list[str]:
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            ranked = [(self.ranks.get(p, None), i) for i, p in enumerate(zip(parts, parts[1:]))]
            ranked = [(r, i) for r, i in ranked if r is not None]
            if not ranked:
                break
            best = min(ranked)[0]
            first, second = next(p for p in zip(parts, parts[1:]) if self.ranks.get(p) == best)
            merged, i = [], 0
            while i < len(parts):  # merge every occurrence of the best pair, left to right
                if i + 1 < len(parts) and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        self.cache[word] = parts
        return parts

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for k, chunk in enumerate(text.split(EOD_TOKEN)):
            if k:
                ids.append(self.encoder[EOD_TOKEN])
            for piece in self.pattern.findall(chunk):
                word = "".join(self.byte_map[b] for b in piece.encode("utf-8"))
                ids.extend(self.encoder[t] for t in self._bpe(word))
        return ids

    def detokenize(self, ids) -> str:
        data = bytes(self.byte_unmap[c] for i in ids for c in self.decoder[int(i)])
        return data.decode("utf-8", errors="replace")
