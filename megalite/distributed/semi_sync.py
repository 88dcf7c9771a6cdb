"""Semi-synchronous replicas (--semi-sync-method local_sgd | diloco): R model copies that train on their
own and meet only at outer steps.

The data-parallel ranks form R consecutive blocks (parallel_state's replicas); inside a block everything
is ordinary synchronous training (TP + SP, CP, PP, inner DP with ZeRO, ...), whose DP groups are the block's.
Each replica takes its part of every global batch (the iteration plan over all DP ranks) and steps its own
inner AdamW on it, its losses and gradients normalised over its own samples. Replica r trains H_r inner
steps per round (--semi-sync-steps; a round is max H_r iterations of the loop, a replica with fewer
steps idles through the rest: nothing crosses replicas inside a round); then the outer step:

  local_sgd: global = sum_r w_r local_r                      (the weighted average of the weights)
  diloco:    g = sum_r w_r (global - local_r)                (the averaged pseudo-gradient)
             global -= outer_lr * torch.optim.SGD's direction (momentum, Nesterov) for gradient g

with w_r the samples replica r trained on since the last outer step over all replicas' (Local SGD and
DiLoCo weigh replicas by their tokens; every sequence has --seq-length tokens). Every replica continues
from the new global weights. Each rank holds the global weights and the outer momentum only for the fp32
main parameters it owns (its ZeRO shard), its counterparts in the other replicas hold the same elements:
the outer all-reduce runs over those counterparts (parallel_state's replica group), in fp32, bucketed.
The outer arithmetic runs in float64, so one replica with outer lr 1 and momentum 0 reproduces the
ordinary run bit for bit."""

import time

import torch
import torch.distributed as dist

from megalite import parallel_state as ps
from megalite.distributed import comm

BUCKET = 1 << 24  # elements per outer all-reduce


class SemiSync:
    def __init__(self, args, optimizer):
        self.method, self.optimizer = args.semi_sync_method, optimizer
        optimizer.semi_sync = self  # the optimizer carries the outer state it belongs to (tests read it there)
        self.replicas, self.replica = ps.get_replica_world_size(), ps.get_replica_rank()
        self.steps = list(args.semi_sync_steps)
        self.H, self.round = self.steps[self.replica], max(self.steps)
        self.lr, self.momentum, self.nesterov = args.outer_lr, args.outer_momentum, args.outer_nesterov
        self.train_iters = args.train_iters
        self.reset_global()
        self.buf = None  # the outer momentum, per main parameter (torch's SGD: created at the first step)
        self.samples = 0  # what this replica trained on since the last outer step
        self.outer_steps = self.bytes_sent = 0
        self.auto = getattr(args, "semi_sync_auto", False)  # time the first round, then set the counts
        self.step_times, self.last_tick, self.chosen = [], None, None

    def reset_global(self):
        """The global weights: this rank's fp32 main parameters as they are now."""
        self.glob = [m.detach().float().clone() for m in self.optimizer.main_params]

    def state(self):
        """What a checkpoint's metadata records (it is taken at an outer step)."""
        return {"method": self.method, "replicas": self.replicas, "steps": self.steps, "outer_steps": self.outer_steps,
                "outer_lr": self.lr, "outer_momentum": self.momentum, "outer_nesterov": self.nesterov}

    def loaded(self, saved, missing):
        """After a checkpoint load: its weights are the global ones (saved at an outer step, or a synchronous
        run's); the outer momentum is the loaded one unless the checkpoint had none (then it starts again)."""
        self.reset_global()
        self.samples, self.outer_steps = 0, (saved or {}).get("outer_steps", 0)
        if missing or not saved or not saved.get("outer_momentum"):
            self.buf = None

    def trains(self, it):
        """Whether this replica runs iteration `it` (its first H steps of every round)."""
        return (it - 1) % self.round < self.H

    def outer_due(self, it):
        return it % self.round == 0 or it == self.train_iters

    def describe(self):
        how = "weights averaged" if self.method == "local_sgd" else \
            f"outer SGD lr {self.lr:g}, momentum {self.momentum:g}{', Nesterov' if self.nesterov else ''}"
        return (f"{self.replicas} semi-synchronous replicas ({self.method}), inner steps per round "
                f"{','.join(map(str, self.steps))}, {how}; the training loss logged is replica {self.replicas - 1}'s, "
                "validation is every replica's on the global weights")

    def after_iteration(self, it, trained_samples):
        """Count this replica's samples; at the end of a round (or of training) the outer step.
        Returns whether an outer step ran."""
        self.samples += trained_samples
        if self.auto:
            now = time.perf_counter()
            if self.last_tick is not None and trained_samples:
                self.step_times.append(now - self.last_tick)
            self.last_tick = now
        if not self.outer_due(it):
            return False
        self.outer_step()
        if self.auto:
            self._choose_steps(it)
        return True

    def announcement(self, it):
        """The line that reports --semi-sync-steps auto's choice, at the outer step that made it."""
        if self.chosen is None or self.chosen[2] != it:
            return None
        counts = ",".join(map(str, self.steps))
        return (f"megalite: --semi-sync-steps auto: ms per inner step by replica "
                f"{', '.join(f'{1e3 * t:.1f}' for t in self.chosen[0])} -> inner steps per round {counts} from "
                f"iteration {it + 1} (to repeat: --semi-sync-steps {counts})")

    def _choose_steps(self, it):
        """--semi-sync-steps auto, after the first (timed) round: each replica's seconds per inner step (the
        median over the round after its first step; a replica is as slow as its slowest rank), gathered in one
        all-reduce that every rank reads alike; the fastest replica keeps H, each other one H x its speed
        relative to the fastest (at least 1). Printed so that a run can be repeated with explicit counts."""
        mine = sorted(self.step_times)[len(self.step_times) // 2] if self.step_times else 0.0
        t = torch.zeros(self.replicas, dtype=torch.float64, device=ps.get_device())
        t[self.replica] = mine
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        secs = t.tolist()
        fastest = min(secs) if min(secs) > 0 else 1.0
        self.steps = [max(1, int(round(self.round * fastest / s))) if s > 0 else self.round for s in secs]
        self.H, self.auto, self.chosen = self.steps[self.replica], False, (secs, list(self.steps), it)

    @torch.no_grad()
    def outer_step(self):
        mains, group = self.optimizer.main_params, ps.get_replica_group()
        frac = self._weight(group)
        if self.buf is None and self.momentum:
            self.buf = [None] * len(mains)
        for idx in _buckets([m.numel() for m in mains]):
            local = torch.cat([mains[i].detach().reshape(-1).double() for i in idx])
            glob = torch.cat([self.glob[i].reshape(-1).double() for i in idx])
            mine = self._contribution(local, glob)
            total = mine * frac if frac != 1.0 else mine
            if group is not None:
                sent = total.float()
                comm.all_reduce(sent, group=group)  # (counted with the other DP collectives)
                self.bytes_sent += sent.numel() * sent.element_size()
                total = sent.double()
            new = total if self.method == "local_sgd" else glob - self.lr * self._direction(idx, total)
            for i, part in zip(idx, new.split([mains[i].numel() for i in idx])):
                self.glob[i].copy_(part.view_as(self.glob[i]))
                mains[i].copy_(self.glob[i])
        self.optimizer.publish_main_params()
        self.samples, self.outer_steps = 0, self.outer_steps + 1

    def _weight(self, group):
        """This replica's weight: its samples since the last outer step over all replicas' (one all-reduce)."""
        w = torch.tensor([float(self.samples)], dtype=torch.float64, device=ps.get_device())
        if group is not None:
            dist.all_reduce(w, group=group)
        return self.samples / w.item() if w.item() > 0 else 1.0 / self.replicas

    def _contribution(self, local, glob):
        """What this replica sends: Local SGD its weights, DiLoCo its pseudo-gradient global - local."""
        return local if self.method == "local_sgd" else glob - local

    def _direction(self, idx, g):
        """torch.optim.SGD's step direction (dampening 0) for gradient g of the params idx, its momentum
        buffers updated: buf = mu buf + g (buf = g at the first step); Nesterov: g + mu buf; else buf."""
        if not self.momentum:
            return g
        sizes = [self.glob[i].numel() for i in idx]
        if self.buf[idx[0]] is None:
            buf = g.clone()
        else:
            buf = torch.cat([self.buf[i].reshape(-1).double() for i in idx]) * self.momentum + g
        for i, part in zip(idx, buf.split(sizes)):
            self.buf[i] = part.float().view_as(self.glob[i]).clone()
        return g + self.momentum * buf if self.nesterov else buf

    def combine(self, values, weight):
        """{key: value} of this replica (evaluation) -> the weight-averaged values over the replicas."""
        group = ps.get_replica_group()
        if group is None or not values:
            return values
        keys = list(values)
        t = torch.tensor([float(values[k]) * weight for k in keys] + [float(weight)], dtype=torch.float64,
                         device=ps.get_device())
        dist.all_reduce(t, group=group)
        return {k: (t[i] / t[-1]).item() for i, k in enumerate(keys)}


def _buckets(sizes):
    """Consecutive index runs of at most BUCKET elements (one parameter alone if larger)."""
    out, cur, n = [], [], 0
    for i, s in enumerate(sizes):
        if cur and n + s > BUCKET:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += s
    if cur:
        out.append(cur)
    return out
