"""--profile --use-pytorch-profiler (Megatron's profiling flags, megalite/training/profiler.py): the profiled
iterations' trace lands in --tensorboard-dir, the run's values are the unprofiled run's, and each misuse is one
line."""

import glob
import json

import pytest

import pretrain_gpt
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.training import pretrain
from parity import BASE, learnable_datasets


def _run(argv):
    args = parse_args(list(BASE) + ["--train-iters", "5"] + argv, world_size=1)
    try:
        return pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
    finally:
        ps.destroy_model_parallel()


def test_the_profiled_iterations_trace_and_change_nothing(tmp_path):
    plain = _run([])
    profiled = _run(["--profile", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "4",
                     "--tensorboard-dir", str(tmp_path)])
    assert profiled == plain
    (trace,) = glob.glob(str(tmp_path / "rank0*.pt.trace.json"))
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
    # Megatron's schedule: wait start - 1, warm up 1, active end - start (the profiler's own step numbers)
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"], steps
    assert any(e.get("name", "").startswith("aten::mm") for e in events)  # (the GEMMs of those iterations)


@pytest.mark.parametrize("flags, says", [
    ("--use-pytorch-profiler", "--use-pytorch-profiler picks --profile's profiler; add --profile"),
    ("--profile --use-pytorch-profiler --profile-step-start 4 --profile-step-end 4 --tensorboard-dir x",
     "it needs 0 <= start < end"),
    ("--profile --use-pytorch-profiler", "writes its traces to --tensorboard-dir: give one")])
def test_profiling_misuse_is_one_line(flags, says, capsys):
    with pytest.raises(SystemExit):
        parse_args(list(BASE) + flags.split(), world_size=1)
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="with CUDA, --profile alone is nsys' capture range")
def test_nsys_profiling_without_cuda_is_one_line(capsys):
    with pytest.raises(SystemExit):
        parse_args(list(BASE) + ["--profile"], world_size=1)
    err = capsys.readouterr().err
    assert "needs CUDA; add --use-pytorch-profiler" in err and len(err.strip().splitlines()) == 1, err
