import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from megalite.data import IndexedDataset, build_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = str(ROOT / "tools" / "preprocess_data.py")


def _cli(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def _expected(tok, texts, eod=True):
    out = []
    for t in texts:
        ids = tok.tokenize(t)
        if ids:
            out.append(ids + ([tok.eod] if eod else []))
    return out


def test_cli_jsonl_two_workers(corpus_jsonl, corpus_texts, sp_model, tmp_path):
    out = str(tmp_path / "out")
    r = _cli("--input", corpus_jsonl, "--json-keys", "text", "--tokenizer-type",
             "SentencePieceTokenizer", "--tokenizer-model", sp_model, "--output-prefix", out,
             "--append-eod", "--workers", "2", "--log-interval", "10")
    assert r.returncode == 0, r.stderr
    assert "Processed 10/30 documents" in r.stdout
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("Done: 30 documents,") and "tokens/s" in last
    ds = IndexedDataset(out + "_text_document")
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    expected = _expected(tok, corpus_texts)
    # The empty document has no sequence (as Megatron); the blank-only one keeps its
    # whitespace tokens (the tokenizer is lossless); all others in input order.
    assert ds.num_documents == 30 and len(ds) == len(expected) == 29
    assert np.diff(ds.document_indices).tolist().count(0) == 1
    assert ds.dtype == np.uint16
    for i, ids in enumerate(expected):
        assert ds[i].tolist() == ids
    assert f"{ds.num_tokens} tokens" in last


def _formats(tmp_path, texts):
    import datasets
    rows = {"text": texts, "n": list(range(len(texts)))}
    d = datasets.Dataset.from_dict(rows)
    d.to_parquet(str(tmp_path / "c.parquet"))
    d.to_csv(str(tmp_path / "c.csv"), index=False)
    d.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "c.txt").write_text("\n".join(texts) + "\n")
    return {"parquet": str(tmp_path / "c.parquet"), "csv": str(tmp_path / "c.csv"),
            "saved": str(tmp_path / "saved"), "text": str(tmp_path / "c.txt")}


def test_all_input_formats_in_process(tmp_path, sp_model):
    sys.path.insert(0, str(ROOT / "tools"))
    import preprocess_data
    texts = ["first line of text", "second, a bit longer line of text", "x = 1  # third"]
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    for name, path in _formats(tmp_path, texts).items():
        out = str(tmp_path / name)
        stats = preprocess_data.main(["--input", path, "--tokenizer-type", "SentencePieceTokenizer",
                                      "--tokenizer-model", sp_model, "--output-prefix", out,
                                      "--log-interval", "0"])
        ds = IndexedDataset(out + "_text_document")
        assert [ds[i].tolist() for i in range(len(ds))] == _expected(tok, texts, eod=False), name
        assert stats["documents"] == 3


def test_sentences_and_several_keys(corpus_jsonl, sp_model, tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import preprocess_data
    out = str(tmp_path / "s")
    preprocess_data.main(["--input", corpus_jsonl, "--json-keys", "text", "title", "--split-sentences",
                          "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model,
                          "--output-prefix", out, "--append-eod", "--workers", "2", "--log-interval", "0"])
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    titles = IndexedDataset(out + "_title_sentence")
    assert titles.num_documents == 30 and len(titles) == 60  # "doc i." + "Second sentence!"
    assert titles[1].tolist() == tok.tokenize("Second sentence!") + [tok.eod]
    assert titles[0].tolist() == tok.tokenize("doc 0.")  # eod only after a document's last one
    assert os.path.exists(out + "_text_sentence.idx")


def _assert_one_line_error(r, *needles):
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_cli_bad_inputs_one_line(corpus_jsonl, sp_model, tmp_path):
    base = ["--tokenizer-type", "SentencePieceTokenizer", "--output-prefix", str(tmp_path / "o")]
    missing = str(tmp_path / "nope.jsonl")
    _assert_one_line_error(_cli("--input", missing, "--tokenizer-model", sp_model, *base),
                           missing, "not found")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _assert_one_line_error(_cli("--input", str(empty), "--tokenizer-model", sp_model, *base),
                           str(empty), "empty")
    _assert_one_line_error(_cli("--input", corpus_jsonl, "--json-keys", "body", "--tokenizer-model",
                                sp_model, *base), "--json-keys body", "text, title")
    _assert_one_line_error(_cli("--input", corpus_jsonl, "--tokenizer-model",
                                str(tmp_path / "tok.model"), *base), "tok.model", "not found")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    _assert_one_line_error(_cli("--input", str(bad), "--tokenizer-model", sp_model, *base),
                           str(bad), "could not be read")


def test_train_tokenizer_cli(corpus_jsonl, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "train_tokenizer.py"), "--input",
                        corpus_jsonl, "--model-prefix", str(tmp_path / "t"), "--vocab-size", "500",
                        "--bert-special-tokens", "--workers", "1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    tok = build_tokenizer("SentencePieceTokenizer", str(tmp_path / "t.model"))
    assert tok.vocab_size == 500  # every special token reserved inside the model
    assert max(tok.eod, tok.cls, tok.sep, tok.mask, tok.pad) < 500
    assert json.dumps(tok.detokenize(tok.tokenize("a\n  b"))) == json.dumps("a\n  b")
