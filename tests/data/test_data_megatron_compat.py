"""Cross-checks against Megatron-LM's own code (megatron-core, in the [test] extra; its core
needs only torch, numpy and packaging, and keeps the installed torch)."""
import shutil
import warnings

import numpy as np
import pytest
from conftest import write_random_dataset

mc = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                         reason="megatron-core not installed (it is in the test extra: pip install -e \".[test]\")")

from megalite.data import IndexedDataset, IndexedDatasetBuilder, build_gpt_datasets  # noqa: E402
from megalite.data.blended_dataset import build_blending_indices  # noqa: E402


def test_files_byte_identical_both_ways(tmp_path):
    import torch
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 60000, rng.integers(0, 300)) for _ in range(100)]
    for dtype in (np.uint16, np.int32):
        theirs = mc.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=dtype)
        ours = IndexedDatasetBuilder(str(tmp_path / "o.bin"), dtype)
        for d in docs:
            theirs.add_document(torch.tensor(d.astype(np.int64)), [len(d)])
            ours.add_item(d)
            ours.end_document()
        theirs.finalize(str(tmp_path / "m.idx"))
        ours.finalize(str(tmp_path / "o.idx"))
        for ext in (".bin", ".idx"):
            assert (tmp_path / f"m{ext}").read_bytes() == (tmp_path / f"o{ext}").read_bytes()
        read = mc.IndexedDataset(str(tmp_path / "o"))
        assert all(np.array_equal(read[i], d) for i, d in enumerate(docs))
        assert all(np.array_equal(IndexedDataset(str(tmp_path / "m"))[i], d) for i, d in enumerate(docs))


def test_blending_indices_equal_megatron():
    from megatron.core.datasets import helpers_cpp
    for w in ([0.3, 0.7], [0.5, 0.2, 0.3], [0.1, 0.1, 0.1, 0.7]):
        ids, within = np.zeros(20000, np.int16), np.zeros(20000, np.int64)
        helpers_cpp.build_blending_indices(ids, within, np.array(w), len(w), 20000, False)
        a, b = build_blending_indices(w, 20000)
        assert np.array_equal(a, ids) and np.array_equal(b, within)


def test_gpt_and_blended_samples_equal_megatron(tmp_path):
    import torch.distributed as dist
    warnings.filterwarnings("ignore")
    owned = not dist.is_initialized()
    if owned:  # Megatron's blended builder asks for the rank
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        _compare_with_megatron(tmp_path)
    finally:
        if owned:  # later tests fork ranks from this process: leave no default group behind
            dist.destroy_process_group()


def _compare_with_megatron(tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    class Tok:  # the few attributes Megatron's GPTDataset reads
        eod, pad, vocab_size, unique_identifiers = 5000, -1, 5001, {"class": "Tok"}

    rng = np.random.default_rng(3)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    # Every split must hold tokens: Megatron loops forever on an empty one (megalite says so).
    write_random_dataset(a, rng, num_docs=1000, max_len=120, vocab=5000, empty_every=0)
    write_random_dataset(b, rng, num_docs=600, max_len=100, vocab=5000, empty_every=0)
    for blend, ours_path, sizes in [(([a], None), [a], [3000, 100, 20]),
                                    (([a, b], [0.3, 0.7]), ["0.3", a, "0.7", b], [2000, 50, 10])]:
        shutil.rmtree(tmp_path / "mc", ignore_errors=True)
        cfg = GPTDatasetConfig(random_seed=1234, sequence_length=64, blend=blend, split="949,50,1",
                               path_to_cache=str(tmp_path / "mc"), tokenizer=Tok(),
                               reset_position_ids=False, reset_attention_mask=False,
                               eod_mask_loss=False, create_attention_mask=False)
        theirs = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()
        ours = build_gpt_datasets(ours_path, "949,50,1", 64, 1234, tuple(sizes), str(tmp_path / "oc"))
        for t, o in zip(theirs, ours):
            assert len(t) == len(o)
            for k in range(0, len(o), 7):
                s = t[k]
                np.testing.assert_array_equal(
                    np.concatenate([s["tokens"].numpy()[:1], s["labels"].numpy()]), o[k]["text"])
