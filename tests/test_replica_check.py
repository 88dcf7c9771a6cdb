"""--check-weight-hash-across-dp-replicas-interval: DP replicas that agree train on (TP2 x DP2
with ZeRO-1 and the overlapped parameter all-gather, which the hash waits for); one ulp moved in
one replica's weight (plain DP: each replica updates its own copy, so the drift persists) stops
every rank at the next check with one line naming the parameter."""

import contextlib
import io

import pytest

import pretrain_gpt
from dist_util import run_on_ranks
from megalite import parallel_state as ps
from megalite.arguments import parse_args
from parity import BASE, learnable_datasets

FLAGS = ["--tensor-model-parallel-size", "2", "--train-iters", "4", "--check-weight-hash-across-dp-replicas-interval", "2"]
ZERO = ["--use-distributed-optimizer", "--overlap-param-gather"]
VICTIM = "decoder.layers.1.mlp.linear_fc1.weight"


def _train(corrupt, flags):
    import megalite.training as training
    real = training.train_step

    def step(*a, **kw):
        out = real(*a, **kw)
        step.calls += 1
        if corrupt and step.calls == 3 and ps.get_data_parallel_rank() == 1:  # after the check at iteration 2
            w = dict(a[2][0].module.named_parameters())[VICTIM]
            w.data.view(-1)[5] = w.data.view(-1)[5].nextafter(w.data.view(-1)[5] + 1)  # one ulp
        return out
    step.calls = 0
    training.train_step = step
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            losses = training.pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                                       parse_args(list(BASE) + FLAGS + flags, world_size=4))
        return "ok", losses, err.getvalue()
    except SystemExit as e:
        return e.code, None, err.getvalue()
    finally:
        training.train_step = real
        ps.destroy_model_parallel()


def _both():
    return _train(False, ZERO), _train(True, [])


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(_both, 4)


def test_agreeing_replicas_train_on(runs):
    for rank, (clean, _) in enumerate(runs):
        assert clean[0] == "ok" and len(clean[1]) == 4, (rank, clean)


def test_one_ulp_in_one_replica_stops_every_rank(runs):
    for rank, (_, bad) in enumerate(runs):
        code, _, err = bad
        lines = [ln for ln in err.splitlines() if ln.startswith("megalite: error")]
        assert code == 2 and len(lines) == 1, (rank, code, err)
        assert "iteration 4: data-parallel replicas hold different weights" in lines[0], lines[0]
        assert VICTIM in lines[0] and lines[0].count("decoder.") == 1, lines[0]


def test_interval_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        parse_args(list(BASE) + ["--check-weight-hash-across-dp-replicas-interval", "0"], world_size=1)
    assert "--check-weight-hash-across-dp-replicas-interval 0 must be >= 1" in capsys.readouterr().err
