"""The data pipeline feeds training: preprocess -> --data-path, and the built-in default corpus."""

import json
import os
import subprocess
import sys

import pytest

import pretrain_gpt
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.training import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 4 "
        "--hidden-dropout 0 --attention-dropout 0 --lr 3e-3 --lr-warmup-iters 2 --log-interval 5 "
        "--eval-interval 10 --eval-iters 2 --num-workers 0").split()


def _train(argv):
    try:
        return pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                        parse_args(argv, world_size=1))
    finally:
        ps.destroy_model_parallel()


def _tool(*argv):
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_preprocessed_jsonl_trains(tmp_path):
    words = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat".split()
    with open(tmp_path / "corpus.jsonl", "w") as f:
        for i in range(300):
            f.write(json.dumps({"text": " ".join(words[(i + k) % len(words)] for k in range(40))}) + "\n")
    _tool("tools/train_tokenizer.py", "--input", str(tmp_path / "corpus.jsonl"), "--json-keys", "text",
          "--model-prefix", str(tmp_path / "tok"), "--vocab-size", "320")
    out = _tool("tools/preprocess_data.py", "--input", str(tmp_path / "corpus.jsonl"), "--json-keys", "text",
                "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "tok.model"),
                "--output-prefix", str(tmp_path / "out"), "--append-eod", "--workers", "2")
    assert "tokens" in out
    losses = _train(TINY + ["--data-path", str(tmp_path / "out_text_document"), "--tokenizer-type",
                            "SentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "tok.model"),
                            "--split", "90,10,0", "--train-iters", "30", "--data-cache-path", str(tmp_path / "c")])
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, f"a repetitive corpus must be learned: {losses}"


def test_default_corpus_trains(tmp_path):
    losses = _train(TINY + ["--train-iters", "20", "--data-cache-path", str(tmp_path)])
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.5, losses
    cached = [d for d in os.listdir(tmp_path) if d.startswith("default_corpus")]
    assert cached, "the default corpus is cached under --data-cache-path"


def test_data_path_needs_a_tokenizer(tmp_path):
    with pytest.raises(SystemExit):
        _train(TINY + ["--data-path", str(tmp_path / "nothing"), "--train-iters", "1"])


def test_a_data_path_per_split_trains_and_evaluates(tmp_path, capsys):
    """pretrain_gpt.py --train-data-path A --valid-data-path B (Megatron's): trains on A, evaluates on B; with
    --data-path or --split as well, one line."""
    import numpy as np
    from megalite.data.indexed_dataset import IndexedDatasetBuilder, index_file_path
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        b = IndexedDatasetBuilder(str(tmp_path / name) + ".bin", np.uint16)
        for _ in range(40):
            b.add_item(rng.integers(0, 500, int(rng.integers(10, 80))))
            b.end_document()
        b.finalize(index_file_path(str(tmp_path / name)))
    data = ["--train-data-path", str(tmp_path / "a"), "--valid-data-path", str(tmp_path / "b"),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--data-cache-path", str(tmp_path / "c")]
    losses = _train(TINY + data + ["--train-iters", "10"])
    assert len(losses) == 10
    out = capsys.readouterr().out
    assert "validation loss at iteration 10" in out, out
    assert "evaluation skipped: the test split holds no sample; give --test-data-path to evaluate it" in out, out
    for extra, says in ((["--split", "9,1,0"], "--train-data-path gives each split its own data; --split does too"),
                        (["--data-path", str(tmp_path / "a")], "; --data-path does too: drop one")):
        with pytest.raises(SystemExit):
            parse_args(TINY + data + ["--train-iters", "1"] + extra, world_size=1)
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
