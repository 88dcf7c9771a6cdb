"""Command-line validation in-process: one clear line for each user error; accepted flags work."""

import pytest

import pretrain_gpt
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.training import pretrain

OK = "--mock-data --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 8 --micro-batch-size 1 " \
     "--lr 1e-3 --train-iters 2 --num-workers 0"

BAD = {
    "--micro-batch-size 0": "--micro-batch-size 0 must be >= 1",
    "--log-interval 0": "--log-interval 0 must be >= 1",
    "--recompute-granularity selective --recompute-num-layers 2": "need --recompute-granularity full",
    "--decoder-first-pipeline-num-layers 1": "need --pipeline-model-parallel-size > 1",
    "--bf16 --fp16": "--bf16 and --fp16 are exclusive",
    "--zero-stage 2": "need --use-distributed-optimizer",
    # fault-tolerant replicas (megalite/cli/features/ft.py)
    "--ft-replica-id 0": "--ft-replica-id 0 needs --ft-lighthouse HOST:PORT",
    "--ft-lighthouse localhost:29510": "--ft-lighthouse needs --ft-replica-id",
    "--ft-lighthouse localhost:29510 --ft-replica-id 0 --ft-min-replicas 0": "--ft-min-replicas 0 must be at least 1",
    "--ft-lighthouse localhost:29510 --ft-replica-id 0 --ft-replica-share 0":
        "--ft-replica-share 0 must be a positive integer",
    "--ft-lighthouse localhost:29510 --ft-replica-id 0 --ft-replica-share auto --ft-share-profile-iters 0":
        "--ft-share-profile-iters 0 must be at least 1",
    "--ft-lighthouse localhost:29510 --ft-replica-id 0 --optimizer-cpu-offload": "is not built yet in megalite",
    "--ft-lighthouse localhost:29510 --ft-replica-id 0 --semi-sync-method diloco --semi-sync-fragment-alpha 0.5":
        "--ft-lighthouse with --semi-sync-fragments/-delay/-alpha (streaming) is not built yet",
    "--ft-lighthouse localhost:29510 --ft-replica-id 0 --semi-sync-method local_sgd --semi-sync-steps auto":
        "--ft-lighthouse with --semi-sync-steps auto is not built yet",
    "--ft-lighthouse localhost:29510 --ft-replica-id 0 --semi-sync-method diloco --ft-replica-share auto":
        "--ft-replica-share auto with --semi-sync-method is not built yet",
    # FP8 (megalite/cli/features/fp8.py)
    "--fp8-format hybrid --fp8-recipe mxfp8": "--fp8-recipe mxfp8 needs Blackwell GPUs",
    "--fp8-format hybrid --fp8-recipe custom": "--fp8-recipe custom (a Transformer Engine quantizer factory)",
    "--fp8-format hybrid --fp8-param-gather": "--fp8-param-gather needs --use-distributed-optimizer",
    "--fp8-format hybrid --fp8-param-gather --use-distributed-optimizer":
        "--fp8-param-gather needs --bf16 or --fp16",
    "--fp8-format hybrid --fp8-param-gather --use-distributed-optimizer --bf16 --fp8-recipe rowwise":
        "--fp8-param-gather needs --fp8-recipe tensorwise or delayed",
    "--fp8-format hybrid --num-experts 4 --disable-bias-linear --fp8-param-gather --use-distributed-optimizer --bf16":
        "--fp8-format with --fp8-param-gather of MoE experts (--num-experts) is not built yet",
    "--first-last-layers-bf16": "--first-last-layers-bf16 needs --fp8-format e4m3 or hybrid",
    "--fp8-format hybrid --fp8-interval 2": "--fp8-interval 2: Megatron deprecated it",
    "--kernel-choice fast": "argument --kernel-choice: invalid choice: 'fast' (choose from 'auto', 'triton', 'torch')",
}


@pytest.mark.parametrize("flags", list(BAD))
def test_user_error_is_one_line(flags, capsys, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)  # (--ft-replica-id alone reads it)
    with pytest.raises(SystemExit) as e:
        parse_args((OK + " " + flags).split(), world_size=1)
    assert e.value.code != 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("megalite: error (rank 0):") and BAD[flags] in err[0], err


def test_torchft_missing_names_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torchft", None)  # (find_spec: as if not installed)
    with pytest.raises(SystemExit):
        parse_args((OK + " --ft-lighthouse localhost:29510 --ft-replica-id 0").split(), world_size=1)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "--ft-lighthouse needs torchft: pip install 'megalite[ft]'" in err[0], err


def test_stage_without_layers_is_rejected(capsys):
    with pytest.raises(SystemExit):
        parse_args((OK + " --num-layers 4 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 4")
                   .split(), world_size=2)
    assert "leaves a stage without layers" in capsys.readouterr().err


def test_eval_iters_zero_turns_evaluation_off(capsys):
    args = parse_args((OK + " --train-iters 2 --eval-interval 1 --eval-iters 0 --vocab-size 64").split(), world_size=1)
    try:
        losses = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
    finally:
        ps.destroy_model_parallel()
    assert len(losses) == 2 and "validation loss" not in capsys.readouterr().out  # (the split sizes name it)
