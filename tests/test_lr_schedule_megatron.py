"""Megatron's LR schedule and batch ramp-up, against megatron-core's own code: its
OptimizerParamScheduler (stepped as Megatron's train_step steps it: by the iteration's
samples, only when the update went through) and its RampupBatchsizeNumMicroBatchesCalculator.
Then short in-process runs: a skipped fp16 iteration leaves the LR and the logged loss alone;
a ramp-up run's consumed samples, batch sizes and dataset sizes (the checkpoint's schedule rules:
test_lr_schedule_rules.py)."""

import argparse
import json
import math
import re

import pytest

import pretrain_gpt
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args, training_config
from megalite.config import ConfigError
from megalite.batching.iteration_plan import batch_schedule
from megalite.config.batching import BatchingConfig
from megalite.batching.microbatches import BatchSchedule, parse_step_schedule
from megalite.optimizer.lr_scheduler import LRScheduler
from megalite.training import pretrain
from megalite.training.setup import build_scheduler

ops = pytest.importorskip("megatron.core.optimizer_param_scheduler",
                          reason="megatron-core not installed (it is in the test extra: pip install -e \".[test]\")")
nmc = pytest.importorskip("megatron.core.num_microbatches_calculator", reason="megatron-core not installed")

MODEL = "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --lr 1e-3 --num-workers 0 "


class _Opt:
    def __init__(self):
        self.param_groups = [{"lr": None, "weight_decay": 0.01, "decay": True}]


def _megatron_scheduler(a):
    """megatron/training/training.py get_optimizer_param_scheduler's arithmetic, on megatron-core's class."""
    if a.train_samples is None:
        decay = (a.lr_decay_iters if a.lr_decay_iters is not None else a.train_iters) * a.global_batch_size
        warmup = a.lr_warmup_fraction * decay if a.lr_warmup_fraction is not None else \
            a.lr_warmup_iters * a.global_batch_size
    else:
        decay = a.lr_decay_samples if a.lr_decay_samples is not None else a.train_samples
        warmup = a.lr_warmup_fraction * decay if a.lr_warmup_fraction is not None else a.lr_warmup_samples
    wsd = a.lr_wsd_decay_samples if a.train_samples is not None else \
        a.lr_wsd_decay_iters * a.global_batch_size if a.lr_wsd_decay_iters is not None else None
    return ops.OptimizerParamScheduler(_Opt(), init_lr=a.lr_warmup_init, max_lr=a.lr, min_lr=a.min_lr,
                                       lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=a.lr_decay_style,
                                       start_wd=a.start_weight_decay, end_wd=a.end_weight_decay,
                                       wd_incr_steps=a.train_samples or a.train_iters * a.global_batch_size,
                                       wd_incr_style=a.weight_decay_incr_style,
                                       wsd_decay_steps=wsd, lr_wsd_decay_style=a.lr_wsd_decay_style)


def _megatron_calculator(a):
    if a.rampup_batch_size is None:
        return nmc.ConstantNumMicroBatchesCalculator(a.global_batch_size, a.micro_batch_size, a.data_parallel_size,
                                                     False, 1)
    return nmc.RampupBatchsizeNumMicroBatchesCalculator(a.global_batch_size, a.micro_batch_size, a.data_parallel_size,
                                                        False, 1, *a.rampup_batch_size)


SCHEDULES = {
    "iters_cosine_fraction_init": "--train-iters 120 --lr-decay-iters 100 --lr-decay-style cosine --min-lr 1e-5 "
                                  "--lr-warmup-fraction 0.07 --lr-warmup-init 1e-4 --global-batch-size 24",
    "iters_linear_warmup": "--train-iters 60 --lr-warmup-iters 7 --min-lr 2e-5 --global-batch-size 8",
    "iters_inverse_sqrt_init": "--train-iters 80 --lr-decay-style inverse-square-root --lr-warmup-iters 9 "
                               "--lr-warmup-init 3e-4 --min-lr 1e-4 --global-batch-size 16",
    "iters_constant_warmup": "--train-iters 30 --lr-decay-style constant --lr-warmup-iters 5 --global-batch-size 8",
    "iters_rampup_cosine": "--train-iters 70 --rampup-batch-size 8 8 400 --global-batch-size 40 "
                           "--lr-decay-style cosine --lr-warmup-iters 3 --min-lr 1e-5",
    "samples_rampup_cosine": "--train-samples 3001 --rampup-batch-size 8 16 1000 --global-batch-size 72 "
                             "--lr-decay-samples 2500 --lr-warmup-samples 300 --lr-decay-style cosine --min-lr 1e-6 "
                             "--lr-warmup-init 5e-5",
    "samples_fraction_linear": "--train-samples 1000 --lr-warmup-fraction 0.1 --global-batch-size 24 --min-lr 1e-5",
    "samples_inverse_sqrt": "--train-samples 777 --lr-decay-style inverse-square-root --lr-warmup-samples 64 "
                            "--global-batch-size 16",
    # WSD: held, then annealed over the last iterations/samples of the decay, each of Megatron's four anneals
    **{f"iters_wsd_{style}": f"--train-iters 60 --lr-decay-style WSD --lr-wsd-decay-style {style} "
                             f"--lr-wsd-decay-iters 17 --lr-warmup-iters 5 --min-lr 1e-5 --global-batch-size 8"
       for style in ("exponential", "linear", "cosine", "minus_sqrt")},
    "iters_wsd_decay_iters": "--train-iters 70 --lr-decay-iters 50 --lr-decay-style WSD --lr-wsd-decay-iters 20 "
                             "--min-lr 1e-5 --global-batch-size 8",  # (then --min-lr from 50 to 70)
    # the weight decay's increment (Megatron's --start/--end-weight-decay, --weight-decay-incr-style)
    "iters_wd_linear": "--train-iters 40 --lr-decay-style cosine --start-weight-decay 0.01 --end-weight-decay 0.1 "
                       "--weight-decay-incr-style linear --global-batch-size 8",
    "samples_wd_cosine_rampup": "--train-samples 2001 --rampup-batch-size 8 8 600 --global-batch-size 40 "
                                "--start-weight-decay 0.02 --end-weight-decay 0.1 --weight-decay-incr-style cosine",
    "samples_wsd_rampup": "--train-samples 3001 --rampup-batch-size 8 16 1000 --global-batch-size 72 --lr-decay-style "
                          "WSD --lr-wsd-decay-samples 900 --lr-wsd-decay-style cosine --lr-warmup-samples 300",
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_lr_and_batch_sizes_equal_megatron_core(name):
    """Every iteration: the same batch size as megatron-core's calculator and the same LR as its
    scheduler (exact floats), both driven as Megatron's training loop drives them."""
    a = parse_args((MODEL + "--mock-data --micro-batch-size 2 " + SCHEDULES[name]).split(), world_size=4)
    ours, batches = build_scheduler(_Opt(), training_config(a)), batch_schedule(BatchingConfig.of(a))
    ref, calc = _megatron_scheduler(a), _megatron_calculator(a)
    assert ours.optimizer.param_groups[0]["lr"] == ref.optimizer.param_groups[0]["lr"]  # before any step
    consumed, sizes = 0, []
    for it in range(1, a.train_iters + 1):
        calc.update(consumed, True)
        batch = calc.get() * a.micro_batch_size * a.data_parallel_size
        assert batches.global_batch_size(consumed) == batch == calc.get_current_global_batch_size(), (name, it)
        assert batches.num_microbatches(consumed) == calc.get(), (name, it)
        ours.step(batch)
        ref.step(increment=batch)
        assert ours.optimizer.param_groups[0]["lr"] == ref.optimizer.param_groups[0]["lr"], (name, it, consumed)
        assert ours.optimizer.param_groups[0]["weight_decay"] == ref.optimizer.param_groups[0]["weight_decay"], \
            (name, it, consumed)
        consumed += batch
        sizes.append(batch)
    if a.rampup_batch_size is not None:
        assert sizes[0] == a.rampup_batch_size[0] and sizes[-1] == a.global_batch_size and len(set(sizes)) > 3
    if a.train_samples is not None and a.rampup_batch_size is not None:  # until consumed reaches --train-samples
        assert consumed - sizes[-1] < a.train_samples <= consumed
    elif a.train_samples is not None:  # Megatron's constant-batch rule: the partial last batch is dropped
        assert a.train_iters == a.train_samples // a.global_batch_size < a.train_samples / a.global_batch_size


def test_rampup_equals_megatron_core_at_slice_boundaries():
    """The 175B script's ramp (16 -> 1536 by 16 over 5,859,375 samples: 95 slices of 61677.6
    samples): every boundary and its neighbours, where the float slice length decides."""
    calc = nmc.RampupBatchsizeNumMicroBatchesCalculator(1536, 1, 16, False, 1, 16, 16, 5859375)
    ours = BatchSchedule(1536, 1, 16, rampup=[16, 16, 5859375])
    per = 5859375 / 95
    points = {c for k in range(97) for c in (math.floor(k * per) + d for d in (-1, 0, 1, 2)) if c >= 0}
    points |= set(range(0, 6_000_000, 9973))
    for c in sorted(points):
        calc.update(c, False)
        assert ours.global_batch_size(c) == calc.get_current_global_batch_size(), c
        assert ours.num_microbatches(c) == calc.get(), c
    # 14 slices of 18/14 samples: at 9 and 18 consumed the float quotient falls just short of
    # 7 and 14 (Megatron's batch there: 14 and 28, not 16 and 30).
    calc = nmc.RampupBatchsizeNumMicroBatchesCalculator(30, 1, 1, False, 1, 2, 2, 18)
    ours = BatchSchedule(30, 1, 1, rampup=[2, 2, 18])
    for c in range(40):
        calc.update(c, False)
        assert ours.global_batch_size(c) == calc.get_current_global_batch_size(), c
    assert (ours.global_batch_size(9), ours.global_batch_size(18)) == (14, 28)


BATCH_ERRORS = {
    "--rampup-batch-size 8 5 100 --global-batch-size 32": "minus the start batch 8 = 24 is not divisible by the "
                                                          "increment 5",
    "--rampup-batch-size 8 4 100 --global-batch-size 32": "global batch 12 is not divisible by --micro-batch-size 2 x "
                                                          "data-parallel size 4 = 8",
    "--rampup-batch-size 64 8 100 --global-batch-size 32": "the start batch 64 exceeds --global-batch-size 32",
    "--rampup-batch-size 4 4 100 --global-batch-size 32 --pipeline-model-parallel-size 2 --num-layers 4 "
    "--num-layers-per-virtual-pipeline-stage 1": "global batch 4: interleaved pipelining needs the number of "
                                                 "micro-batches (1) to be a multiple of "
                                                 "--pipeline-model-parallel-size 2",
    "--train-samples 10 --global-batch-size 16": "--train-samples 10 is less than one global batch (16)",
}


@pytest.mark.parametrize("flags", list(BATCH_ERRORS))
def test_batch_schedule_errors_are_one_line(flags, capsys):
    argv = (MODEL + "--mock-data --micro-batch-size 2 " + flags).split()
    if "--train-samples" not in flags:
        argv += ["--train-iters", "5"]
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=4)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and BATCH_ERRORS[flags] in err[0], err


def test_step_batch_size_schedule(capsys):
    """Megatron's --step-batch-size-schedule: token thresholds with suffixes, // --seq-length."""
    steps = parse_step_schedule("0:16 2.4K:32, 4.8K:64", seq_length=16)
    assert steps == [(0, 16), (150, 32), (300, 64)]
    s = BatchSchedule(64, 2, 2, steps=steps)
    assert [s.global_batch_size(c) for c in (0, 149, 150, 299, 300, 10 ** 6)] == [16, 16, 32, 32, 64, 64]
    assert s.iterations_for(400) == 10 + 5 + 2  # 160 samples at 16, 160 at 32, then 64s past 400
    with pytest.raises(ConfigError, match="the first threshold must be 0"):
        parse_step_schedule("1K:16 2K:32", 16)
    with pytest.raises(ConfigError, match="not THRESHOLD:BATCH_SIZE"):
        parse_step_schedule("0:16 2K", 16)
    a = parse_args((MODEL + "--mock-data --micro-batch-size 2 --train-iters 5 --step-batch-size-schedule").split()
                   + ["0:8 1K:32"], world_size=2)
    # (set by validation, once)
    assert batch_schedule(BatchingConfig.of(a)).steps == [(0, 8), (62, 32)] and a.global_batch_size == 32
    b = argparse.Namespace(**{**vars(a), "global_batch_size": 4})  # as before validation: the default, mbs x DP
    # the schedule only reads the arguments
    assert batch_schedule(BatchingConfig.of(b)).final == 32 and b.global_batch_size == 4
    with pytest.raises(SystemExit):  # checked with the command line, before any process group
        parse_args((MODEL + "--mock-data --micro-batch-size 2 --train-iters 5 --global-batch-size 16 "
                    "--step-batch-size-schedule 0:8,1K:32").split(), world_size=2)
    assert "--global-batch-size 16 differs from the last batch size 32" in capsys.readouterr().err


# -- short in-process runs ---------------------------------------------------------------
TINY = (MODEL + "--mock-data --vocab-size 64 --micro-batch-size 2 --global-batch-size 4 --eval-iters 0").split()
_LINE = re.compile(r"iteration +(\d+)/ *\d+ \| consumed samples: +(\d+) \|.*\| global batch size: +(\d+) \|"
                   r"(?: lm loss: ([0-9.E+-]+) \|)? loss scale.*skipped iterations: +(\d+) \|")


def _run(argv, tmp_path, capsys, provider=pretrain_gpt.datasets_provider):
    """(losses, [log json records], [(iteration, consumed, batch, lm loss or None, skipped)])."""
    log = tmp_path / f"log{len(list(tmp_path.iterdir()))}.json"
    args = parse_args(argv + ["--log-json", str(log)], world_size=1)
    try:
        losses = pretrain(provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
    finally:
        ps.destroy_model_parallel()
    out = capsys.readouterr().out
    lines = [(int(m[1]), int(m[2]), int(m[3]), float(m[4]) if m[4] else None, int(m[5]))
             for m in _LINE.finditer(out)]
    records = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return losses, [r for r in records if "learning-rate" in r], lines, out


def test_skipped_fp16_iterations_leave_lr_and_logged_loss_alone(tmp_path, capsys):
    """fp16 with a loss scale that overflows: the first iterations are skipped. The LR advances
    only on iterations whose update went through, and a window's logged lm loss averages only
    those (a window of skipped iterations shows none), as Megatron's train_step / training_log."""
    fp16 = TINY + "--train-iters 8 --fp16 --hysteresis 1 --initial-loss-scale 2e6 --lr-warmup-iters 3".split()
    losses, records, lines, _ = _run(fp16 + ["--log-interval", "1"], tmp_path, capsys)
    skipped = [n for _, _, _, _, n in lines]
    assert len(lines) == 8 and 2 <= sum(skipped) <= 4 and skipped[:sum(skipped)] == [1] * sum(skipped), lines
    ref = LRScheduler(_Opt(), 1e-3, 0.0, 3 * 4, 8 * 4, "linear")
    done = 0
    for (it, consumed, batch, loss, skip), rec in zip(lines, records):
        done += 1 - skip
        assert rec["learning-rate"] == ref.get_lr(done * 4), (it, rec, done)
        assert (consumed, batch) == (4 * it, 4)
        assert (loss is None) == bool(skip) and ("lm loss" in rec) != bool(skip), (it, loss, rec)
        if not skip:
            assert rec["lm loss"] == pytest.approx(losses[it - 1], rel=1e-6)
    # Windows of two: the mean over each window's updated iterations only.
    again, records2, lines2, _ = _run(fp16 + ["--log-interval", "2"], tmp_path, capsys)
    assert again == losses and [it for it, *_ in lines2] == [2, 4, 6, 8]
    kinds = set()
    for (it, _, _, loss, skip), rec in zip(lines2, records2):
        kept = [losses[i] for i in (it - 2, it - 1) if not skipped[i]]
        assert skip == 2 - len(kept)
        kinds.add(len(kept))
        if kept:
            assert rec["lm loss"] == pytest.approx(sum(kept) / len(kept), rel=1e-6), (it, rec, kept)
            assert loss == pytest.approx(rec["lm loss"], rel=1e-6)
        else:
            assert loss is None and "lm loss" not in rec
    assert kinds == {0, 1, 2}  # windows all skipped, mixed, and clean


def test_step_schedule_run(tmp_path, capsys):
    """A run with --step-batch-size-schedule: 2 samples per iteration until 256 tokens (16
    samples of 16 tokens) are consumed, then 4."""
    argv = (MODEL + "--mock-data --vocab-size 64 --micro-batch-size 2 --eval-iters 0 --train-iters 10 "
            "--log-interval 1 --step-batch-size-schedule").split() + ["0:2 256:4"]
    losses, records, lines, _ = _run(argv, tmp_path, capsys)
    assert [(c, b) for _, c, b, _, _ in lines] == [(2 * i, 2) for i in range(1, 9)] + [(20, 4), (24, 4)]
    assert len(losses) == 10


def test_rampup_run_consumed_samples_and_batch_sizes(tmp_path, capsys):
    """--train-samples with --rampup-batch-size on one rank: each log line's consumed samples
    (cumulative) and global batch size follow megatron-core's calculator; the datasets are sized
    for the samples read (a final validation and test run without --eval-interval); the saved
    schedule then guards the resume (mismatch error; --use-checkpoint-opt_param-scheduler)."""
    sizes = []

    def provider(args, num_samples):
        sizes.append(tuple(num_samples))
        return pretrain_gpt.datasets_provider(args, num_samples)
    ramp = (MODEL + "--mock-data --vocab-size 64 --micro-batch-size 2 --global-batch-size 8 --rampup-batch-size 2 2 12 "
            "--train-samples 41 --lr-decay-samples 60 --log-interval 1 --eval-iters 1 --lr-decay-style cosine").split()
    save = ["--save", str(tmp_path / "ckpt")]
    losses, records, lines, out = _run(ramp + save, tmp_path, capsys, provider)
    calc = nmc.RampupBatchsizeNumMicroBatchesCalculator(8, 2, 1, False, 1, 2, 2, 12)
    consumed, want = 0, []
    while consumed < 41:
        calc.update(consumed, True)
        consumed += calc.get_current_global_batch_size()
        want.append((consumed, calc.get_current_global_batch_size()))
    assert [(c, b) for _, c, b, _, _ in lines] == want and len(losses) == len(want)
    assert [b for _, b in want][:6] == [2, 2, 4, 6, 8, 8]  # slices of 4 samples: 2, 4, 6, then 8
    assert [r["batch-size"] for r in records] == [b for _, b in want]
    assert sizes == [(max(41, want[-1][0]), 8, 8)]  # one (final) validation of one batch; the test set
    assert "validation loss at iteration" not in out
    assert "validation loss at the end of training for val data" in out and "for test data" in out
    # Resume with another --lr: Megatron's schedule check, one line on the rank.
    with pytest.raises(SystemExit):
        _run([x if x != "1e-3" else "2e-3" for x in ramp] + ["--load", save[1]], tmp_path, capsys)
    err = capsys.readouterr().err
    assert "max_lr=0.001" in err and "--use-checkpoint-opt_param-scheduler" in err, err
    # --use-checkpoint-opt_param-scheduler: the checkpoint's schedule and position, whatever --lr says.
    args = parse_args([x if x != "1e-3" else "2e-3" for x in ramp] + ["--load", save[1], "--eval-iters", "0",
                                                                        "--use-checkpoint-opt_param-scheduler"], 1)
    try:
        resumed, _, optimizer = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                                         pretrain_gpt.forward_step, args, return_state=True)
    finally:
        ps.destroy_model_parallel()
    assert resumed == [] and optimizer.param_groups[0]["lr"] == records[-1]["learning-rate"] > 0


def test_manual_gc(tmp_path, capsys):
    """--manual-gc: no automatic collection during the run; a full one at the start and every
    --manual-gc-interval iterations; around each evaluation; the collector is back on after."""
    import gc
    seen = []

    def record(phase, info):
        if phase == "start" and not gc.isenabled():  # collections while the collector is off: the run's own
            seen.append(info["generation"])
    gc.callbacks.append(record)
    try:
        _run(TINY[:-2] + "--train-iters 4 --log-interval 4 --manual-gc --manual-gc-interval 2 --eval-iters 1 "
             "--eval-interval 3".split(), tmp_path, capsys)
    finally:
        gc.callbacks.remove(record)
    assert gc.isenabled()
    # start, it 2, eval at 3 (full before, young after), it 4, final validation and test (each full + young)
    assert seen == [2, 2, 2, 0, 2, 2, 0, 2, 0], seen


@pytest.mark.parametrize("flags", ["--decoupled-lr 4e-3 --decoupled-min-lr 3e-4", "--decoupled-lr 2e-4"])
def test_decoupled_lr_equals_megatron_core(flags):
    """--decoupled-lr / --decoupled-min-lr: the decoupled param groups follow megatron-core's
    scheduler with its param-group override (max_lr, min_lr; min_lr defaults to --min-lr); the
    others and the logged LR the main schedule. Exact floats, every iteration."""
    a = parse_args((MODEL + "--mock-data --micro-batch-size 2 --train-iters 50 --global-batch-size 8 "
                    "--lr-warmup-iters 5 --lr-decay-style cosine --min-lr 1e-5 " + flags).split(), world_size=4)
    groups = [{"lr": None, "decoupled": False}, {"lr": None, "decoupled": True}]
    ours = build_scheduler(type("O", (), {"param_groups": groups})(), training_config(a))
    ref = _megatron_scheduler(a)
    override = {"max_lr": a.decoupled_lr, **({"min_lr": a.decoupled_min_lr} if a.decoupled_min_lr is not None else {})}
    ref.optimizer.param_groups = [{"lr": None}, {"lr": None, **override}]
    ref.step(0)
    for it in range(a.train_iters + 1):
        assert [g["lr"] for g in groups] == [g["lr"] for g in ref.optimizer.param_groups], it
        assert ours.lr == groups[0]["lr"] and (it in (0, a.train_iters) or groups[0]["lr"] != groups[1]["lr"])
        ours.step(8)
        ref.step(increment=8)
    sd = json.loads(json.dumps(ours.state_dict()))
    with pytest.raises(ConfigError, match="--decoupled-lr"):  # a checkpoint with it, a run without
        LRScheduler(_Opt(), 1e-3, 1e-5, 40, 400, "cosine").load_state_dict(sd)


def test_decoupled_min_lr_alone_is_an_error(capsys):
    with pytest.raises(SystemExit):
        parse_args((MODEL + "--mock-data --micro-batch-size 2 --train-iters 5 --decoupled-min-lr 1e-5").split())
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "--decoupled-min-lr 1e-05 needs --decoupled-lr" in err[0], err
