"""Megatron's re-run state machine (megalite/rerun.py): --rerun-mode validate_results with
--error-injection-rate/-type, and report_stats, through pretrain() on the parity harness's tiny
GPT with dropout on (so a re-run that does not restore the RNG states or replay the micro-batches
changes the losses). Multi-rank checks (PP2: only the last stage validates; DP2 with ZeRO and
overlapped reductions; DP2 with top-k gradient compression) share one spawn of two ranks."""

import contextlib
import io
import os
import re

import pytest
import torch

import pretrain_gpt
from dist_util import run_on_ranks
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.rerun import ErrorInjector
from megalite.training import pretrain
from parity import BASE, STEPS, learnable_datasets

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
VALIDATE = ["--rerun-mode", "validate_results"]
# Megatron's only non-fatal validation: a re-run that does not reproduce it lets training go on
SPIKY_TRANSIENT = ["--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss", *VALIDATE,
                   "--error-injection-type", "transient_error"]


def _train(argv):
    """(losses, None) or (None, exit code)."""
    args = parse_args(list(BASE) + DROPOUT + list(argv), world_size=max(1, ps.world_size()))
    try:
        return pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args), None
    except SystemExit as e:
        return None, e.code
    finally:
        ps.destroy_model_parallel()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def clean():
    losses, code = _train([])
    assert code is None and len(losses) == STEPS
    return losses


def test_transient_error_on_a_non_fatal_validation_is_re_run_and_training_goes_on(clean, capsys):
    """Rate 1: every iteration after the first injects, re-runs and goes on; the losses are the clean run's
    bit for bit (the re-run used the same micro-batches and dropout masks, and the next iteration the next data)."""
    losses, code = _train(SPIKY_TRANSIENT + ["--error-injection-rate", "1"])
    out = capsys.readouterr().out
    assert code is None and losses == clean
    assert "Result validation enabled" in out
    assert out.count("Injecting error type Transient error") == STEPS - 1  # not at the first iteration
    assert out.count("Possible transient error!!") == STEPS - 1
    assert out.count("Continuing normal execution because failed validation was not fatal") == STEPS - 1


def test_transient_error_on_the_nan_check_exits_17(capsys):
    """A fatal validation that the re-run does not reproduce: Megatron exits 17 all the same."""
    losses, code = _train(VALIDATE + ["--error-injection-rate", "1", "--error-injection-type", "transient_error"])
    out = capsys.readouterr().out
    assert code == 17 and losses is None
    assert "iteration #2 invocation #1 (message='found NaN in local forward loss calculation')" in out
    assert "Possible transient error!!" in out
    assert "Exiting now. The job can be resumed from a previous checkpoint" in out
    # the injected fault compares as different, but the re-run itself recomputed the loss exactly
    first, again = re.search(r"tolerance \((\S+) != (\S+)\)", out).groups()
    assert first == again


def test_persistent_error_saves_the_state_before_the_iteration_and_exits_16(clean, tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    losses, code = _train(VALIDATE + ["--error-injection-rate", "1", "--error-injection-type", "persistent_error",
                                      "--save", ckpt])
    out = capsys.readouterr().out
    assert code == 16 and losses is None
    assert "Injecting error type Persistent error" in out
    assert "First rerun: unexpected result is reproducible within the tolerance" in out
    assert "Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the last " \
           "iteration and establish a diagnostic" in out
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "1"  # iteration 2 failed: the state after iteration 1
    # resuming runs iteration 2 again from the same state (RNG included): the clean run's losses
    resumed, code = _train(["--load", ckpt])
    assert code is None and resumed == clean[1:]


def test_correct_result_without_save_exits_16_with_nothing_saved(capsys):
    losses, code = _train(VALIDATE + ["--error-injection-rate", "1", "--error-injection-type", "correct_result"])
    out = capsys.readouterr().out
    assert code == 16 and "Injecting error type Expected result" in out
    assert "reproducible within the tolerance" in out and "(no --save: nothing saved)" in out


def test_injection_rate_is_one_in_n_validations_and_deterministic(capsys):
    def draws(seed, rank, n=20000, rate=50):
        inj, hits = ErrorInjector(rate, "persistent_error", seed), []
        for i in range(n):
            if inj.maybe_inject(i // 100, rank, 0):
                hits.append(i)
                inj.injected = None
        return hits
    a = draws(1234, 0)
    assert 300 <= len(a) <= 500  # 20000 / 50 = 400 expected
    assert draws(1234, 0) == a and draws(1234, 1) != a and draws(7, 0) != a
    capsys.readouterr()
    # in training: 2 validations (NaN, Inf) per micro-batch, 8 micro-batches, from iteration 2 on
    rate, it = 35, None
    inj = ErrorInjector(rate, "persistent_error", 1234)
    for i in range(2, STEPS + 1):
        if any(inj.maybe_inject(i, 0, 0) for _ in range(16)):
            it = i
            break
    assert it is not None and it > 2, "pick a rate whose first injection falls inside the run"
    capsys.readouterr()
    losses, code = _train(VALIDATE + ["--error-injection-rate", str(rate), "--error-injection-type",
                                      "persistent_error"])
    out = capsys.readouterr().out
    assert code == 16 and out.count("Injecting error type") == 1 and f"at iteration #{it} invocation" in out


def test_report_stats_runs_every_iteration_twice_and_finds_them_identical(clean, capsys):
    losses, code = _train(["--rerun-mode", "report_stats"])
    out = capsys.readouterr().out
    assert code is None and losses == clean
    assert "Stats on computation determinism in validation calls" in out
    assert f"{8 * STEPS} samples, all identical" in out  # 8 micro-batches per iteration, reported at the last


def test_default_is_disabled_and_a_plain_step_does_not_validate():
    args = parse_args(list(BASE), world_size=1)
    assert (args.rerun_mode, args.error_injection_rate, args.error_injection_type) == \
        ("disabled", 0, "transient_error")


# -- two ranks, one spawn ---------------------------------------------------------------------
PP2 = ["--pipeline-model-parallel-size", "2"]
DP2_ZERO = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
DP2_TOPK = ["--grad-compression", "topk", "--grad-compression-ratio", "0.3"]  # its error feedback is restored


def _ranks(runs, ckpt):
    """Per run: (losses, exit code, this rank's count of "Possible transient error")."""
    out = []
    for argv in runs:
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            losses, code = _train([a.replace("CKPT", ckpt) for a in argv])
        out.append((losses, code, log.getvalue().count("Possible transient error!!")))
    return out


def test_two_ranks_agree(tmp_path):
    """Under PP2 only the last stage validates (and injects), so the first stage re-runs on the world's
    decision alone; under DP2 at rate 2 the ranks' draws differ ((draw + rank) % rate). Every rank re-runs
    (replaying its micro-batches, restoring its RNG), then goes on or exits alike."""
    runs = [PP2, PP2 + SPIKY_TRANSIENT + ["--error-injection-rate", "2"],
            DP2_ZERO, DP2_ZERO + SPIKY_TRANSIENT + ["--error-injection-rate", "2"],
            DP2_TOPK, DP2_TOPK + SPIKY_TRANSIENT + ["--error-injection-rate", "2"],
            PP2 + VALIDATE + ["--error-injection-rate", "2", "--error-injection-type", "persistent_error",
                              "--save", "CKPT"]]
    ranks = run_on_ranks(_ranks, 2, runs, str(tmp_path / "ckpt"), timeout=300)
    for rank, (pp_clean, pp_rerun, dp_clean, dp_rerun, topk_clean, topk_rerun, persistent) in enumerate(ranks):
        assert pp_clean[1] is None and pp_rerun[:2] == pp_clean[:2], rank
        assert dp_clean[1] is None and dp_rerun[:2] == dp_clean[:2], rank
        assert topk_clean[1] is None and topk_rerun[:2] == topk_clean[:2], rank
        assert persistent[:2] == (None, 16), rank
    assert [r[1][2] for r in ranks] == [0, STEPS - 1]  # PP2: the last stage found them, the first re-ran too
    # DP2: each rank draws at each of its validations until it injects (Megatron's rule); at the first
    # draw exactly one does, the other may later in the iteration
    assert STEPS - 1 <= sum(r[3][2] for r in ranks) <= 2 * (STEPS - 1), [r[3][2] for r in ranks]
    with open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt") as f:
        assert f.read().strip() == "1"
