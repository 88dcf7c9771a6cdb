"""The LR schedule's rules outside megatron-core's arithmetic (tests/test_lr_schedule_megatron.py holds that): what
a checkpoint's schedule must agree with, or gives, on load (Megatron's --use-checkpoint-opt_param-scheduler /
--override-opt_param-scheduler), and the schedule flags' one-line errors."""

import json

import pytest

from megalite.cli.parser import parse_args
from megalite.config import ConfigError
from megalite.optimizer.lr_scheduler import LRScheduler

MODEL = "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --lr 1e-3 --num-workers 0 "


class _Opt:
    def __init__(self):
        self.param_groups = [{"lr": None, "weight_decay": 0.01, "decay": True}]


def test_checkpoint_schedule_rules():
    """Megatron's load rules: equal values load; a differing one is an error naming it and both
    flags; --use-checkpoint-opt_param-scheduler takes the checkpoint's, --override-... the flags'."""
    saved = LRScheduler(_Opt(), 1e-3, 1e-5, 40, 400, "cosine")
    saved.step(96)
    sd = json.loads(json.dumps(saved.state_dict()))  # as the checkpoint's JSON holds it
    same = LRScheduler(_Opt(), 1e-3, 1e-5, 40, 400, "cosine")
    same.load_state_dict(sd)
    assert same.num_steps == 96 and same.optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"]
    with pytest.raises(ConfigError) as e:
        LRScheduler(_Opt(), 2e-3, 1e-5, 40, 400, "cosine").load_state_dict(sd)
    msg = str(e.value)
    assert "max_lr=0.001" in msg and "0.002" in msg and "--lr" in msg and "\n" not in msg
    assert "--use-checkpoint-opt_param-scheduler" in msg and "--override-opt_param-scheduler" in msg
    with pytest.raises(ConfigError, match="lr_decay_steps=400"):
        LRScheduler(_Opt(), 1e-3, 1e-5, 40, 800, "cosine").load_state_dict(sd)
    with pytest.raises(ConfigError, match="lr_decay_style=cosine"):
        LRScheduler(_Opt(), 1e-3, 1e-5, 40, 400, "linear").load_state_dict(sd)
    use = LRScheduler(_Opt(), 2e-3, 0.0, 0, 800, "linear", use_checkpoint=True)
    use.load_state_dict(sd)
    assert (use.max_lr, use.min_lr, use.warmup, use.decay, use.style) == (1e-3, 1e-5, 40, 400, "cosine")
    assert use.optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"]
    over = LRScheduler(_Opt(), 2e-3, 0.0, 0, 800, "linear", override=True)
    over.load_state_dict(sd)
    assert (over.max_lr, over.decay, over.style, over.num_steps) == (2e-3, 800, "linear", 96)
    assert over.optimizer.param_groups[0]["lr"] == over.get_lr(96)
    # WSD's annealing length and style are the schedule's too
    wsd = LRScheduler(_Opt(), 1e-3, 1e-5, 40, 400, "WSD", wsd=(100, "cosine"))
    wsd.step(320)
    wsd_sd = json.loads(json.dumps(wsd.state_dict()))
    with pytest.raises(ConfigError, match="wsd_decay_steps=100"):
        LRScheduler(_Opt(), 1e-3, 1e-5, 40, 400, "WSD", wsd=(50, "cosine")).load_state_dict(wsd_sd)
    with pytest.raises(ConfigError, match="has --lr-wsd-decay-iters/--lr-wsd-decay-samples but this run's flags"):
        LRScheduler(_Opt(), 1e-3, 1e-5, 40, 400, "cosine", override=False).load_state_dict(
            {k: v for k, v in wsd_sd.items() if k != "lr_decay_style"} | {"lr_decay_style": "cosine"})
    for flags in (("cosine", (None, None)), ("WSD", (60, "linear"))):  # --use-checkpoint-opt_param-scheduler
        taken = LRScheduler(_Opt(), 1e-3, 1e-5, 40, 400, flags[0], use_checkpoint=True, wsd=flags[1])
        taken.load_state_dict(wsd_sd)
        assert taken.optimizer.param_groups[0]["lr"] == wsd.optimizer.param_groups[0]["lr"] < 1e-3, flags
    megatrons = {k: v for k, v in wsd_sd.items() if k not in ("wsd_decay_steps", "lr_wsd_decay_style")}
    flagged = LRScheduler(_Opt(), 1e-3, 1e-5, 40, 400, "WSD", wsd=(100, "cosine"))  # (Megatron records neither)
    flagged.load_state_dict(megatrons)
    assert flagged.optimizer.param_groups[0]["lr"] == wsd.optimizer.param_groups[0]["lr"]
    with pytest.raises(ConfigError, match="records no annealing length"):
        LRScheduler(_Opt(), 1e-3, 1e-5, 40, 400, "cosine", use_checkpoint=True).load_state_dict(megatrons)
    # A checkpoint from before the schedule was saved: {"num_steps": iterations}.
    old = LRScheduler(_Opt(), 1e-3, 1e-5, 40, 400, "cosine", legacy_step=8)
    old.load_state_dict({"num_steps": 12})
    assert old.num_steps == 96 and old.optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("flags, says", [
    ("--start-weight-decay 0.1", "--start-weight-decay is for --weight-decay-incr-style linear or cosine"),
    ("--weight-decay-incr-style cosine --end-weight-decay 0.1", "--weight-decay-incr-style cosine goes from "
                                                               "--start-weight-decay to --end-weight-decay: give both"),
    ("--weight-decay-incr-style linear --start-weight-decay 0.1 --end-weight-decay 0.01",
     "--weight-decay-incr-style linear increases the weight decay: 0 <= --start-weight-decay 0.1 <= "
     "--end-weight-decay 0.01 does not hold"),
    ("--lr-decay-style WSD", "--lr-decay-style WSD with --train-iters anneals over its last --lr-wsd-decay-iters"),
    ("--lr-wsd-decay-iters 5", "--lr-wsd-decay-iters is --lr-decay-style WSD's annealing length"),
    ("--lr-decay-style WSD --lr-wsd-decay-samples 40", "--lr-wsd-decay-samples is not read with --train-iters (as "
                                                       "Megatron): give --lr-wsd-decay-iters instead")])
def test_wsd_errors_are_one_line(flags, says, capsys):
    with pytest.raises(SystemExit):
        parse_args((MODEL + "--mock-data --micro-batch-size 2 --global-batch-size 8 --train-iters 20 " + flags).split(),
                   world_size=1)
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
