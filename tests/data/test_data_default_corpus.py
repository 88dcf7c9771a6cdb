import os
import threading
import time

import numpy as np
import pytest

from megalite.data import IndexedDataset, build_gpt_datasets, build_tokenizer
from megalite.data.default_corpus import prepare_default_corpus, stdlib_sources

# A slice of the standard library keeps this fast; the full build is the same code path.
N_FILES, VOCAB = 40, 600


def _ranks(cache, n=3, **kw):
    """Run prepare_default_corpus as n concurrent 'ranks' (rank 0 builds) meeting at a barrier."""
    barrier = threading.Barrier(n, timeout=60)
    results = [None] * n

    def rank(r):
        try:
            results[r] = prepare_default_corpus(cache, is_builder=(r == 0), barrier=barrier.wait,
                                                vocab_size=kw.get("vocab", VOCAB), max_files=N_FILES,
                                                log=lambda s: None)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def test_default_corpus_builds_once_and_is_cached(tmp_path):
    results = _ranks(str(tmp_path))
    assert all(r == results[0] for r in results) and isinstance(results[0], tuple)
    prefix, model = results[0]
    files = stdlib_sources(N_FILES)
    tok = build_tokenizer("SentencePieceTokenizer", model)
    assert tok.vocab_size == VOCAB  # eod and the BERT tokens are reserved inside the model
    ds = IndexedDataset(prefix)
    assert ds.num_documents == len(files) == N_FILES
    with open(files[5], encoding="utf-8") as f:  # one document per file, in sorted order
        source = f.read()
    assert ds[5][-1] == tok.eod and tok.detokenize(ds[5][:-1]) == source
    t0 = time.perf_counter()
    assert prepare_default_corpus(str(tmp_path), vocab_size=VOCAB, max_files=N_FILES) == results[0]
    assert time.perf_counter() - t0 < 2.0  # cached: no rebuild
    train, valid, _ = build_gpt_datasets([prefix], "949,50,1", 64, 1234, (200, 10, 0), None)
    assert len(train) >= 200 and train[0]["text"].shape == (65,)
    assert np.all(train[199]["text"] < tok.vocab_size)


def test_builder_failure_does_not_hang_others(tmp_path):
    # A vocabulary this large cannot be learned from 40 files: the builder fails with a
    # clear error; the other ranks pass the barrier and report the missing corpus.
    results = _ranks(str(tmp_path), vocab=60000)
    assert isinstance(results[0], ValueError) and "--vocab-size 60000" in str(results[0])
    assert all(isinstance(r, RuntimeError) and "default corpus missing" in str(r) for r in results[1:])
    assert os.listdir(tmp_path) == [".default_corpus.lock"]  # no partial build left behind


def test_non_builder_alone_reports_missing(tmp_path):
    with pytest.raises(RuntimeError, match="default corpus missing"):
        prepare_default_corpus(str(tmp_path), is_builder=False, vocab_size=VOCAB, max_files=N_FILES)
