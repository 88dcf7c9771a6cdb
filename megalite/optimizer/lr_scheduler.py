"""Learning rate: linear warmup to --lr, then constant / linear / cosine decay to --min-lr.

Megatron's schedule exactly: the LR is a function of the number of completed steps n
(iteration k trains with n = k - 1, so the first warmup iteration runs at LR 0), and the
log line shows the LR after the step, max_lr * k / warmup during warmup.
"""

import math


class LRScheduler:
    def __init__(self, optimizer, max_lr, min_lr, warmup_iters, decay_iters, decay_style):
        if decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"--lr-decay-style {decay_style!r} is not one of constant, linear, cosine")
        self.optimizer, self.max_lr, self.min_lr = optimizer, max_lr, min_lr
        self.warmup, self.decay, self.style = warmup_iters, max(decay_iters, 1), decay_style
        self.num_steps = 0
        self.step(0)

    def get_lr(self, step):
        """The LR after `step` completed steps."""
        if self.warmup > 0 and step <= self.warmup:
            return self.max_lr * step / self.warmup
        if self.style == "constant":
            return self.max_lr
        if step > self.decay:
            return self.min_lr
        ratio = (step - self.warmup) / max(self.decay - self.warmup, 1)
        if self.style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment=1):
        self.num_steps += increment
        lr = self.get_lr(self.num_steps)  # the LR for the next iteration
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def state_dict(self):
        return {"num_steps": self.num_steps}

    def load_state_dict(self, sd):
        self.num_steps = sd["num_steps"]
        self.step(0)
