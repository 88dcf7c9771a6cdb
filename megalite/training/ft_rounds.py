"""Semi-synchronous replicas under faults (--ft-lighthouse with --semi-sync-method local_sgd | diloco): each
fault-tolerant replica (its own job) is one semi-synchronous replica, as torchft's DiLoCo does it.

- At every round's start a quorum (torchft's Lighthouse): a replica that starts heals from a live peer (the global
  weights and the outer optimizer's state, with what a synchronous heal sends: optimizer state, LR schedule,
  iteration, samples consumed, RNG), and the round's global batches are split over the live replicas by their
  --ft-replica-share.
- The round's H inner steps touch no other replica (each replica's losses and gradients over its own samples).
- The outer step (distributed/semi_sync.py) sums the replicas' sample-weighted contributions over that quorum and
  is applied only when torchft's vote commits it. A replica that died during the round makes the vote fail: the
  survivors form a quorum of themselves (shrink_only: a newcomer waits for the next round's start) and run the
  outer step again, weighted by the samples they trained. The dead replica's inner steps are lost, and the log says
  how many samples that was; it heals at the next round's start.
"""

import torch

from megalite.training.ft import FaultTolerance, replica_sums


class FaultTolerantRounds(FaultTolerance):
    writes = ()  # the logged losses are this replica's own (its part of each batch), as semi-synchronous replicas log
    def __init__(self, cfg, semi, *collaborators):
        """semi: the replica's semi-synchronous outer steps; the rest: FaultTolerance's."""
        super().__init__(cfg, *collaborators)
        self.semi = semi
        self.semi.across = self
        self.phase, self.current, self.round_first, self.join_outer = "start", None, None, False
        self.ahead = False  # healed during an outer step's retry: that quorum was the peers' next round's

    def plan_replicas(self, replicas):
        """Each replica's micro-batch losses weighed against its own part of the batch (its inner steps are its
        own)."""
        return replicas

    def iterations(self, its):
        """The iterations, a quorum before each round's first (which may heal this replica to a later round)."""
        its = list(its)
        it, end, H = (its[0], its[-1], self.semi.round) if its else (1, 0, 1)
        while it <= end:
            if (it - 1) % H == 0:
                if not self.ahead:
                    self._round_quorum()
                self.ahead = False
                if self.healed is not None:
                    it, self.healed = self.healed + 1, None
                    if self.join_outer:  # healed in the middle of the peers' outer step: take part in it
                        self.join_outer = False
                        self.semi.outer_step()
                        continue  # then the next round's quorum, with them
                self.round_first = it
            if it > end:
                break
            self.current = it
            yield it
            self.done, it = it, it + 1

    def _round_quorum(self):
        """A quorum that holds (a replica dying meanwhile, or a heal source dying mid-transfer: again)."""
        self.phase = "start"
        while True:
            self._quorum()
            if self.manager.errored() is None:
                return

    def vote(self, chunks, amaxes=()):
        """An inner step: no other replica takes part (its FP8 histories are its own, as a semi-synchronous
        replica's); the replica's own reduction averaged over its DP ranks what the plan already weighed over the
        replica's samples, so that average is undone."""
        for _ in replica_sums(chunks):
            pass
        return True

    def tell(self, it, step):
        return {}

    def after(self, it, step):
        pass  # (nothing timed: --ft-replica-share auto is refused with semi-synchronous replicas)

    def sum(self, t):
        """t summed over the quorum, in place (after a failure: no-op, and the vote will not commit)."""
        self.manager.allreduce(t, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        return t

    def outer(self, attempt):
        """The outer step's reductions (attempt()) until the quorum commits them; what they returned, or None when
        this replica was healed meanwhile to a peer that had already applied this outer step."""
        self.phase, replicas = "outer", self.manager.num_participants()
        while True:
            started = attempt()
            if self.manager.should_commit():
                break
            self.leave_reduction()
            self._quorum(shrink_only=True)  # the survivors (a newcomer joins at the next round)
            if self.healed is not None:  # a peer had committed it: this was its next round's quorum
                self.phase, self.ahead = "start", True
                return None
        self.phase = "start"
        self._report_lost(replicas)
        return started

    def _report_lost(self, replicas):
        planned = (self.current - self.round_first + 1) * self.cfg.global_batch_size if self.current else 0
        trained, now = int(round(self.semi.last_total)), self.manager.num_participants()
        if now < replicas and trained < planned:
            print(f"megalite: fault tolerance: the outer step at iteration {self.current} ran over {now} of the "
                  f"round's {replicas} replicas; {planned - trained} of its {planned} samples were lost with the "
                  f"replicas that left (replica {self.cfg.ft_replica_id})", flush=True)

    def _state(self):
        sd = super()._state()
        s = self.semi
        if self.phase == "outer":  # this round trained (the cursor and schedule past it), its outer step pending
            sd["iteration"] = self.current
        sd["outer"] = {"glob": s.glob, "buf": s.buf, "outer_steps": s.outer_steps, "phase": self.phase}
        return sd

    def _load(self, sd):
        super()._load(sd)
        o, s, opt = sd["outer"], self.semi, self.optimizer
        with torch.no_grad():
            for g, v, m in zip(s.glob, o["glob"], opt.main_params):
                g.copy_(v)
                m.copy_(v)  # (a peer in its outer step sends its local weights: the global ones are what holds)
        opt.publish_main_params()
        s.buf = None if o["buf"] is None else [None if b is None else b.clone() for b in o["buf"]]
        s.outer_steps, s.samples, self.join_outer = o["outer_steps"], 0, o["phase"] == "outer"
