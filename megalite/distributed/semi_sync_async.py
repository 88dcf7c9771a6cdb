"""Asynchronous outer updates (--semi-sync-async, --semi-sync-max-staleness S): semi_sync.py's replicas in the
parameter-server style of Liu et al. 2024 (asynchronous Local-SGD with delayed Nesterov and dynamic local work).

The work is cut into slots: slot (k, r) is replica r's part of the global batches of round k (iterations
kH+1 .. kH+H: the samples the synchronous run's replica r trains on in that round, at that round's LR). Every
replica starts with its own slot of the first round. When it has trained a slot it sends its pseudo-gradient
(the global weights it started from minus its weights now, times its share of the tokens, 1/R) and, without
waiting for the other replicas, receives the newest global weights and its next slot: the lowest round that
still has a free slot, its own part preferred. It waits only where that round k would put it more than S rounds
ahead: every slot of the rounds before k - S must have been applied first (S = 0: the synchronous schedule). Training
ends when every slot of the run's rounds is applied; every replica then holds the same final global weights.
A faster replica so trains more slots; no slot is trained twice and none is lost (the server counts both).

The server: for each position in a replica (TP, CP, inner DP, PP coordinates) the rank at that position in
replica 0 keeps the global weights, the outer momentum and the delayed-Nesterov buffer of its main parameters
(its ZeRO shard) in float64 and runs the outer optimizer in a thread; the counterparts reach it over a gloo
group of their own. All positions apply the pseudo-gradients in one order, that of the tickets each replica's
first rank draws from the job's store when it has trained a slot, so all positions decide alike.

Delayed Nesterov: a pseudo-gradient is applied on arrival as a plain SGD step (outer lr); the momentum is updated,
and its extra term applied, once every R arrivals with their sum. R arrivals computed from the same global
weights therefore make exactly one synchronous DiLoCo step (torch.optim.SGD, momentum, Nesterov). The run is not
deterministic: the order of arrivals depends on the replicas' speeds."""

import itertools
import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from megalite.distributed.semi_sync import SemiSync
from megalite.parallel.launch import new_group

_RUNS = itertools.count()  # every rank trains the same sequence of runs: a store namespace per run


class DelayedNesterov:
    """The outer optimizer on a flat float64 vector of global weights; `every` arrivals make one momentum step."""

    def __init__(self, glob, lr, momentum, nesterov, every, buf=None):
        self.glob, self.lr, self.momentum, self.nesterov, self.every = glob, lr, momentum, nesterov, every
        self.buf, self.acc, self.count = buf, torch.zeros_like(glob), 0

    def apply(self, g):
        """g: one weighted pseudo-gradient (float64)."""
        self.glob.sub_(g, alpha=self.lr)
        self.acc.add_(g)
        self.count += 1
        if self.count < self.every:
            return
        if self.momentum:  # buf = mu buf + sum (the sum at the first step); the rest of SGD's direction
            self.buf = self.acc.clone() if self.buf is None else self.buf.mul_(self.momentum).add_(self.acc)
            self.glob.sub_(self.buf * self.momentum if self.nesterov else self.buf - self.acc, alpha=self.lr)
        self.acc.zero_()
        self.count = 0


class Slots:
    """Which replica trains which slot (k, r), and when a waiting replica may go on: the server's decisions,
    the same at every position (they depend only on the order of arrivals)."""

    def __init__(self, first, rounds, replicas, staleness):
        self.rounds, self.replicas, self.staleness = rounds, replicas, staleness
        self.free = {(k, r) for k in range(first, rounds) for r in range(replicas)}
        self.left = {k: replicas for k in range(first, rounds)}  # slots of round k not yet applied
        self.first, self.holding = first, {}
        self.grants = []  # (replica, slot, the lowest round with unapplied slots then): the staleness record
        for r in range(replicas):
            self._grant(r, (first, r))

    def _grant(self, replica, slot):
        self.free.discard(slot)
        self.holding[replica] = slot
        self.grants.append((replica, slot, self.lowest_open()))

    def lowest_open(self):
        return min((k for k, n in self.left.items() if n), default=self.rounds)

    def applied(self, replica):
        """replica's slot has been applied; returns it."""
        slot = self.holding.pop(replica)
        self.left[slot[0]] -= 1
        return slot

    def next_for(self, replica):
        """(slot) to go on with, "stop" (everything applied), or None (wait)."""
        if not self.free:
            return "stop" if not self.holding else None
        k = min(s[0] for s in self.free)
        slot = (k, replica) if (k, replica) in self.free else min(s for s in self.free if s[0] == k)
        if k - self.lowest_open() > self.staleness:
            return None  # it would run more than S rounds ahead of the oldest slot not yet applied
        self._grant(replica, slot)
        return slot


class AsyncSemiSync(SemiSync):
    """The replica's side (every rank) and, on replica 0's ranks, the server of its position."""

    asynchronous = True

    def __init__(self, cfg, optimizer, chunks=()):
        super().__init__(cfg, optimizer, chunks)
        self.staleness, self.round = cfg.semi_sync_max_staleness, self.H
        self.batch, self.sent, self.exchanges, self.slot = cfg.global_batch_size, 0, [], None
        self.run = next(_RUNS)
        self.store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
        self.group, self.counterparts, self.new_slot, self.server = None, None, False, None
        self.draws_tickets = replicas_first_rank(self.grid) and self.replicas > 1  # (one replica: no order to keep)
        for ranks in self.grid.replica_counterparts:  # every rank creates every group, in order
            g = new_group(ranks, backend="gloo")
            if dist.get_rank() in ranks:
                self.group, self.counterparts = g, ranks  # (in replica order: the server is the first)

    def describe(self):
        return (super().describe().replace("semi-synchronous", "asynchronous") +
                f"; a replica runs at most {self.staleness} rounds ahead (delayed Nesterov)")

    def begin(self, start_iter):
        """Before the loop (after a checkpoint load): the first round, and on replica 0 the server."""
        from megalite.config import ConfigError
        if start_iter % self.H:
            raise ConfigError(f"--semi-sync-async resumes at a multiple of --semi-sync-steps {self.H} (the checkpoint "
                              f"is at iteration {start_iter})")
        self.first = first = start_iter // self.H
        rounds = self.train_iters // self.H
        self.slot = (first, self.replica) if first < rounds else None  # the loop's own data and LR already
        if self.replica == 0 and first < rounds:
            self.server = _Server(self, Slots(first, rounds, self.replicas, self.staleness))
            self.server.start()

    def iterations(self, its):
        """The loop's iterations: those of each slot this replica is given, until the server says stop
        (nothing where the loop has none: --skip-train, or training already done)."""
        while its and self.slot is not None:
            k = self.slot[0]
            for it in range(k * self.H + 1, (k + 1) * self.H + 1):
                yield it

    def slot_start(self, it):
        """At a slot's first iteration: (samples before it, the DP rank across replicas whose part it reads)."""
        if not self.new_slot:
            return None
        self.new_slot = False
        return (it - 1) * self.batch, self.slot[1] * self.grid.dp + self.grid.dp_rank

    def check_due(self, it, every):
        return bool(every)  # only at the end, where every replica holds the final weights

    def after_iteration(self, it, trained_samples):
        """At a slot's last iteration: send its pseudo-gradient, take the newest weights and the next slot.
        Returns True after the last exchange (every replica on the final global weights)."""
        if it % self.H:
            return False
        g = torch.cat([(b.double() - m.detach().double()).reshape(-1) for b, m in
                       zip(self.glob, self.optimizer.main_params)]) / self.replicas
        g = g.float().cpu()
        if self.draws_tickets:
            t = self.store.add(f"megalite/async/{self.run}/tickets", 1) - 1  # this slot's place in the order
            self.store.set(f"megalite/async/{self.run}/ticket{t}", str(self.replica))
        self.sent += 1
        if self.server is not None:
            self.server.inbox.put(g)
            slot, weights = self.server.outbox.get()
            self.server.raise_error()
        else:
            server = self.counterparts[0]
            dist.send(g, server, group=self.group)
            head = torch.zeros(3, dtype=torch.int64)
            dist.recv(head, server, group=self.group)
            weights = torch.empty_like(g)
            dist.recv(weights, server, group=self.group)
            slot = "stop" if head[0] else (int(head[1]), int(head[2]))
        self.bytes_sent += g.numel() * g.element_size()
        self.frag_syncs[0] += 1
        self._take(weights)
        self.exchanges.append((self.slot, slot))
        self.slot, self.new_slot = (None, False) if slot == "stop" else (slot, True)
        if slot == "stop":  # every slot applied: R arrivals per outer (momentum) step
            self.outer_steps += self.train_iters // self.H - self.first
            if self.server is not None:
                self.server.join()
                self.server.raise_error()
                self.buf = self.server.momentum()
            return True
        return False

    def _take(self, weights):
        for g, m, part in zip(self.glob, self.optimizer.main_params, unflatten(weights, self.glob)):
            g.copy_(part)
            m.detach().copy_(part)
        self.optimizer.publish_main_params()


class _Server(threading.Thread):
    """The outer optimizer of one position (on replica 0's rank there): arrivals in ticket order."""

    def __init__(self, owner, slots):
        super().__init__(daemon=True, name="megalite-async-outer")
        self.owner, self.slots, self.error = owner, slots, None
        glob = torch.cat([g.double().reshape(-1).cpu() for g in owner.glob])
        buf = None if owner.buf is None else torch.cat([b.double().reshape(-1).cpu() for b in owner.buf])
        self.outer = DelayedNesterov(glob, owner.lr, owner.momentum, owner.nesterov, owner.replicas, buf)
        self.inbox, self.outbox = queue.Queue(), queue.Queue()
        self.applied = [0] * owner.replicas  # pseudo-gradients applied, per replica
        # its own connection: a wait on the training thread's would block it (one replica: no tickets)
        self.store = owner.store.clone() if owner.replicas > 1 else None
        self.waiting = set()

    def run(self):
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - the training thread re-raises it
            self.error = e
            self.outbox.put(("stop", torch.empty(0)))

    def raise_error(self):
        if self.error is not None:
            raise RuntimeError(f"the asynchronous outer optimizer failed: {self.error}") from self.error

    def momentum(self):
        if self.outer.buf is None:
            return None
        glob = self.owner.glob
        return [b.to(g.device, torch.float32) for b, g in zip(unflatten(self.outer.buf, glob), glob)]

    def _serve(self):
        o, stopped, t = self.owner, set(), 0
        n = self.outer.glob.numel()
        while len(stopped) < o.replicas:
            src = self._ticket(t)
            if src == 0:
                g = self.inbox.get()
            else:
                g = torch.empty(n, dtype=torch.float32)
                dist.recv(g, o.counterparts[src], group=o.group)
            self.outer.apply(g.double())
            self.applied[src] += 1
            self.slots.applied(src)
            self.waiting.add(src)
            for r in sorted(self.waiting):
                nxt = self.slots.next_for(r)
                if nxt is None:
                    continue
                self.waiting.discard(r)
                stopped.update([r] if nxt == "stop" else [])
                self._reply(r, nxt)
            t += 1

    def _ticket(self, t):
        """The replica whose pseudo-gradient is the t-th to apply."""
        if self.store is None:
            return 0
        key = f"megalite/async/{self.owner.run}/ticket{t}"
        while True:  # a round can outlast the store's timeout: wait in pieces
            try:
                self.store.wait([key], timedelta(seconds=60))
                return int(self.store.get(key))
            except RuntimeError:
                continue

    def _reply(self, r, slot):
        weights = self.outer.glob.float()
        if r == 0:
            self.outbox.put((slot, weights))
            return
        dst = self.owner.counterparts[r]
        head = torch.tensor([1, 0, 0] if slot == "stop" else [0, slot[0], slot[1]], dtype=torch.int64)
        dist.send(head, dst, group=self.owner.group)
        dist.send(weights, dst, group=self.owner.group)


def replicas_first_rank(grid):
    """Whether this rank is its replica's first (TP, CP, inner DP and PP rank 0)."""
    return grid.dp_rank == 0 and grid.tp_rank == 0 and grid.cp_rank == 0 and grid.pp_rank == 0


def unflatten(flat, like):
    """Views of a flat vector shaped as the tensors `like`, in order."""
    return [t.view_as(x) for t, x in zip(flat.split([x.numel() for x in like]), like)]


def semi_sync_for(cfg, optimizer, chunks=()):
    """The training loop's semi-synchronous state (cfg: the SemiSyncConfig): None without --semi-sync-method."""
    if not cfg.semi_sync_method:
        return None
    return AsyncSemiSync(cfg, optimizer, chunks) if cfg.semi_sync_async else SemiSync(cfg, optimizer, chunks)
