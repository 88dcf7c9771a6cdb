"""Learning rate: Megatron's OptimizerParamScheduler maths.

Linear warmup from --lr-warmup-init to --lr over the warmup steps, then constant / linear /
cosine / inverse-square-root decay to --min-lr at the decay steps (--min-lr after them), or WSD:
--lr held until the last --lr-wsd-decay-iters/samples of the decay, then annealed to --min-lr by
--lr-wsd-decay-style (exponential, linear, cosine, minus_sqrt).
The LR is a function of the completed steps n; the log line shows it after the step.

A step is a sample, as in Megatron's training loop: each successful iteration advances the
schedule by its global batch size, a skipped fp16 iteration not at all (schedule_steps
turns iteration counts into samples with --global-batch-size).
"""

import math

from megalite.config import ConfigError

STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
# WSD's anneal: its share r of the annealing steps done -> the coefficient of (max - min LR), Megatron's
WSD_STYLES = {"exponential": lambda r: 2.0 * math.pow(0.5, r) - 1.0, "linear": lambda r: 1.0 - r,
              "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0), "minus_sqrt": lambda r: 1.0 - math.sqrt(r)}


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


def weight_decay_schedule(tcfg):
    """(start, end, style, increment steps in samples) of the weight decay's increment; None: constant."""
    if tcfg.weight_decay_incr_style == "constant":
        return None
    steps = tcfg.train_samples if tcfg.train_samples is not None else tcfg.train_iters * tcfg.global_batch_size
    return tcfg.start_weight_decay, tcfg.end_weight_decay, tcfg.weight_decay_incr_style, steps


def wsd_steps(tcfg):
    """WSD's annealing steps in samples (None: not WSD), as Megatron's get_optimizer_param_scheduler."""
    if tcfg.lr_decay_style != "WSD":
        return None
    if tcfg.train_samples is not None:
        return tcfg.lr_wsd_decay_samples
    return tcfg.lr_wsd_decay_iters * tcfg.global_batch_size


# Checkpoint key -> (the flags that set it, Megatron's name in its assertion).
_CHECKED = {"max_lr": "--lr", "min_lr": "--min-lr",
            "lr_warmup_steps": "--lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction",
            "lr_decay_steps": "--lr-decay-iters/--lr-decay-samples (default --train-iters/--train-samples)",
            "lr_decay_style": "--lr-decay-style", "decoupled_lr": "--decoupled-lr",
            "decoupled_min_lr": "--decoupled-min-lr", "wsd_decay_steps": "--lr-wsd-decay-iters/--lr-wsd-decay-samples",
            "lr_wsd_decay_style": "--lr-wsd-decay-style", "start_wd": "--start-weight-decay",
            "end_wd": "--end-weight-decay", "wd_incr_style": "--weight-decay-incr-style",
            "wd_incr_steps": "--train-iters/--train-samples (the weight decay's increment)"}
WD_KEYS = ("start_wd", "end_wd", "wd_incr_style", "wd_incr_steps")  # (Megatron's names)
_UNRECORDED_BY_MEGATRON = ("wsd_decay_steps", "lr_wsd_decay_style")  # (its scheduler state leaves them out)
_CHECKED_IF_SET = ("decoupled_lr", "decoupled_min_lr", "wsd_decay_steps", "lr_wsd_decay_style") + WD_KEYS


class LRScheduler:
    def __init__(self, optimizer, max_lr, min_lr, warmup_iters, decay_iters, decay_style, init_lr=0.0,
                 use_checkpoint=False, override=False, legacy_step=1, decoupled=(None, None), wsd=(None, None),
                 weight_decay=None):
        """warmup_iters / decay_iters: in steps (samples when training). legacy_step: steps per
        iteration of a checkpoint from before the schedule counted samples ({"num_steps"} only).
        decoupled: (peak, minimum) LR of the param groups marked "decoupled" (Megatron's
        --decoupled-lr / --decoupled-min-lr: the input embedding and output layer); the same
        warmup and decay, to their own peak and floor. wsd: (annealing steps, --lr-wsd-decay-style) of WSD.
        weight_decay: (start, end, style, steps) of the weight decay's increment (weight_decay_schedule), set on
        the decayed groups at every step; None: their --weight-decay."""
        self.weight_decay = weight_decay
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
        self.decoupled_lr, self.decoupled_min_lr = decoupled[0], decoupled[1] if decoupled[1] is not None else min_lr
        if self.decoupled_lr is not None and not 0.0 <= self.decoupled_min_lr <= self.decoupled_lr:
            raise ConfigError(f"the LR schedule needs 0 <= --decoupled-min-lr ({self.decoupled_min_lr}, default "
                              f"--min-lr) <= --decoupled-lr ({self.decoupled_lr})")
        self.wsd_decay_steps, self.wsd_style = wsd
        if decay_style == "WSD" and not (self.wsd_decay_steps or 0) > 0:
            raise ConfigError("--lr-decay-style WSD anneals over its last --lr-wsd-decay-iters (--lr-wsd-decay-"
                              "samples with --train-samples): give it, > 0")
        if decay_style == "WSD" and self.wsd_style not in WSD_STYLES:
            raise ConfigError(f"--lr-wsd-decay-style {self.wsd_style!r} is not one of {', '.join(WSD_STYLES)}")
        self.num_steps = 0
        self.step(0)

    def get_lr(self, step, max_lr=None, min_lr=None):
        """The LR after `step` completed steps (Megatron's get_lr, same float operations), for
        the main schedule or, given, another peak and floor (a param group's override)."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.warmup > 0 and step <= self.warmup:
            return self.init_lr + (max_lr - self.init_lr) * float(step) / float(self.warmup)
        if self.style == "constant":
            return max_lr
        if step > self.decay:
            return min_lr
        if self.style == "inverse-square-root":
            lr = max_lr * max(self.warmup, 1) ** 0.5 / max(step, 1) ** 0.5
            return max(min_lr, lr)
        ratio = float(step - self.warmup) / float(self.decay - self.warmup)
        if self.style == "WSD":  # (held until the anneal starts, which counts from step 0, not the warmup's end)
            start = self.decay - self.wsd_decay_steps
            coeff = 1.0 if step <= start else WSD_STYLES[self.wsd_style](float(step - start) / self.wsd_decay_steps)
        else:
            coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def get_wd(self, step):
        """The weight decay after `step` completed steps (Megatron's get_wd)."""
        start, end, style, steps = self.weight_decay
        if step > steps:
            return end
        ratio = float(step) / float(steps)
        coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return start + coeff * (end - start)

    def step(self, increment=1):
        self.num_steps += increment
        if self.weight_decay is not None:
            wd = self.get_wd(self.num_steps)
            for g in self.optimizer.param_groups:
                if g.get("decay"):
                    g["weight_decay"] = wd
        self.lr = self.get_lr(self.num_steps)  # the LR for the next iteration
        decoupled = self.lr if self.decoupled_lr is None else \
            self.get_lr(self.num_steps, self.decoupled_lr, self.decoupled_min_lr)
        for g in self.optimizer.param_groups:
            mult = g.get("mup_lr_mult", 1.0)  # muP's hidden matrices: peak and floor x 1/m, warm-up from init
            g["lr"] = decoupled if g.get("decoupled") else self.lr if mult == 1.0 else \
                self.get_lr(self.num_steps, self.max_lr * mult, self.min_lr * mult)
        return self.lr

    def state_dict(self):
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "lr_warmup_steps": self.warmup,
                "lr_decay_steps": self.decay, "lr_decay_style": self.style, "num_steps": self.num_steps,
                **({} if self.decoupled_lr is None else {"decoupled_lr": self.decoupled_lr,
                                                          "decoupled_min_lr": self.decoupled_min_lr}),
                **({} if self.style != "WSD" else {"wsd_decay_steps": self.wsd_decay_steps,
                                                   "lr_wsd_decay_style": self.wsd_style}),
                **({} if self.weight_decay is None else dict(zip(WD_KEYS, self.weight_decay)))}

    def load_state_dict(self, sd):
        """Megatron's rule: --use-checkpoint-opt_param-scheduler takes the checkpoint's
        schedule, --override-opt_param-scheduler the flags'; with neither they must agree."""
        if set(sd) == {"num_steps"}:  # older megalite: iterations, the schedule was not saved
            self.num_steps = 0
            self.step(sd["num_steps"] * self.legacy_step)
            return
        mine = self.state_dict()
        for key, flags in _CHECKED.items():
            if self.override or key not in sd and key not in mine:
                continue
            if key not in sd or key not in mine:  # --decoupled-lr in only one of the two runs
                constant_wd = key in WD_KEYS and sd.get("wd_incr_style", "constant") == "constant" and key not in mine
                if key not in _CHECKED_IF_SET or self.use_checkpoint or constant_wd or \
                        key in _UNRECORDED_BY_MEGATRON and key not in sd:
                    continue  # an older (or Megatron's) schedule without this key, or the checkpoint's taken
                raise ConfigError(f"the checkpoint's LR schedule {'has' if key in sd else 'lacks'} {flags} but this "
                                  f"run's flags {'do not' if key in sd else 'do'}: pass the same {flags} or "
                                  "--override-opt_param-scheduler to take the flags'")
            if not self.use_checkpoint and sd[key] != mine[key]:
                raise ConfigError(f"the checkpoint's LR schedule has {key}={sd[key]} but this run's flags give "
                                  f"{mine[key]} ({flags}); pass --use-checkpoint-opt_param-scheduler to keep the "
                                  "checkpoint's or --override-opt_param-scheduler to take the flags'")
        if not self.override:
            self.max_lr, self.min_lr = float(sd.get("max_lr", self.max_lr)), sd.get("min_lr", self.min_lr)
            self.warmup, self.decay = sd.get("lr_warmup_steps", self.warmup), sd.get("lr_decay_steps", self.decay)
            self.style = sd.get("lr_decay_style", self.style)
            if self.decoupled_lr is not None:
                self.decoupled_lr, self.decoupled_min_lr = sd["decoupled_lr"], sd["decoupled_min_lr"]
            if self.style == "WSD":  # (Megatron's checkpoints do not record the annealing: the flags give it)
                self.wsd_decay_steps = sd.get("wsd_decay_steps", self.wsd_decay_steps)
                self.wsd_style = sd.get("lr_wsd_decay_style", self.wsd_style)
                if not self.wsd_decay_steps:
                    raise ConfigError("the checkpoint's LR schedule is WSD but records no annealing length (a "
                                      "Megatron-LM checkpoint): pass --lr-decay-style WSD --lr-wsd-decay-iters")
            if sd.get("wd_incr_style", "constant") != "constant":
                self.weight_decay = tuple(sd[k] for k in WD_KEYS)
        self.num_steps = 0
        self.step(sd["num_steps"])
