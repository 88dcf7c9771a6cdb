import json
import os

import numpy as np
import pytest

from megalite.data.default_corpus import stdlib_sources
from megalite.data.indexed_dataset import IndexedDatasetBuilder, index_file_path
from megalite.data.tokenizer_training import train_sentencepiece


@pytest.fixture(scope="session")
def corpus_texts():
    """30 real documents (standard-library sources), two of them empty or blank-only."""
    texts = []
    for f in stdlib_sources(40)[:28]:
        with open(f, encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read()[:6000])
    return texts[:10] + [""] + texts[10:20] + ["   \n"] + texts[20:]


@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory, corpus_texts):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with open(path, "w") as f:
        for i, t in enumerate(corpus_texts):
            f.write(json.dumps({"text": t, "title": f"doc {i}. Second sentence!"}) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory, corpus_texts):
    prefix = tmp_path_factory.mktemp("tok") / "tok"
    return train_sentencepiece(corpus_texts, str(prefix), vocab_size=600, num_threads=1)


def write_random_dataset(prefix, rng, num_docs=60, max_len=50, vocab=1000, offset=0,
                         empty_every=7):
    """A Megatron dataset of random token documents (some empty); returns their tokens."""
    docs = []
    b = IndexedDatasetBuilder(str(prefix) + ".bin", np.uint16)
    for i in range(num_docs):
        n = 0 if empty_every and i % empty_every == 3 else int(rng.integers(1, max_len))
        doc = rng.integers(0, vocab, n) + offset
        docs.append(doc)
        b.add_item(doc)
        b.end_document()
    b.finalize(index_file_path(str(prefix)))
    return docs
