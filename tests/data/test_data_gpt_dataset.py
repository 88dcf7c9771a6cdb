import os

import numpy as np
import pytest
from conftest import write_random_dataset

from megalite.data import GPTDataset, IndexedDataset, build_gpt_datasets
from megalite.data.gpt_dataset import build_sample_index, parse_split, split_ranges


def megatron_sample_index_loop(sizes, doc_index, L):
    """Megatron's C++ build_sample_idx, transcribed as a per-document loop (the reference)."""
    num_samples = (int(sizes[doc_index].sum()) - 1) // L
    out = [(0, 0)]
    d, off = 0, 0
    while len(out) <= num_samples:
        remaining = L + 1
        while remaining:
            doc_len = int(sizes[doc_index[d]]) - off
            remaining -= doc_len
            if remaining <= 0:
                off += remaining + doc_len - 1
                remaining = 0
            else:
                d += 1
                off = 0
        out.append((d, off))
    return np.array(out)


@pytest.fixture
def data(tmp_path):
    rng = np.random.default_rng(7)
    docs = write_random_dataset(tmp_path / "d", rng, empty_every=0)
    return str(tmp_path / "d"), docs


@pytest.mark.parametrize("L", [1, 7, 16, 49])
def test_sample_index_matches_megatron_loop(data, L):
    prefix, docs = data
    sizes = IndexedDataset(prefix).sequence_lengths
    doc_index = np.random.default_rng(L).permutation(np.tile(np.arange(len(docs)), 2))
    np.testing.assert_array_equal(build_sample_index(sizes, doc_index, L),
                                  megatron_sample_index_loop(sizes, doc_index, L))


@pytest.mark.parametrize("L,num_samples", [(16, 30), (16, 200), (33, 150), (5, 2000)])
def test_every_sample_is_the_stream_at_its_position(tmp_path, L, num_samples):
    rng = np.random.default_rng(L)
    docs = write_random_dataset(tmp_path / "s", rng)  # includes empty documents
    indexed = IndexedDataset(str(tmp_path / "s"))
    ds = GPTDataset(indexed, np.arange(len(docs)), num_samples, L, seed=3,
                    cache_dir=str(tmp_path / "c"))
    assert len(ds) >= num_samples
    n_docs = len(docs)
    epochs = len(ds.document_index) // n_docs
    # As Megatron: all epochs shuffled together (the final one apart when little of it is used).
    assert sorted(ds.document_index) == sorted(list(range(n_docs)) * epochs)
    if epochs > 1 and not np.array_equal(sorted(ds.document_index[-n_docs:]), np.arange(n_docs)):
        assert num_samples * L > (epochs - 1 + 0.8) * sum(map(len, docs)) - L  # not separated
    stream = np.concatenate([docs[d] for d in ds.document_index])
    assert sorted(ds.shuffle_index) == list(range(len(ds)))
    for k in range(len(ds)):
        j = int(ds.shuffle_index[k])
        sample = ds[k]["text"]
        assert sample.dtype == np.int64 and sample.shape == (L + 1,)
        np.testing.assert_array_equal(sample, stream[j * L:j * L + L + 1])


def test_determinism_seeds_and_cache(data, tmp_path, monkeypatch):
    prefix, docs = data
    indexed = IndexedDataset(prefix)
    make = lambda seed, cache: GPTDataset(indexed, np.arange(len(docs)), 100, 16, seed,  # noqa
                                          str(tmp_path / cache))
    a, b, c = make(1, "a"), make(1, "b"), make(2, "c")
    sa, sb, sc = ([d[i]["text"] for i in range(len(d))] for d in (a, b, c))
    assert all(np.array_equal(x, y) for x, y in zip(sa, sb))
    assert not all(np.array_equal(x, y) for x, y in zip(sa, sc))
    # A second construction loads the cache (building again would fail here).
    monkeypatch.setattr(GPTDataset, "_build", lambda *a, **k: pytest.fail("rebuilt"))
    again = make(1, "a")
    np.testing.assert_array_equal(again.shuffle_index, a.shuffle_index)
    assert len(os.listdir(tmp_path / "a")) == 4  # 3 indices + description
    with pytest.raises(RuntimeError, match="missing"):
        GPTDataset(indexed, np.arange(len(docs)), 100, 16, 1, str(tmp_path / "empty"), load_only=True)


def test_pickle_reopens_files(data, tmp_path):
    import pickle
    prefix, docs = data
    ds = GPTDataset(IndexedDataset(prefix), np.arange(len(docs)), 50, 16, 1, str(tmp_path))
    blob = pickle.dumps(ds)
    assert len(blob) < 4096  # paths and scalars only, not the tokens or the indices
    again = pickle.loads(blob)
    assert all(np.array_equal(ds[i]["text"], again[i]["text"]) for i in range(len(ds)))


def test_split_ranges_and_disjoint_splits(data, tmp_path):
    assert parse_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert split_ranges(parse_split("949,50,1"), 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges(parse_split("80,20"), 60) == [(0, 48), (48, 60), (60, 60)]
    prefix, docs = data
    train, valid, test = build_gpt_datasets([prefix], "80,20,0", 8, 1, (50, 10, 0), str(tmp_path))
    assert test is None
    train_docs, valid_docs = set(train.document_index.tolist()), set(valid.document_index.tolist())
    assert train_docs == set(range(48)) and valid_docs == set(range(48, 60))


def test_builder_barrier_protocol(data, tmp_path):
    prefix, _ = data
    calls = []
    args = ([prefix], "90,10,0", 8, 5, (40, 5, 0), str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="missing"):  # others cannot load before the builder
        build_gpt_datasets(*args, is_builder=False, barrier=lambda: calls.append("b"))
    built = build_gpt_datasets(*args, is_builder=True, barrier=lambda: calls.append("b"))
    loaded = build_gpt_datasets(*args, is_builder=False, barrier=lambda: calls.append("b"))
    assert calls == ["b", "b", "b"]  # exactly one barrier per call, whatever happens
    np.testing.assert_array_equal(built[0][3]["text"], loaded[0][3]["text"])


@pytest.mark.parametrize("kwargs,match", [
    (dict(split="a,b"), "--split 'a,b'"),
    (dict(split="0,0,0"), "--split"),
    (dict(data_path=["0.5", "P"]), "No such|not found"),
    (dict(data_path=["0.5", "P", "0.5"]), "odd number"),
    (dict(data_path=["0.5", "P", "x", "P"]), "'x' is not a non-negative weight"),
    (dict(seq_length=0), "--seq-length 0"),
])
def test_bad_arguments_one_line(data, tmp_path, kwargs, match):
    prefix, _ = data
    args = dict(data_path=[prefix], split="949,50,1", seq_length=8, seed=1, num_samples=(10, 1, 1),
                cache_path=str(tmp_path))
    args.update(kwargs)
    args["data_path"] = [prefix if p == "P" else p for p in args["data_path"]]
    if match.startswith("No such"):
        args["data_path"] = ["0.5", str(tmp_path / "missing"), "0.5", prefix]
    calls = []
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        build_gpt_datasets(**args, barrier=lambda: calls.append(1))
    assert "\n" not in str(e.value)
    if not match.startswith("No such"):
        assert match in str(e.value)
    else:
        assert "missing.idx" in str(e.value)
    assert calls == []  # user errors are raised on every rank before the barrier


def test_separate_final_epoch(data, tmp_path):
    prefix, docs = data
    indexed = IndexedDataset(prefix)
    L, tokens = 16, sum(map(len, docs))
    per_epoch = (tokens - 1) // L
    ds = GPTDataset(indexed, np.arange(len(docs)), per_epoch + 2, L, 9, str(tmp_path))
    n = len(docs)
    assert len(ds.document_index) == 2 * n
    assert sorted(ds.document_index[:n]) == sorted(ds.document_index[n:]) == list(range(n))
    before_final = (tokens - 1) // L  # samples fully inside the first epoch's shuffle
    assert sorted(ds.shuffle_index[:before_final]) == list(range(before_final))


def test_a_data_path_per_split_gives_each_split_all_of_its_data(tmp_path):
    """Megatron's --train/--valid/--test-data-path: each split's dataset is the whole of its own prefix (a blend
    too), the same samples as that prefix alone given every document; a split without a path has none."""
    from megalite.data import build_gpt_datasets_per_split
    rng = np.random.default_rng(3)
    for name in ("a", "b", "c"):
        write_random_dataset(tmp_path / name, rng, empty_every=0)
    a, b, c = (str(tmp_path / n) for n in "abc")
    train, valid, test = build_gpt_datasets_per_split([[a], ["1", b, "3", c], None], 8, 1, (40, 12, 5),
                                                      str(tmp_path / "cache"))
    assert test is None
    assert set(train.document_index.tolist()) == set(range(60))
    alone = build_gpt_datasets([a], "1,0,0", 8, 1, (40, 0, 0), str(tmp_path / "cache2"))[0]
    assert len(train) == len(alone) and all(np.array_equal(train[i]["text"], alone[i]["text"]) for i in range(40))
    assert len(valid) == 12 and {valid.dataset_index[i] for i in range(12)} == {0, 1}  # (the blend of b and c)
