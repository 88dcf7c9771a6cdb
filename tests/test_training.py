"""End-to-end training in reduced precision tracks fp32 (parallel layouts: tests/test_parity.py)."""

import math

import pytest

import pretrain_gpt
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.training import pretrain
from parity import learnable_datasets

# On data a model learns (tests/support/parity.py's bigram chains), no warm-up, an LR that moves it.
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --log-interval 1 --vocab-size 250 "
        "--make-vocab-size-divisible-by 8 --hidden-dropout 0 --attention-dropout 0 --lr 1e-2 "
        "--lr-warmup-iters 0 --lr-decay-style constant --eval-interval 0 --eval-iters 0 --num-workers 0 "
        "--ddp-bucket-size 2000").split()


def _train(argv, world_size):
    args = parse_args(argv, world_size=world_size)
    try:
        return pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
    finally:
        ps.destroy_model_parallel()


@pytest.fixture(scope="module")
def reference_losses():
    losses = _train(BASE, 1)
    assert losses[0] - losses[-1] >= 0.5, f"fp32 does not learn: {losses}"
    return losses


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_bf16_tracks_fp32(reference_losses):
    losses = _train(BASE + ["--bf16"], 1)
    # bf16 keeps 8 mantissa bits: a few tenths of a percent per step is expected (measured
    # 5.5e-3 at most over these 10 steps, torch 2.13 CPU).
    assert _rel(losses, reference_losses) <= 2e-2


def test_fp16_with_dynamic_loss_scale_trains(reference_losses):
    # fp16 weights and activations carry 11 significant bits (~5e-4 relative per op);
    # over 10 steps of a 2-layer model the loss drifts by a few 1e-4 from fp32 (measured 4.4e-4).
    losses = _train(BASE + ["--fp16", "--initial-loss-scale", "65536"], 1)
    assert all(math.isfinite(x) for x in losses)
    assert _rel(losses, reference_losses) <= 2e-2


def test_a_trained_model_is_freed_when_dropped():
    """The model pretrain returns, its gradient hooks with it, is garbage once dropped: a process that trains
    many models (the test worlds, benchmarks, sweeps) kept every one, with the process groups it names (a gloo
    thread each, waking 100 times a second), when a hook held in C++ held the model."""
    import gc
    import weakref
    args = parse_args(BASE + ["--train-iters", "1", "--use-distributed-optimizer"], world_size=1)
    try:
        _, chunks, opt = pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args,
                                  return_state=True)
        refs = [weakref.ref(c) for c in chunks] + [weakref.ref(opt)]
        del chunks, opt
    finally:
        ps.destroy_model_parallel()
    gc.collect()
    assert all(r() is None for r in refs), "the model outlives its last reference"


def test_kernel_flags_reach_the_kernels():
    """--no-kernel-self-check and --kernel-choice reach the kernels (their self-check and race:
    tests/kernels/test_kernel_self_check.py, test_kernel_choice.py)."""
    import kernels
    from kernels import self_check
    one = [a if a != "10" else "1" for a in BASE]  # --train-iters 1
    try:
        _train(one + ["--no-kernel-self-check", "--kernel-choice", "torch"], 1)
        assert self_check.get_self_check() == "off" and kernels.get_kernel_choice() == "torch"
        _train(one, 1)
        assert self_check.get_self_check() == "cuda" and kernels.get_kernel_choice() == "auto"
    finally:
        self_check.set_self_check("cuda")
        kernels.set_kernel_choice("auto")


def test_nothing_below_the_command_line_changes_args(tmp_path, capsys):
    """Validation derives every flag's value once and hands down a frozen run configuration: training setup, the
    loop and checkpoints read it and cannot change it (what they derive lives in the run's own state: the directory
    a restarted job resumes from, a measured pipeline layout). The second run resumes from its own --save by
    itself; a datasets provider may set only what the data decides (its vocabulary), on its own draft."""
    from megalite.config.run import FrozenConfigError, RunConfig
    argv = [a if a != "10" else "2" for a in BASE] + ["--save", str(tmp_path), "--save-interval", "2"]
    _train(argv, 1)
    args = parse_args(argv + ["--train-iters", "3", "--use-checkpoint-opt_param-scheduler"], world_size=1)
    assert isinstance(args, RunConfig)
    with pytest.raises(FrozenConfigError, match="cannot set 'load'"):
        args.load = str(tmp_path)
    try:  # (an assignment anywhere below would raise)
        losses = pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
    finally:
        ps.destroy_model_parallel()
    assert len(losses) == 1, f"the run did not resume at iteration 2: {losses}"

    def meddling(draft, sizes):
        draft.vocab_size, draft.lr = 128, 1.0
        return learnable_datasets(draft, sizes)
    with pytest.raises(SystemExit):
        try:
            pretrain(meddling, pretrain_gpt.model_provider, pretrain_gpt.forward_step, parse_args(BASE, world_size=1))
        finally:
            ps.destroy_model_parallel()
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("megalite: error")]
    assert len(err) == 1 and "the datasets provider changed lr; it may set only vocab_size" in err[0], err
