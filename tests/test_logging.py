"""Evaluation and logging: --log-json lines, final validation + test evaluation, --skip-train
on a loaded checkpoint, --log-params-norm, tools/plot_metrics.py."""

import json
import re
import math
import os
import subprocess
import sys

import pytest

import pretrain_gpt
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.checkpoint.convert import Reader, find_checkpoint
from megalite.training import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ("--mock-data --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
       "--vocab-size 128 --make-vocab-size-divisible-by 8 --train-iters 6 --log-interval 2 --eval-interval 3 "
       "--eval-iters 2 --hidden-dropout 0 --attention-dropout 0 --lr 1e-3 --num-workers 0").split()


def _train(argv, capsys):
    args = parse_args(RUN + argv, world_size=1)
    try:
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
    finally:
        ps.destroy_model_parallel()
    return capsys.readouterr().out


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_log_json_evaluations_skip_train_and_plot(tmp_path, capsys):
    log, ckpt = str(tmp_path / "run.jsonl"), str(tmp_path / "ckpt")
    out = _train(["--log-json", log, "--log-params-norm", "--log-num-zeros-in-grad", "--save", ckpt], capsys)
    rows = _rows(log)
    train = [r for r in rows if "lm loss" in r]
    assert [r["iteration"] for r in train] == [2, 4, 6]
    for r in train:
        for k in ("learning-rate", "grad-norm", "throughput", "params-norm", "num-zeros", "memory-mb"):
            assert k in r and math.isfinite(r[k]), (k, r)
    valid = [r["iteration"] for r in rows if "validation lm loss" in r]
    assert valid == [3, 6, 6]  # every --eval-interval, then the final validation as Megatron
    test = [r for r in rows if "test lm loss" in r]
    assert len(test) == 1 and "validation loss at the end of training for test data" in out
    # the logged parameter norm is the norm of the weights the checkpoint holds
    path, _ = find_checkpoint(ckpt)
    rd = Reader(path)
    norm = math.sqrt(sum(rd.get(n).double().pow(2).sum().item() for n in rd.names() if not n.startswith("optim")))
    # fp32 squares summed per tensor, over tensors and ranks, against float64: DESIGN's fp32 bound
    assert abs(train[-1]["params-norm"] - norm) <= 1e-5 * norm
    # --skip-train evaluates the loaded checkpoint: the same test loss, no training line
    out2 = _train(["--load", ckpt, "--skip-train", "--log-json", str(tmp_path / "eval.jsonl")], capsys)
    again = _rows(str(tmp_path / "eval.jsonl"))
    assert not [r for r in again if "lm loss" in r] and not re.search(r" iteration +\d+/", out2)
    assert [r["test lm loss"] for r in again if "test lm loss" in r] == [test[0]["test lm loss"]]
    # --eval-global-batch-size / --eval-micro-batch-size: the same 4 test samples as 1 batch of 4
    # micro-batches of 1 (or of one micro-batch of 4) as in 2 batches of 2: the same mean loss,
    # summed in another order (DESIGN's fp32 bound)
    for eval_flags in ("--eval-global-batch-size 4 --eval-micro-batch-size 1", "--eval-global-batch-size 4 "
                       "--eval-micro-batch-size 4"):
        _train(["--load", ckpt, "--skip-train", "--eval-iters", "1", "--log-json", str(tmp_path / "e4.jsonl")]
               + eval_flags.split(), capsys)
        one = [r["test lm loss"] for r in _rows(str(tmp_path / "e4.jsonl")) if "test lm loss" in r][-1]
        assert abs(one - test[0]["test lm loss"]) <= 1e-5 * test[0]["test lm loss"], (eval_flags, one, test)
    with pytest.raises(SystemExit):
        parse_args(RUN + ["--eval-global-batch-size", "6", "--eval-micro-batch-size", "4"], world_size=1)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--eval-global-batch-size 6 must be a positive multiple of --eval-micro-batch-size 4" \
        in err[0], err
    # the plot
    pytest.importorskip("matplotlib", reason="tools/plot_metrics.py needs matplotlib (the [test] extra has it)")
    png = str(tmp_path / "run.png")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_metrics.py"), log, "-o", png],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 10_000
    # runs overlaid against wall-clock seconds: a row's "seconds", else the logged iteration times summed
    other = str(tmp_path / "other.jsonl")
    with open(other, "w") as f:
        f.write(json.dumps({"iteration": 2, "seconds": 1.5, "validation lm loss": 4.0}) + "\n")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_metrics.py"), log, other, "--x", "seconds",
                        "-o", png], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    import importlib.util
    spec = importlib.util.spec_from_file_location("plot_metrics", os.path.join(ROOT, "tools", "plot_metrics.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    rows = [{"iteration": 2, "iteration-time": 0.5, "lm loss": 5.0}, {"iteration": 4, "iteration-time": 1.0,
                                                                    "lm loss": 4.0}]
    assert tool.series(rows, "lm loss", "seconds") == ([1.0, 3.0], [5.0, 4.0])
    assert tool.series(rows, "lm loss") == ([2, 4], [5.0, 4.0])


def test_moe_per_layer_logging_goes_to_the_logs_not_the_console(tmp_path, capsys):
    """--moe-per-layer-logging: each MoE layer's router losses in --log-json / TensorBoard (Megatron's
    moe/<name>_layer_<i>); the console line keeps the mean over the layers, which they average to."""
    log = str(tmp_path / "moe.jsonl")
    out = _train(["--num-layers", "3", "--num-experts", "4", "--disable-bias-linear", "--moe-aux-loss-coeff", "0.01",
                  "--moe-z-loss-coeff", "0.001", "--moe-layer-freq", "[1,0,1]", "--moe-per-layer-logging",
                  "--eval-iters", "0", "--log-json", log], capsys)
    rows = [r for r in _rows(log) if "lm loss" in r]
    assert rows and "load_balancing_loss: " in out and "moe/" not in out
    for r in rows:
        for name in ("load_balancing_loss", "z_loss"):
            per = [r[f"moe/{name}_layer_{i}"] for i in (1, 3)]
            assert f"moe/{name}_layer_2" not in r  # a dense layer
            assert all(v > 0 for v in per) and abs(sum(per) / 2 - r[name]) <= 1e-6 * r[name], (name, r)


class _FakeWandb:
    """The part of the wandb API Megatron's writer uses (init, log, finish), recording calls: the
    real package is an optional extra this machine does not install."""

    def __init__(self):
        self.inits, self.logs, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)

    def log(self, values, step):
        self.logs.append((step, dict(values)))

    def finish(self):
        self.finished += 1


def test_wandb_gets_the_logged_scalars(tmp_path, capsys, monkeypatch):
    """--wandb-project: wandb.init(project, name, entity, dir, config=the arguments) on the last rank,
    then every scalar --log-json gets, at the same iteration, and finish() at the end."""
    fake, log = _FakeWandb(), str(tmp_path / "run.jsonl")
    monkeypatch.setitem(sys.modules, "wandb", fake)
    _train(["--wandb-project", "proj", "--wandb-exp-name", "run1", "--wandb-entity", "team", "--save",
            str(tmp_path / "ckpt"), "--log-json", log], capsys)
    (init,) = fake.inits
    assert (init["project"], init["name"], init["entity"]) == ("proj", "run1", "team")
    assert init["dir"] == str(tmp_path / "ckpt" / "wandb") and os.path.isdir(init["dir"])
    assert init["config"]["hidden_size"] == 32 and init["config"]["wandb_project"] == "proj"
    rows = _rows(log)
    assert len(rows) == len(fake.logs) >= 4 and fake.finished == 1
    for row, (step, values) in zip(rows, fake.logs):
        assert step == row.pop("iteration") and values == row
    assert any("lm loss" in v and "learning-rate" in v for _, v in fake.logs)
    assert any("validation lm loss" in v for _, v in fake.logs)


def test_wandb_errors_are_one_line(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        parse_args(RUN + ["--wandb-project", "proj"], world_size=1)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--wandb-project needs --wandb-exp-name" in err[0]
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: `import wandb` raises ImportError
    args = parse_args(RUN + ["--wandb-project", "proj", "--wandb-exp-name", "x"], world_size=1)
    with pytest.raises(SystemExit):
        try:
            pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
        finally:
            ps.destroy_model_parallel()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--wandb-project needs the wandb package" in err[0], err
    assert "pip install 'megalite[wandb]'" in err[0], err  # the extra in setup.py
