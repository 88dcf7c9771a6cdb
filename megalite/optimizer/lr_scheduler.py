"""Learning rate: Megatron's OptimizerParamScheduler maths.

Linear warmup from --lr-warmup-init to --lr over the warmup steps, then constant / linear /
cosine / inverse-square-root decay to --min-lr at the decay steps (--min-lr after them).
The LR is a function of the completed steps n; the log line shows it after the step.

A step is a sample, as in Megatron's training loop: each successful iteration advances the
schedule by its global batch size, a skipped fp16 iteration not at all (schedule_steps
turns iteration counts into samples with --global-batch-size).
"""

import math

from megalite.config import ConfigError

STYLES = ("constant", "linear", "cosine", "inverse-square-root")


def schedule_steps(tcfg):
    """(warmup steps, decay steps) in samples, as Megatron's get_optimizer_param_scheduler."""
    if tcfg.train_samples is not None:
        decay = tcfg.lr_decay_samples if tcfg.lr_decay_samples is not None else tcfg.train_samples
        warmup = tcfg.lr_warmup_fraction * decay if tcfg.lr_warmup_fraction is not None else tcfg.lr_warmup_samples
        return warmup, decay
    g = tcfg.global_batch_size
    decay = (tcfg.lr_decay_iters if tcfg.lr_decay_iters is not None else tcfg.train_iters) * g
    warmup = tcfg.lr_warmup_fraction * decay if tcfg.lr_warmup_fraction is not None else tcfg.lr_warmup_iters * g
    return warmup, decay


# Checkpoint key -> (the flags that set it, Megatron's name in its assertion).
_CHECKED = {"max_lr": "--lr", "min_lr": "--min-lr",
            "lr_warmup_steps": "--lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction",
            "lr_decay_steps": "--lr-decay-iters/--lr-decay-samples (default --train-iters/--train-samples)",
            "lr_decay_style": "--lr-decay-style"}


class LRScheduler:
    def __init__(self, optimizer, max_lr, min_lr, warmup_iters, decay_iters, decay_style, init_lr=0.0,
                 use_checkpoint=False, override=False, legacy_step=1):
        """warmup_iters / decay_iters: in steps (samples when training). legacy_step: steps per
        iteration of a checkpoint from before the schedule counted samples ({"num_steps"} only)."""
        if decay_style not in STYLES:
            raise ConfigError(f"--lr-decay-style {decay_style!r} is not one of {', '.join(STYLES)}")
        if not 0.0 <= min_lr <= max_lr or init_lr > max_lr:
            raise ConfigError(f"the LR schedule needs 0 <= --min-lr ({min_lr}) <= --lr ({max_lr}) and "
                              f"--lr-warmup-init ({init_lr}) <= --lr")
        if decay_iters <= 0 or warmup_iters >= decay_iters:
            raise ConfigError(f"the LR warmup ({warmup_iters:g} samples) must be shorter than the decay "
                              f"({decay_iters:g} samples, > 0): lower the warmup or raise --lr-decay-iters/samples "
                              "(default --train-iters/--train-samples)")
        self.optimizer, self.max_lr, self.min_lr, self.init_lr = optimizer, float(max_lr), min_lr, init_lr
        self.warmup, self.decay, self.style = warmup_iters, decay_iters, decay_style
        self.use_checkpoint, self.override, self.legacy_step = use_checkpoint, override, legacy_step
        self.num_steps = 0
        self.step(0)

    def get_lr(self, step):
        """The LR after `step` completed steps (Megatron's get_lr, same float operations)."""
        if self.warmup > 0 and step <= self.warmup:
            return self.init_lr + (self.max_lr - self.init_lr) * float(step) / float(self.warmup)
        if self.style == "constant":
            return self.max_lr
        if step > self.decay:
            return self.min_lr
        if self.style == "inverse-square-root":
            lr = self.max_lr * max(self.warmup, 1) ** 0.5 / max(step, 1) ** 0.5
            return max(self.min_lr, lr)
        ratio = float(step - self.warmup) / float(self.decay - self.warmup)
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment=1):
        self.num_steps += increment
        lr = self.get_lr(self.num_steps)  # the LR for the next iteration
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def state_dict(self):
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "lr_warmup_steps": self.warmup,
                "lr_decay_steps": self.decay, "lr_decay_style": self.style, "num_steps": self.num_steps}

    def load_state_dict(self, sd):
        """Megatron's rule: --use-checkpoint-opt_param-scheduler takes the checkpoint's
        schedule, --override-opt_param-scheduler the flags'; with neither they must agree."""
        if set(sd) == {"num_steps"}:  # older megalite: iterations, the schedule was not saved
            self.num_steps = 0
            self.step(sd["num_steps"] * self.legacy_step)
            return
        mine = self.state_dict()
        for key, flags in _CHECKED.items():
            if key not in sd or self.override:
                continue
            if not self.use_checkpoint and sd[key] != mine[key]:
                raise ConfigError(f"the checkpoint's LR schedule has {key}={sd[key]} but this run's flags give "
                                  f"{mine[key]} ({flags}); pass --use-checkpoint-opt_param-scheduler to keep the "
                                  "checkpoint's or --override-opt_param-scheduler to take the flags'")
        if not self.override:
            self.max_lr, self.min_lr = float(sd.get("max_lr", self.max_lr)), sd.get("min_lr", self.min_lr)
            self.warmup, self.decay = sd.get("lr_warmup_steps", self.warmup), sd.get("lr_decay_steps", self.decay)
            self.style = sd.get("lr_decay_style", self.style)
        self.num_steps = 0
        self.step(sd["num_steps"])
