import os
import struct

import numpy as np
import pytest

from megalite.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder, index_file_path,
                                           optimal_dtype)


def _write(prefix, docs, dtype, sentences=False):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        if sentences:  # each document as two sequences
            half = len(doc) // 2
            b.add_document(np.concatenate([doc[:half], doc[half:]]), [half, len(doc) - half])
        else:
            b.add_item(doc)
            b.end_document()
    b.finalize(index_file_path(prefix))


@pytest.mark.parametrize("vocab", [1000, 70000])
def test_round_trip(tmp_path, vocab):
    rng = np.random.default_rng(vocab)
    docs = [rng.integers(0, vocab, rng.integers(0, 40)) for _ in range(25)]
    prefix = str(tmp_path / "rt")
    _write(prefix, docs, optimal_dtype(vocab))
    ds = IndexedDataset(prefix)
    assert ds.dtype == (np.uint16 if vocab < 65500 else np.int32)
    assert len(ds) == 25 and ds.num_documents == 25
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
        if len(doc) > 3:
            np.testing.assert_array_equal(ds.get(i, offset=1, length=2), doc[1:3])
    np.testing.assert_array_equal(ds.tokens(), np.concatenate(docs))


def test_idx_layout_field_by_field(tmp_path):
    """Read the .idx with struct only (not our reader) against Megatron's layout."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 500, n) for n in (5, 8, 3, 10)]
    prefix = str(tmp_path / "lay")
    _write(prefix, docs, np.uint16, sentences=True)
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack_from("<Q", raw, 9) == (1,)
    assert struct.unpack_from("<B", raw, 17) == (8,)  # Megatron DType.uint16
    n_seq, n_doc = struct.unpack_from("<QQ", raw, 18)
    assert (n_seq, n_doc) == (8, 5)  # two sequences per document; document_indices has docs + 1
    off = 34
    lengths = struct.unpack_from(f"<{n_seq}i", raw, off)
    assert lengths == (2, 3, 4, 4, 1, 2, 5, 5)
    off += 4 * n_seq
    pointers = struct.unpack_from(f"<{n_seq}q", raw, off)
    assert pointers == tuple(2 * x for x in np.concatenate([[0], np.cumsum(lengths)[:-1]]))
    off += 8 * n_seq
    assert struct.unpack_from(f"<{n_doc}q", raw, off) == (0, 2, 4, 6, 8)
    assert off + 8 * n_doc == len(raw)
    bin_raw = open(prefix + ".bin", "rb").read()
    assert bin_raw == np.concatenate(docs).astype("<u2").tobytes()


def test_int32_code(tmp_path):
    prefix = str(tmp_path / "i32")
    _write(prefix, [np.array([70000, 1, 2])], optimal_dtype(80000))
    raw = open(prefix + ".idx", "rb").read()
    assert struct.unpack_from("<B", raw, 17) == (4,)  # Megatron DType.int32
    assert open(prefix + ".bin", "rb").read() == np.array([70000, 1, 2], "<i4").tobytes()


@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "good")
    _write(prefix, [np.arange(10), np.arange(7)], np.uint16)
    return prefix


def _one_line(exc):
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_truncated_bin(good):
    with open(good + ".bin", "r+b") as f:
        f.truncate(20)
    with pytest.raises(ValueError) as e:
        IndexedDataset(good)
    assert good + ".bin" in _one_line(e) and "truncated" in str(e.value)


def test_wrong_magic(good):
    raw = bytearray(open(good + ".idx", "rb").read())
    raw[:9] = b"NOTMEGATR"
    open(good + ".idx", "wb").write(raw)
    with pytest.raises(ValueError) as e:
        IndexedDataset(good)
    assert good + ".idx" in _one_line(e) and "magic" in str(e.value)


def test_truncated_idx(good):
    raw = open(good + ".idx", "rb").read()
    open(good + ".idx", "wb").write(raw[:-5])
    with pytest.raises(ValueError) as e:
        IndexedDataset(good)
    assert good + ".idx" in _one_line(e)


def test_bad_dtype_code_and_version(good):
    raw = bytearray(open(good + ".idx", "rb").read())
    raw[17] = 99
    open(good + ".idx", "wb").write(raw)
    with pytest.raises(ValueError, match="dtype code 99"):
        IndexedDataset(good)
    raw[17], raw[9] = 8, 2
    open(good + ".idx", "wb").write(raw)
    with pytest.raises(ValueError, match="version 2"):
        IndexedDataset(good)


def test_missing_files(good, tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        IndexedDataset(str(tmp_path / "nope"))
    assert "nope.idx" in _one_line(e)
    os.remove(good + ".bin")
    with pytest.raises(FileNotFoundError, match="good.bin"):
        IndexedDataset(good)
