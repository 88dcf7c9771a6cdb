"""Megatron's tokenizers against the real libraries: GPT2BPETokenizer (vocab.json + merges.txt
through `tokenizers`) vs `transformers`' GPT-2 tokenizer and a pure-Python BPE, preprocess
output vs what `tokenizers` encodes, Llama2Tokenizer vs sentencepiece, one-line errors."""
import json
import pathlib
import sys

import numpy as np
import pytest

from megalite.data import IndexedDataset, build_tokenizer
from megalite.data.preprocess import main_guard
from megalite.data.tokenizer_bpe import EOD_TOKEN, PythonGPT2BPE

ROOT = pathlib.Path(__file__).resolve().parents[2]

VARIED = [
    "Hello world", " Hello world", "Hello  world  ", "  leading and trailing spaces   ",
    "line one\nline two\n\n\nthree\r\nfour\t\ttabs", "digits 0 12 345 6789 3.14159 1e-10 2026-11-22",
    "punctuation!?... (parens) [brackets] {braces} \"quotes\" 'single' -- em—dash",
    "contractions: I'm you're it's we've they'll he'd DON'T I'M",
    "ünïcödé café naïve Ærøskøbing", "日本語のテキスト 中文 한국어", "emoji 😀🎉👍🏽 and ZWJ 👩‍💻",
    "mixed\u00a0nbsp\u2003em-space\u200bzero-width", "Ω≈ç√∫˜µ≤≥÷ ¡™£¢∞§¶•ªº",
    f"doc one{EOD_TOKEN}doc two", f"{EOD_TOKEN}{EOD_TOKEN} starts with eod", f"spaced {EOD_TOKEN} eod",
    "<|endoftext", "endoftext|>", "", " ", "\n", "def f(x):\n    return x ** 2  # square\n",
]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory, corpus_texts):
    """A real byte-level BPE trained on the corpus, laid out as GPT-2's: vocab.json with
    <|endoftext|> as the last id, merges.txt with the "#version" header."""
    from tokenizers import ByteLevelBPETokenizer
    d = tmp_path_factory.mktemp("gpt2")
    bpe = ByteLevelBPETokenizer()  # add_prefix_space=False, GPT-2's regex
    bpe.train_from_iterator(corpus_texts + VARIED, vocab_size=1200, min_frequency=2, show_progress=False)
    bpe.save_model(str(d))
    vocab = json.loads((d / "vocab.json").read_text())
    vocab[EOD_TOKEN] = len(vocab)
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    assert (d / "merges.txt").read_text().startswith("#version")
    return str(d / "vocab.json"), str(d / "merges.txt")


def test_gpt2bpe_equals_transformers_and_python_bpe(gpt2_files, corpus_texts):
    from transformers import GPT2Tokenizer, GPT2TokenizerFast
    vocab, merges = gpt2_files
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    slow, fast = GPT2Tokenizer(vocab, merges), GPT2TokenizerFast(vocab, merges)
    ref = PythonGPT2BPE(vocab, merges)
    n_vocab = len(json.loads(pathlib.Path(vocab).read_text()))
    assert tok.vocab_size == n_vocab == len(slow) == 1201
    assert tok.eod == slow.eos_token_id == fast.eos_token_id == ref.encoder[EOD_TOKEN] == 1200
    texts = VARIED + corpus_texts
    ours = [tok.tokenize(t) for t in texts]
    assert tok.tokenize_batch(texts) == ours
    for text, ids in zip(texts, ours):
        assert ids == slow(text).input_ids == fast(text).input_ids == ref.tokenize(text), repr(text[:80])
        assert tok.detokenize(ids) == text
    assert sum(map(len, ours)) < sum(len(t.encode()) for t in texts) / 2  # merges really apply
    assert tok.tokenize(f"a{EOD_TOKEN}b") == tok.tokenize("a") + [tok.eod] + tok.tokenize("b")
    assert tok.tokenize("Hello") != tok.tokenize(" Hello")  # no prefix space is added
    assert tok.detokenize([tok.eod]) == EOD_TOKEN


def test_huggingface_directory_agrees_with_gpt2bpe(gpt2_files, tmp_path):
    """The same GPT-2 files saved as a transformers directory, read by HuggingFaceTokenizer."""
    from transformers import GPT2Tokenizer
    GPT2Tokenizer(*gpt2_files).save_pretrained(str(tmp_path / "hf"))
    hf = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "hf"))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
    assert (hf.vocab_size, hf.eod) == (tok.vocab_size, tok.eod) == (1201, 1200)
    assert hf.tokenize_batch(VARIED) == [hf.tokenize(t) for t in VARIED] == tok.tokenize_batch(VARIED)


def test_gpt2bpe_decodes_partial_utf8_as_megatron(gpt2_files):
    """Megatron decodes with errors="replace": every prefix of a multi-byte text's ids."""
    tok = build_tokenizer("GPT2BPETokenizer", None, None, vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
    ref = PythonGPT2BPE(*gpt2_files)
    ids = tok.tokenize("日本語 😀🎉 ünï")
    decoded = [tok.detokenize(ids[:k]) for k in range(len(ids) + 1)]
    assert decoded == [ref.detokenize(ids[:k]) for k in range(len(ids) + 1)]
    assert any("\ufffd" in d for d in decoded)  # some prefixes end inside a character


def _tokenizers_reference(vocab, merges):
    """The same files through `tokenizers`' own GPT-2 class (not megalite's construction)."""
    from tokenizers import ByteLevelBPETokenizer
    ref = ByteLevelBPETokenizer(vocab, merges)
    ref.add_special_tokens([EOD_TOKEN])
    return lambda text: ref.encode(text).ids


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def _docs(prefix):
    ds = IndexedDataset(prefix)
    return ds, [np.concatenate([ds[s] for s in range(a, b)]).tolist() if b > a else []
                for a, b in zip(ds.document_indices[:-1], ds.document_indices[1:])]


def _tool():
    sys.path.insert(0, str(ROOT / "tools"))
    import preprocess_data
    return preprocess_data


def test_preprocess_gpt2bpe_equals_tokenizers(gpt2_files, corpus_texts, tmp_path):
    vocab, merges = gpt2_files
    texts = corpus_texts + VARIED
    src = _jsonl(tmp_path / "in.jsonl", texts)
    encode = _tokenizers_reference(vocab, merges)
    expected = [encode(t) + [1200] if encode(t) else [] for t in texts]  # + eod; empty docs stay empty
    out = str(tmp_path / "gpt")
    stats = _tool().main(["--input", src, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                          "--merge-file", merges, "--output-prefix", out, "--append-eod", "--workers", "2",
                          "--log-interval", "0"])
    ds, docs = _docs(out + "_text_document")
    assert ds.dtype == np.uint16 and ds.num_documents == len(texts)
    assert docs == expected and stats["tokens"] == sum(map(len, expected))
    assert len(ds) == sum(1 for e in expected if e)  # one sequence per non-empty document

    # Default type (Megatron's GPT default) and Megatron's --partitions order: round robin.
    out2 = str(tmp_path / "part")
    _tool().main(["--input", src, "--vocab-file", vocab, "--merge-file", merges, "--output-prefix", out2,
                  "--append-eod", "--workers", "2", "--partitions", "2", "--log-interval", "0"])
    order = list(range(0, len(texts), 2)) + list(range(1, len(texts), 2))
    assert _docs(out2 + "_text_document")[1] == [expected[i] for i in order]
    out3 = str(tmp_path / "seq")
    _tool().main(["--input", src, "--vocab-file", vocab, "--merge-file", merges, "--output-prefix", out3,
                  "--append-eod", "--partitions", "1", "--keep-sequential-samples", "--log-interval", "0"])
    for ext in (".bin", ".idx"):
        assert pathlib.Path(out3 + "_text_document" + ext).read_bytes() == \
            pathlib.Path(out + "_text_document" + ext).read_bytes()


def test_preprocess_gpt2bpe_bytes_equal_megatron_builder(gpt2_files, corpus_texts, tmp_path):
    """The .bin/.idx equal what Megatron's preprocess_data.py writes for the same ids:
    its Encoder.encode (eod on non-empty documents) into megatron-core's builder."""
    mc = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                             reason="megatron-core not installed (it is in the test extra)")
    import torch
    vocab, merges = gpt2_files
    texts = corpus_texts[:12] + VARIED
    encode = _tokenizers_reference(vocab, merges)
    theirs = mc.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=mc.DType.optimal_dtype(1201))
    for t in texts:
        ids = encode(t)
        ids, lens = (ids + [1200], [len(ids) + 1]) if ids else ([], [])
        theirs.add_document(torch.tensor(ids, dtype=torch.int64), lens)
    theirs.finalize(str(tmp_path / "m.idx"))
    _tool().main(["--input", _jsonl(tmp_path / "in.jsonl", texts), "--tokenizer-type", "GPT2BPETokenizer",
                  "--vocab-file", vocab, "--merge-file", merges, "--output-prefix", str(tmp_path / "o"),
                  "--append-eod", "--log-interval", "0"])
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"o_text_document{ext}").read_bytes() == (tmp_path / f"m{ext}").read_bytes()


def test_llama2_tokenizer_equals_sentencepiece(sp_model, corpus_texts, tmp_path):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    tok = build_tokenizer("Llama2Tokenizer", sp_model)
    assert tok.vocab_size == sp.get_piece_size() == sp.vocab_size() == 600
    assert (tok.bos, tok.eos, tok.eod, tok.pad) == (sp.bos_id(), sp.eos_id(), sp.eos_id(), sp.pad_id()) == (1, 2, 2, 3)
    texts = corpus_texts[:8] + ["", "ünïcödé ✓ 😀", "  two  spaces\n\nnewlines"]
    for text in texts:
        ids = tok.tokenize(text)
        assert ids == [sp.bos_id()] + sp.encode(text) and sp.eos_id() not in ids  # BOS, no EOS
        assert tok.detokenize(ids) == sp.decode(ids[1:]) == text
    assert tok.tokenize_batch(texts) == [tok.tokenize(t) for t in texts]
    out = str(tmp_path / "llama")
    _tool().main(["--input", _jsonl(tmp_path / "in.jsonl", texts), "--tokenizer-type", "Llama2Tokenizer",
                  "--tokenizer-model", sp_model, "--output-prefix", out, "--append-eod", "--log-interval", "0"])
    # As Megatron: every document, the empty one too, is BOS + pieces + EOS.
    assert _docs(out + "_text_document")[1] == [[1] + sp.encode(t) + [2] for t in texts]


def test_build_tokenizer_call_forms(gpt2_files, sp_model, tmp_path):
    vocab, merges = gpt2_files
    wp = tmp_path / "wp.txt"
    wp.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world"]) + "\n")
    # The lead's call: build_tokenizer(type, tokenizer_model, vocab_size, vocab_file=, merge_file=).
    for kind, model in (("GPT2BPETokenizer", None), ("Llama2Tokenizer", sp_model), ("NullTokenizer", None)):
        tok = build_tokenizer(kind, model, 50, vocab_file=vocab, merge_file=merges)
        assert type(tok).__name__ == kind
    bert_old = build_tokenizer("BertWordPieceLowerCase", str(wp))  # vocab.txt as tokenizer_model
    bert_new = build_tokenizer("BertWordPieceLowerCase", None, None, vocab_file=str(wp), merge_file=None)
    assert bert_old.tokenize("Hello world") == bert_new.tokenize("Hello world") == [5, 6]
    assert bert_new.vocab_size == 7 and bert_new.eod == bert_new.sep == 3


def _one_line(exc_info, *needles):
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg


def test_gpt2bpe_errors_one_line(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    cases = [((None, merges), ValueError, ["--vocab-file", "GPT2BPETokenizer"]),
             ((vocab, None), ValueError, ["--merge-file"]),
             ((str(tmp_path / "no.json"), merges), FileNotFoundError, ["--vocab-file", "no.json", "not found"]),
             ((vocab, str(tmp_path / "no.txt")), FileNotFoundError, ["--merge-file", "no.txt"]),
             ((str(tmp_path), merges), FileNotFoundError, ["--vocab-file"])]
    bad = {"bad.json": ("{not json", ["bad.json", "invalid JSON"]),
           "list.json": ("[1, 2]", ["list.json", "JSON object"]),
           "noeod.json": (json.dumps({"a": 0, "b": 1}), ["noeod.json", EOD_TOKEN]),
           "gap.json": (json.dumps({"a": 0, EOD_TOKEN: 5}), ["gap.json", "0..1"]),
           "latin1.json": (b"\xff\xfe{}", ["latin1.json", "cannot be read"])}
    for name, (content, needles) in bad.items():
        p = tmp_path / name
        p.write_bytes(content) if isinstance(content, bytes) else p.write_text(content)
        cases.append(((str(p), merges), ValueError, needles))
    for name, content, needles in [("three.txt", "#version: 0.2\nĠ t h\n", ["three.txt", "line 2"]),
                                   ("other.txt", "#version: 0.2\nzz qq\n", ["other.txt", "line 2", "different"])]:
        (tmp_path / name).write_text(content)
        cases.append(((vocab, str(tmp_path / name)), ValueError, needles))
    for (v, m), exc, needles in cases:
        with pytest.raises(exc) as e:
            build_tokenizer("GPT2BPETokenizer", vocab_file=v, merge_file=m)
        _one_line(e, *needles)
    for args, needles in [(("Llama2Tokenizer",), ["--tokenizer-model"]),
                          (("TikTokenizer",), ["TikTokenizer", "not implemented", "GPT2BPETokenizer"]),
                          ((None,), ["--tokenizer-type is required", "Llama2Tokenizer"])]:
        with pytest.raises(ValueError) as e:
            build_tokenizer(*args)
        _one_line(e, *needles)


def test_preprocess_cli_errors_one_line(gpt2_files, sp_model, tmp_path, capsys):
    vocab, merges = gpt2_files
    src = _jsonl(tmp_path / "in.jsonl", ["some text"])
    base = ["--input", src, "--output-prefix", str(tmp_path / "o")]
    cases = [([], ["--tokenizer-type is required", "--vocab-file and --merge-file"]),
             (["--vocab-file", vocab], ["--tokenizer-type is required"]),
             (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab], ["--merge-file"]),
             (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model, "--merge-file", merges],
              ["--merge-file is for GPT2BPETokenizer"]),
             (["--vocab-file", vocab, "--merge-file", merges, "--workers", "3", "--partitions", "2"],
              ["--partitions 2", "--workers 3"]),
             (["--vocab-file", vocab, "--merge-file", merges, "--lang", "german", "--find-optimal-num-workers",
               "--workers-to-check", "4", "8", "--tokenizer-hf-no-use-fast", "--vocab-extra-ids", "100"],
              ["not implemented", "--lang german", "--find-optimal-num-workers", "--workers-to-check",
               "--tokenizer-hf-no-use-fast", "--vocab-extra-ids 100"])]
    for extra, needles in cases:
        with pytest.raises(SystemExit) as e:
            main_guard(lambda: _tool().main(base + extra))
        assert e.value.code == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        for n in needles:
            assert n in err[0], (n, err[0])
