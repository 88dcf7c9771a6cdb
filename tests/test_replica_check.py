"""--check-weight-hash-across-dp-replicas-interval and --test-mode: replicas that agree train on
(TP2 x DP2 with ZeRO-1 and the overlapped parameter all-gather, which the hash waits for; SP with
q/k norms under --test-mode); one ulp moved in one replica's weight (plain DP: each replica updates
its own copy, so the drift persists) stops every rank at the next check with one line naming the
parameter."""

import contextlib
import io

import pytest

import pretrain_gpt
from dist_util import run_on_ranks
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from parity import BASE, learnable_datasets

FLAGS = ["--tensor-model-parallel-size", "2", "--train-iters", "4",
         "--check-weight-hash-across-dp-replicas-interval", "2"]
ZERO = ["--use-distributed-optimizer", "--overlap-param-gather"]
VICTIM = "decoder.layers.1.mlp.linear_fc1.weight"
NORM = "decoder.layers.0.input_layernorm.weight"  # whole on every TP rank
TEST_MODE = ["--test-mode", "--sequence-parallel", "--qk-layernorm"]


def _train(corrupt, flags):
    """corrupt: None, or (name, group coordinate that must be 1 for the rank that drifts)."""
    import megalite.training.step as training
    from megalite.training import pretrain
    real = training.train_step

    def step(*a, **kw):
        out = real(*a, **kw)
        step.calls += 1
        rank = {"dp": ps.get_data_parallel_rank, "tp": ps.get_tensor_model_parallel_rank}
        if corrupt and step.calls == 3 and rank[corrupt[1]]() == 1:  # in iteration 3, after its step
            w = dict(a[2][0].module.named_parameters())[corrupt[0]]
            w.data.view(-1)[5] = w.data.view(-1)[5].nextafter(w.data.view(-1)[5] + 1)  # one ulp
        return out
    step.calls = 0
    training.train_step = step
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            losses = pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                                       parse_args(list(BASE) + FLAGS + flags, world_size=4))
        return "ok", losses, err.getvalue()
    except SystemExit as e:
        return e.code, None, err.getvalue()
    finally:
        training.train_step = real
        ps.destroy_model_parallel()


def _all():
    return (_train(None, ZERO), _train((VICTIM, "dp"), []), _train(None, TEST_MODE), _train((NORM, "tp"), TEST_MODE))


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(_all, 4)


def test_agreeing_replicas_train_on(runs):
    for rank, (clean, _, test_mode, _) in enumerate(runs):
        for run in (clean, test_mode):
            assert run[0] == "ok" and len(run[1]) == 4, (rank, run)


def _stopped(run, iteration):
    code, _, err = run
    lines = [ln for ln in err.splitlines() if ln.startswith("megalite: error")]
    assert code == 2 and len(lines) == 1, (code, err)
    assert f"iteration {iteration}: replicas hold different weights" in lines[0], lines[0]
    return lines[0]


def test_one_ulp_in_one_replica_stops_every_rank(runs):
    for rank, (_, bad, _, _) in enumerate(runs):
        line = _stopped(bad, 4)  # the next check (interval 2)
        assert VICTIM in line and line.count("decoder.") == 1, line


def test_test_mode_checks_tp_replicated_weights_every_iteration(runs):
    """--test-mode: a norm weight that drifted on TP rank 1 only (DP replicas still agree pairwise
    on TP rank 0) stops the job at the very next iteration."""
    for rank, (_, _, _, bad) in enumerate(runs):
        line = _stopped(bad, 3)
        assert f"{NORM} (over TP)" in line, line


def test_interval_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        parse_args(list(BASE) + ["--check-weight-hash-across-dp-replicas-interval", "0"], world_size=1)
    assert "--check-weight-hash-across-dp-replicas-interval 0 must be >= 1" in capsys.readouterr().err
