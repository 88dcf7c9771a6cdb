"""Split sizes at start, and one line (once per run) when an evaluation is skipped because its
--split share holds no sample (issue 34: a small corpus with --split 99990,8,2 used to skip
validation without a word)."""

import numpy as np
import pytest

import pretrain_gpt
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.data.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path
from megalite.training import pretrain

MODEL = ("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
         "--global-batch-size 2 --lr 1e-3 --train-iters 2 --log-interval 2 --eval-interval 1 --eval-iters 1 "
         "--tokenizer-type NullTokenizer --vocab-size 63 --make-vocab-size-divisible-by 8 --num-workers 0").split()
SKIP = "megalite: evaluation skipped:"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """300 documents of 20 NullTokenizer ids and an end of document (63)."""
    prefix = str(tmp_path_factory.mktemp("splits") / "corpus_text_document")
    rng = np.random.default_rng(0)
    b = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.int32)
    for _ in range(300):
        b.add_document(rng.integers(0, 63, 20).tolist() + [63], [21])
    b.finalize(index_file_path(prefix))
    return ["--data-path", prefix, "--data-cache-path", str(tmp_path_factory.mktemp("cache"))]


def _run(argv, capsys):
    capsys.readouterr()
    try:
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                 parse_args(MODEL + argv, world_size=1))
    finally:
        ps.destroy_model_parallel()
    return capsys.readouterr().out


def test_empty_validation_and_test_splits_are_said_once(data, capsys):
    out = _run(data + ["--split", "99990,8,2"], capsys)
    lines = out.splitlines()
    head = lines.index("megalite: datasets built, samples per split (this run needs 4, 6, 2):")
    assert lines[head + 2:head + 4] == ["    validation: 0", "    test:       0"], out
    assert lines[head + 1].startswith("    train:      ") and int(lines[head + 1].split()[-1]) >= 4, out
    skips = [ln for ln in lines if ln.startswith(SKIP)]
    # Two periodic evaluations (--eval-interval 1) and the two final ones would have run: one line.
    assert skips == ["megalite: evaluation skipped: the validation and test splits hold no sample (--split "
                     "99990,8,2 gives them 0 and 0 of 300 documents); give them a larger share of --split to "
                     "evaluate them"], out
    assert "validation loss at" not in out, out


def test_only_the_empty_test_split_is_named(data, capsys):
    out = _run(data + ["--split", "90,10,0"], capsys)
    skips = [ln for ln in out.splitlines() if ln.startswith(SKIP)]
    assert skips == ["megalite: evaluation skipped: the test split holds no sample (--split 90,10,0 gives it 0 of "
                     "300 documents); give it a larger share of --split to evaluate it"], out
    assert out.count("validation loss at iteration") == 2 and "end of training for val data" in out, out


def test_non_empty_splits_give_no_skip_line(data, capsys):
    out = _run(data + ["--split", "90,8,2"], capsys)
    assert "    validation: " in out and "    validation: 0\n" not in out, out
    assert SKIP not in out, out
    assert "end of training for val data" in out and "end of training for test data" in out, out


def test_document_counts_are_sequences_for_gpt_and_documents_for_bert(tmp_path):
    """The skip line's counts follow each builder's unit: GPT splits sequences (as Megatron), BERT documents."""
    from megalite.data.builder import split_document_counts
    prefix = str(tmp_path / "sentences_text_document")
    b = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.int32)
    for _ in range(10):
        b.add_document(list(range(9)), [3, 3, 3])  # three sentences per document
    b.finalize(index_file_path(prefix))
    assert split_document_counts([prefix], "80,20,0") == ([24, 6, 0], 30)
    assert split_document_counts([prefix], "80,20,0", documents=True) == ([8, 2, 0], 10)
