"""Fault-tolerant replicas on torchft (--ft-lighthouse): each replica is a whole model copy (its own TP x CP x PP and
inner DP, its own torchrun job); torchft's Lighthouse forms a quorum of the live replicas before every iteration.
The global batch is split over the quorum (as evenly as its micro-batches go), each replica reduces its gradients
inside itself and then with the others (torchft's process group, reconfigured when the quorum changes), and the
step is applied only when every replica of the quorum votes that it went through (torchft's should_commit). A step
that did not commit is run again, over the new quorum, on the same global batch: every batch is trained exactly
once. A replica that starts (restarted
or new) heals from a live peer through torchft's checkpoint transport: optimizer state and fp32 main weights, LR
schedule, iteration, samples consumed, RNG streams and FP8 amax histories.

The part's hooks: iterations() runs the quorum before each iteration (and heals), vote() reduces across replicas
and votes between the gradient finalisation and the optimizer step (training/step.py), finish() leaves."""

import dataclasses
import hashlib
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megalite import parallel_state as ps
from megalite.config import ExecutionConfig
from megalite.batching.iteration_plan import IterationPlan, balanced_counts
from megalite.batching.microbatches import BatchSchedule
from megalite.tensor_parallel.random import get_rng_states, set_rng_states
from megalite.training.parts import Part


class FaultTolerance(Part):
    writes = ("across",)  # the quorum's sum (the log line's losses)

    def __init__(self, cfg, chunks, optimizer, scheduler, cursor, converters, start_iter, abort):
        """cfg: its FtConfig (config/ft.py). Its collaborators: the rank's chunks, optimizer and LR schedule (a heal
        loads them), the data cursor (each quorum's split is a new plan for it), the model converters (their gradient
        units follow the plan; their state is healed too), the iteration the run starts after, and the run's abort."""
        # torchft's manager logs four lines a step at its default level; megalite prints the quorum's changes itself
        # (RUST_LOG=info brings torchft's back)
        os.environ.setdefault("RUST_LOG", "warn")
        import torchft
        self.cfg, self.abort = cfg, abort
        self.chunks, self.optimizer, self.scheduler, self.cursor, self.converters = \
            chunks, optimizer, scheduler, cursor, converters
        self.grid = g = ps.grid_of(chunks)
        self.split, self.healed, self.committed, self.done = None, None, True, start_iter
        self.waiting = None  # the live replicas' count while below --ft-min-replicas
        self.exchanged = None  # the process group's configuration when the replicas last exchanged shares
        # --ft-replica-share auto: this replica's forward-backward seconds per micro-batch over its first committed
        # iterations, then its slowest rank's fastest (0 until measured)
        self.auto, self.profile, self.seconds = cfg.ft_replica_share == "auto", [], 0.0
        self.fingerprint = fingerprint(cfg, g, chunks[0].module.config)
        if dist.is_initialized():  # torchrun's store, shared by the replica's ranks (torchft keys its own prefix)
            self.store, addr, port = None, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:  # a replica of one process: its own store
            self.store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            addr, port = "localhost", self.store.port
        self.pg = _counting_gloo(torchft, timedelta(seconds=cfg.ft_timeout))
        try:
            self.manager = torchft.Manager(
                pg=self.pg,
                load_state_dict=self._load, state_dict=self._state, min_replica_size=cfg.ft_min_replicas,
                use_async_quorum=False, timeout=timedelta(seconds=cfg.ft_timeout),
                quorum_timeout=timedelta(seconds=cfg.ft_quorum_timeout),
                connect_timeout=timedelta(seconds=cfg.ft_connect_timeout), rank=g.rank, world_size=g.world_size(),
                store_addr=addr, store_port=port, lighthouse_addr=_url(cfg.ft_lighthouse),
                replica_id=f"megalite_replica_{cfg.ft_replica_id}",
                heartbeat_interval=timedelta(milliseconds=cfg.ft_heartbeat_ms), init_sync=False)
        except Exception as e:  # noqa: BLE001 - torchft's errors are many; the user's one line names the address
            abort(f"--ft-lighthouse {cfg.ft_lighthouse}: cannot join the Lighthouse within --ft-connect-timeout "
                  f"{cfg.ft_connect_timeout:g} s ({type(e).__name__}: {str(e).splitlines()[0][:160]})")

    def iterations(self, its):
        """Each iteration after a quorum (which may heal this replica to a later one); an iteration that did not
        commit is run again."""
        its = list(its)
        it, end = (its[0], its[-1]) if its else (1, 0)
        while it <= end:
            self._quorum()
            if self.healed is not None:
                it, self.healed = self.healed + 1, None
                if it > end:
                    break
            self.committed = None
            yield it
            if self.committed is not False:
                self.done, it = it, it + 1

    def _quorum(self, shrink_only=False):
        start = time.perf_counter()
        while True:
            # synchronous: a replica that must heal has loaded its peer's state on return
            self.manager.start_quorum(shrink_only=shrink_only)
            if self.manager.errored() is not None:
                return  # this step will not commit; the next quorum reconfigures
            live = self.manager.num_participants()
            if live >= self.cfg.ft_min_replicas:
                self.waiting = None
                break
            if self.waiting != live and self.grid.rank == 0:  # one line per wait (and per change while waiting)
                print(f"megalite: fault tolerance: {live} live replica{'s' if live > 1 else ''}, fewer than "
                      f"--ft-min-replicas {self.cfg.ft_min_replicas}: waiting for more (replica "
                      f"{self.cfg.ft_replica_id})", flush=True)
            self.waiting = live
            time.sleep(self.cfg.ft_heartbeat_ms / 100)  # (ten heartbeats) then a new quorum, open to newcomers
            shrink_only = False
        if self.split is not None and self.exchanged == self.pg.configured:
            return  # the quorum of the last exchange (no replica left, joined or healed; it committed): kept
        self._deal(time.perf_counter() - start)

    def _deal(self, waited):
        """A new quorum: its replicas checked alike, their shares (and measured speeds) exchanged, the batch dealt
        out again if the split changed. waited: how long the quorum took."""
        self._check_same()  # every new quorum, on every replica: the same collectives whoever joined or left
        rank, replicas = self.manager.participating_rank(), self.manager.num_participants()
        # every live replica's --ft-replica-share and (auto) its measured seconds per micro-batch, in rank order
        shares = torch.zeros(2 * replicas, dtype=torch.float64)
        shares[rank or 0], shares[replicas + (rank or 0)] = 1 if self.auto else self.cfg.ft_replica_share, self.seconds
        self.manager.allreduce(shares, reduce_op=dist.ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return
        weights, seconds = tuple(int(x) for x in shares[:replicas].tolist()), shares[replicas:].tolist()
        # (auto: exchanged again each quorum until every live replica has measured)
        self.exchanged = self.pg.configured if not self.auto or all(seconds) else None
        if self.auto and all(seconds):  # every live replica measured: the counts that finish the batch soonest
            weights = tuple(balanced_counts(seconds, self._units(replicas)))
        split = (rank, replicas, weights)
        if split != self.split:
            if self.auto and all(seconds) and self.grid.rank == 0:
                print(f"megalite: fault tolerance: --ft-replica-share auto: ms per micro-batch by live replica "
                      f"{', '.join(f'{1e3 * t:.1f}' for t in seconds)} -> micro-batches {', '.join(map(str, weights))} "
                      f"(replica {self.cfg.ft_replica_id})", flush=True)
            self._resplit(*split, waited)

    def _units(self, replicas):
        """Micro-batches of each inner DP rank in a global batch, all told (at least one per live replica)."""
        g, a = self.grid, self.cfg
        units = a.global_batch_size // (a.micro_batch_size * g.dp)
        if units < replicas:
            self.abort(f"--global-batch-size {a.global_batch_size} gives {units} micro-batches per data-parallel "
                       f"rank of a replica, fewer than the {replicas} live replicas; raise it (or "
                       "--micro-batch-size lower) so every live replica gets one")
        return units

    def timed(self):
        return self.auto and not self.seconds

    def _measure(self, step):
        """--ft-replica-share auto: one committed iteration's forward-backward seconds per micro-batch; after
        --ft-share-profile-iters of them, the fastest, the maximum over the replica's ranks (its slowest)."""
        if not (self.auto and not self.seconds and step.timed and step.num_micro):
            return
        self.profile.append(step.times["forward-backward"] / step.num_micro)
        if len(self.profile) >= self.cfg.ft_share_profile_iters:
            t = torch.tensor([min(self.profile)], dtype=torch.float64)
            if dist.is_initialized():  # (the replica's own job)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
            self.seconds = t.item()

    def _check_same(self):
        """The quorum's replicas run the same model at the same inner layout with the same batch flags."""
        names, mine = self.fingerprint
        mean = torch.tensor(mine, dtype=torch.float64)
        self.manager.allreduce(mean).wait()  # (the mean over the quorum: equal to ours iff every replica's is)
        if self.manager.errored() is None and (different := disagreement(names, mine, mean.tolist())):
            self.abort(f"replica {self.cfg.ft_replica_id}: the live replicas were launched with different "
                       f"{', '.join(different)}; every replica needs the same model, inner layout and batch flags")

    def _resplit(self, rank, replicas, weights, waited):
        """The global batch over the live replicas' DP ranks: its micro-batches of every inner DP rank dealt out
        in proportion to the replicas' shares (weights; equal ones: as evenly as they go, the first replicas
        taking one more), each replica's part the contiguous run after the parts before it; this rank's plan and
        data. waited: how long the quorum took (after a replica died: the wait for the Lighthouse to give up on it)."""
        g, a = self.grid, self.cfg
        counts = dealt(self._units(replicas), weights)
        shares = [n for n in counts for _ in range(g.dp)]  # one per DP rank across the replicas
        plan = IterationPlan(BatchSchedule(a.global_batch_size, a.micro_batch_size, g.dp * replicas), shares,
                             self.plan_replicas(replicas))
        # (each micro-batch loss divided by the global batch's count: gradients in the single process's units)
        for converter in self.converters:
            converter.set_plan(plan)
        self.cursor.replan(plan, (rank or 0) * g.dp + g.dp_rank, g.dp * replicas)
        print(f"megalite: fault tolerance: {replicas} live replica{'s' if replicas > 1 else ''}; this one trains "
              f"{counts[rank or 0] * g.dp * a.micro_batch_size} of {a.global_batch_size} samples (replica "
              f"{self.cfg.ft_replica_id}; the quorum took {waited:.2f} s)", flush=True)
        self.split = (rank, replicas, weights)

    def plan_replicas(self, replicas):
        """The iteration plan's replicas: 1 (each micro-batch loss weighed against the whole global batch: the
        replicas' gradients are summed every step)."""
        return 1

    def vote(self, chunks, amaxes=()):
        """The replicas' gradients summed over the quorum, then the commit vote: True when every replica went
        through this step (the optimizer steps), False when one failed (nothing is applied). Every micro-batch
        loss was divided by the global batch's micro-batch count (the plan's shares), so the sum over the quorum
        is the single process's mean once the replica's own reduction is undone of its average (its divisor).
        With ZeRO each rank sums only the shard it owns, with the same rank of the other replicas. amaxes: the
        iteration's FP8 amaxes (delayed scaling), their maximum over the quorum, in place, before the vote."""
        for grad in replica_sums(chunks):
            self.manager.allreduce(grad, reduce_op=dist.ReduceOp.SUM).wait()
        for t in amaxes:
            self.manager.allreduce(t, reduce_op=dist.ReduceOp.MAX).wait()
        self.committed = self.manager.should_commit()
        if not self.committed:
            self.leave_reduction()
            for c in chunks:
                c.zero_grad_buffer()
            self.split = None  # the next quorum deals the same batch out again (the data read anew, whatever split)
        return self.committed

    def leave_reduction(self):
        """After a vote against the step: this replica's process group closed at once, so that a peer still waiting
        inside the reduction for this replica (whose own exchanges with a dead one failed first) fails now, not at
        --ft-timeout; until it asks, no quorum forms without it (the Lighthouse wants a majority of the replicas
        that heartbeat). The Lighthouse gives a new quorum after a failed commit: every replica configures a new
        group at the next one."""
        self.pg.abort()

    def tell(self, it, step):
        return {"across": self._sum}  # the log line's losses: each replica's is its part of the batch's mean

    def after(self, it, step):
        self._measure(step)

    def _sum(self, t):
        self.manager.allreduce(t, reduce_op=dist.ReduceOp.SUM).wait()
        return t

    def writes_checkpoints(self):
        """Whether this replica writes the checkpoints: the first of the live ones (replicas hold the same state
        after every committed step; one writer, and another takes over when it dies)."""
        return self.split is not None and (self.manager.participating_rank() or 0) == 0

    def _state(self):
        return {"iteration": self.done, "consumed": self.cursor.consumed, "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "rng": get_rng_states(),
                **{c.name: c.state_dict() for c in self.converters}}  # (delayed FP8 scaling's histories)

    def _load(self, sd):
        for converter in self.converters:
            converter.load_state_dict(sd.get(converter.name, {}))
        self.optimizer.load_state_dict(sd["optimizer"])
        self.scheduler.load_state_dict(sd["scheduler"])
        set_rng_states(sd["rng"])
        self.cursor.consumed = sd["consumed"]
        self.done, self.healed, self.split = sd["iteration"], sd["iteration"], None
        print(f"megalite: fault tolerance: replica {self.cfg.ft_replica_id} healed from a live peer at iteration "
              f"{sd['iteration']}", flush=True)

    def finish(self, last):
        self.manager.shutdown(wait=False)
        return last


def _counting_gloo(torchft, timeout):
    """torchft's gloo process group, counting its configurations: torchft configures it anew for each new quorum
    (a replica left or joined: a restarted one comes back under a new id), so an unchanged count is an unchanged
    quorum."""
    class CountingGloo(torchft.ProcessGroupGloo):
        configured = 0

        def configure(self, *args, **kwargs):
            self.configured += 1
            return super().configure(*args, **kwargs)
    return CountingGloo(timeout=timeout)


def dealt(units, weights):
    """units micro-batches over replicas of these weights: one each, then one at a time to the replica furthest
    below its proportional part (ties: the lower rank), so every replica derives the same counts."""
    total, n = sum(weights), [1] * len(weights)
    for _ in range(units - len(weights)):
        r = max(range(len(weights)), key=lambda i: (units * weights[i] / total - n[i], -i))
        n[r] += 1
    return n


def fingerprint(cfg, grid, mcfg):
    """(names, values) every replica of a quorum must share: the model's architecture (a 40-bit digest), the inner
    layout and the batch flags; values exact in float64, so their mean over the quorum equals them iff all agree."""
    runtime = {f.name for f in dataclasses.fields(ExecutionConfig)}
    arch = repr(sorted((f.name, repr(getattr(mcfg, f.name))) for f in dataclasses.fields(mcfg)
                       if f.name not in runtime))
    digest = _digest(arch)
    pairs = (("model architecture", digest), ("--tensor-model-parallel-size", grid.tp),
             ("--pipeline-model-parallel-size", grid.pp), ("--context-parallel-size", grid.cp),
             ("data-parallel size inside a replica", grid.dp), ("--micro-batch-size", cfg.micro_batch_size),
             ("--global-batch-size", cfg.global_batch_size), ("--seq-length", cfg.seq_length),
             ("--ft-replica-share auto (on every replica or none)", cfg.ft_replica_share == "auto"))
    if cfg.semi_sync_method:  # semi-synchronous replicas: one outer optimizer, rounds of the same length
        outer = repr((cfg.semi_sync_method, max(cfg.semi_sync_steps), cfg.outer_lr, cfg.outer_momentum,
                      cfg.outer_nesterov))
        pairs += (("--semi-sync-method/-steps, --outer-lr/-momentum/-nesterov", _digest(outer)),)
    return [n for n, _ in pairs], [float(v) for _, v in pairs]


def _digest(text):
    """A 40-bit integer of text: exact in float64, so the quorum's mean of it equals it iff every replica's does."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:5], "little")


def replica_sums(chunks):
    """The gradients (ZeRO: this rank's shards) each rank sums with its counterparts in the other replicas, the
    replica's own average over its DP ranks undone first (the plan already weighed every micro-batch loss)."""
    for c in chunks:
        for grad, divisor in c.reduced_grads():
            if grad.numel():
                if divisor > 1:
                    grad.mul_(divisor)
                yield grad


def disagreement(names, mine, mean):
    """The names whose value is not the quorum's mean: where some replica differs."""
    return [n for n, a, b in zip(names, mine, mean) if a != b]


def _url(address):
    return address if "://" in address else f"http://{address}"
