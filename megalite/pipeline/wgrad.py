"""The weight gradients a split backward defers (zero-bubble schedules): the linear layers' backward at B puts a
closure here (tensor_parallel/deferred_wgrad.py) under the (chunk, micro-batch) whose B runs, and the schedule's W
runs them. Attached to a model chunk's layers for one schedule call (their `wgrad_store`), detached after it."""

import contextlib


class WeightGradStore:
    def __init__(self):
        self.key, self.pending = None, {}  # the (chunk, micro-batch) whose B runs; closures per (chunk, mb)
        self.now = False  # (collecting's `now`)

    def put(self, weight_gradient):
        if self.key is None:
            raise RuntimeError("a deferred weight gradient outside a split backward's B")
        if self.now:  # (computed here, its inputs still in cache; handed to W as it is)
            weight_gradient = (lambda done=weight_gradient(): done)
        self.pending.setdefault(self.key, []).append(weight_gradient)

    @contextlib.contextmanager
    def collecting(self, key, now=False):
        """B of `key`; now: its W comes right after it (the plan says so), so each weight gradient is computed as
        its layer's backward passes (one pass, as a whole backward's) and only accumulated at W."""
        self.key, self.now = key, now
        try:
            yield
        finally:
            self.key, self.now = None, False

    def run(self, key):
        """W: the weight gradients B of `key` deferred, computed now ([(parameter, gradient)]; what they read is
        released with them)."""
        return [weight_gradient() for weight_gradient in self.pending.pop(key, ())]

    def attach(self, chunks):
        for layer in _deferring_layers(chunks):
            layer.wgrad_store = self

    def detach(self, chunks):
        for layer in _deferring_layers(chunks):
            layer.wgrad_store = None
        if self.pending:  # (a schedule that stopped half-way: nothing stays alive)
            self.pending.clear()


def _deferring_layers(chunks):
    return [m for c in chunks for m in c.modules() if hasattr(type(m), "wgrad_store")]
