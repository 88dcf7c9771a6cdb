"""ZeRO-3 parameter units: which buckets each part of the model needs, and when they are
gathered and freed.

A unit is a module whose parameters are gathered together: every transformer layer, and every
other part of the model (embedding, final norm, output layer, BERT's heads). Each has its own
buckets (`ShardedBucket`, stage 3), so it can be gathered and freed alone. With tied word
embeddings on one stage, the output layer's unit uses the embedding's word-embedding bucket.

Schedule, per model chunk (DistributedDataParallel wrapper):
- forward pre-hook: wait for the unit's all-gather (issue it now if no prefetch did), then
  prefetch the next unit in forward order (recorded during the first forward);
- forward post-hook: free the unit, unless --torch-fsdp2-no-reshard-after-forward or the
  forward runs inside a backward (an activation recomputation: the backward that follows needs
  the same weights, so they are not gathered twice); hook the outputs, whose gradient arrives
  just before the unit's backward: the unit is gathered again and the previous one prefetched;
- a bucket is freed once every parameter of it has its gradient from this backward (`DDP`'s
  post-accumulate hook calls `backward_done`; a zero-bubble B, which accumulates nothing: as the
  backward passes below its unit); anything left is freed at the end of the backward, after every
  forward (prefetched but unused) and after every optimizer step.
A forward without autograd (evaluation, generation) gathers each unit on demand and frees it.
"""

import contextlib
import functools

import torch
from torch import nn


def in_backward():
    """Whether autograd is running a backward now (an activation recomputation runs in one)."""
    return torch._C._current_graph_task_id() != -1


def plan_units(model):
    """[(name, module, own trainable params, params used but owned by another unit)] in module
    order; frozen parameters are not sharded (they stay whole on every rank)."""
    parts = []
    for name, child in model.named_children():
        layers = getattr(child, "layers", None)
        if isinstance(layers, (nn.ModuleDict, nn.ModuleList)):  # a transformer block: layer by layer
            parts += [(f"{name}.layers.{n}", layer) for n, layer in layers.named_children()]
            parts += [(f"{name}.{n}", c) for n, c in child.named_children() if c is not layers]
        else:
            parts.append((name, child))
    units, claimed = [], set()
    for name, mod in parts:
        own = [p for p in mod.parameters() if p.requires_grad and p not in claimed]
        claimed.update(own)
        units.append([name, mod, own, []])
    rest = [p for p in model.parameters() if p.requires_grad and p not in claimed]
    if rest:  # parameters of the model itself: gathered for its whole forward
        units.insert(0, ["", model, rest, []])
    shared = _tied_output_weight(model)
    if shared is not None:
        for u in units:
            if u[0] == "output_layer":
                u[3].append(shared)
    return [tuple(u) for u in units if u[2] or u[3]]


def _tied_output_weight(model):
    """The word embedding the output layer uses when both live on this stage (weight=None)."""
    out = getattr(model, "output_layer", None)
    if getattr(model, "share_embeddings_and_output_weights", False) and out is not None and out.weight is None:
        return model.shared_embedding_or_output_weight()
    return None


class Unit:
    def __init__(self, name, module, buckets):
        self.name, self.module, self.buckets = name, module, buckets


class ParamUnits:
    """The gather / prefetch / free schedule of one model chunk's units (see the module doc).
    stats: gathers issued on demand and by prefetch, prefetches freed unused, and the
    high-water mark of gathered parameter bytes."""

    def __init__(self, units, prefetch=True, reshard_after_forward=True):
        self.units, self.prefetch, self.reshard_after_forward = units, prefetch, reshard_after_forward
        self.buckets = list({id(b): b for u in units for b in u.buckets}.values())
        self.order, self.order_fixed, self.splitting = [], False, False
        self.stats = {"demand": 0, "prefetch": 0, "wasted": 0, "peak_bytes": 0}
        for u in units:
            u.module.register_forward_pre_hook(functools.partial(self._pre_forward, u))
            u.module.register_forward_hook(functools.partial(self._post_forward, u))

    # -- gathering -------------------------------------------------------------------------
    def _gather(self, u, prefetched):
        started = False
        for b in u.buckets:
            if b.gather_params(async_op=True):
                started, b.prefetched = True, prefetched
        if started:
            self.stats["prefetch" if prefetched else "demand"] += 1
            now = sum(b.param_bytes() for b in self.buckets if b.params_allocated())
            self.stats["peak_bytes"] = max(self.stats["peak_bytes"], now)

    def ensure(self, u):
        """The unit's full parameters, ready to use."""
        self._gather(u, False)
        for b in u.buckets:
            b.wait_params()
            b.prefetched = False

    def release(self, u):
        for b in u.buckets:
            self._release_bucket(b)

    def _release_bucket(self, b):
        if b.params_allocated() and getattr(b, "prefetched", False):
            self.stats["wasted"] += 1
        b.prefetched = False
        b.release_params()

    def release_all(self):
        for b in self.buckets:
            self._release_bucket(b)

    def _neighbour(self, u, step):
        if not (self.prefetch and self.order_fixed) or u not in self.order:
            return None
        i = self.order.index(u) + step
        return self.order[i] if 0 <= i < len(self.order) else None

    # -- hooks -----------------------------------------------------------------------------
    def _pre_forward(self, u, module, args):
        self.ensure(u)
        if in_backward():
            return  # a recomputation: the backward prefetches
        if not self.order_fixed:
            if u in self.order:
                self.order_fixed = True
            else:
                self.order.append(u)
        nxt = self._neighbour(u, 1)
        if nxt is not None:
            self._gather(nxt, True)

    def _post_forward(self, u, module, args, output):
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, u))
            if self.reshard_after_forward and not in_backward():
                self.release(u)
        elif not in_backward():
            self.release(u)  # no backward will come (evaluation, the first pass of a recomputation)

    def _pre_backward(self, u, grad):
        self.ensure(u)
        if self.splitting:  # the unit after u is behind this backward: none of it accumulates now to free it
            done = self._neighbour(u, 1)
            for b in () if done is None else done.buckets:
                if b not in u.buckets:  # (the tied output layer's bucket is the embedding's)
                    self._release_bucket(b)
        prev = self._neighbour(u, -1)
        if prev is not None:
            self._gather(prev, True)

    @contextlib.contextmanager
    def split_backward(self):
        """A zero-bubble schedule's B (megalite/pipeline/run.py): the parameters' gradients are captured, not
        accumulated (that waits for W, which reads no weights), so nothing calls backward_done; each unit is freed
        as the backward passes below it instead, and what is left at the end."""
        self.splitting = True
        try:
            yield
        finally:
            self.splitting = False
            self.release_all()

    def backward_done(self, b, p):
        """p's gradient of this backward arrived; once all of b's have, b is not needed."""
        b.backward_seen.add(p)
        if len(b.backward_seen) == len(b.params):
            self._release_bucket(b)

    def after_forward(self):
        """The chunk's forward returned: the order is known; free what the backward does not keep."""
        self.order_fixed = self.order_fixed or bool(self.order)
        if not (self.reshard_after_forward or not torch.is_grad_enabled()):
            return
        if not in_backward():
            self.release_all()


def _tensors(output):
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []
