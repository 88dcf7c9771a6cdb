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
ordinary run bit for bit.

Streaming DiLoCo (--semi-sync-fragments / -fragment-delay / -fragment-alpha): the same update per fragment of
contiguous layers at staggered iterations, optionally applied `delay` iterations after its all-reduce started
and mixed into the local weights; --semi-sync-quantize sends the contributions as bf16 / fp8 payloads
(quantize.py), all-gathered and summed in replica order. --semi-sync-steps auto times the first round."""

import re
import time

import torch
import torch.distributed as dist

from megalite import parallel_state as ps
from megalite.distributed import comm, quantize


BUCKET = 1 << 24  # elements per outer all-reduce


class SemiSync:
    def __init__(self, cfg, optimizer, chunks=()):
        """cfg: the SemiSyncConfig (config/semi_sync.py)."""
        self.method, self.optimizer = cfg.semi_sync_method, optimizer
        # MoE routers' expert biases (--moe-router-enable-expert-bias): moved by token counts, not gradients,
        # so no pseudo-gradient; each outer step sets them to the replicas' sample-weighted mean (Local SGD's rule)
        self.biases = [m.expert_bias for c in chunks for m in c.modules()
                       if getattr(m, "expert_bias", None) is not None]
        optimizer.semi_sync = self  # the optimizer carries the outer state it belongs to (tests read it there)
        self.grid = ps.grid_of(chunks)  # the replicas' groups: the chunks' grid
        self.replicas, self.replica = self.grid.replicas, self.grid.replica_rank
        self.steps = list(cfg.semi_sync_steps)
        self.H, self.round = self.steps[self.replica], max(self.steps)
        self.lr, self.momentum, self.nesterov = cfg.outer_lr, cfg.outer_momentum, cfg.outer_nesterov
        self.train_iters = cfg.train_iters
        self.reset_global()
        self.buf = None  # the outer momentum, per main parameter (torch's SGD: created at the first step)
        self.samples = 0  # what this replica trained on since the last outer step
        self.outer_steps = self.bytes_sent = 0
        self.auto = cfg.semi_sync_auto  # time the first round, then set the counts
        self.step_times, self.last_tick, self.chosen = [], None, None
        # Streaming: fragments of contiguous layers, each synced at its own offset in the round, its all-reduce
        # overlapping `delay` inner steps and then mixed in with weight alpha for the local weights
        self.fragments = cfg.semi_sync_fragments
        self.delay = cfg.semi_sync_fragment_delay
        self.alpha = cfg.semi_sync_fragment_alpha
        names = getattr(optimizer, "names", [""] * len(self.glob))
        params = [pc.param for pc in optimizer.pieces] if hasattr(optimizer, "pieces") else \
            getattr(optimizer, "model_params", [None] * len(self.glob))
        self.frag_of = [0 if getattr(p, "shared_embedding", False) else  # the last stage's tied copy: as the first's
                        fragment_of(n, cfg.num_layers, self.fragments) for n, p in zip(names, params)]
        self.frag_samples, self.pending = [0] * self.fragments, []
        self.frag_syncs = [0] * self.fragments  # outer syncs per fragment (bytes: quantize.payload_bytes or 4 x n)
        self.quantize = cfg.semi_sync_quantize  # bf16 / fp8 payloads, all-gathered (quantize.py)
        # fault-tolerant replicas (training/ft_rounds.py): each replica its own job; sums run over torchft's quorum
        # (across.sum) and an outer step is applied only when the quorum's vote commits it (across.outer)
        self.across, self.last_total = None, 0.0

    asynchronous = False  # (semi_sync_async.py's subclass: slots instead of rounds)

    def begin(self, start_iter):
        """Before the loop, after a checkpoint load (the asynchronous mode starts its server here)."""

    def iterations(self, its):
        """The loop's iterations (the asynchronous mode's come from its slots)."""
        return its

    def slot_start(self, it):
        """The asynchronous mode's new slot at `it`: (samples before it, the DP rank whose part it reads)."""
        return None

    def check_due(self, it, every):
        """Whether a cross-replica check (every `every` iterations) fell in the round that ended at `it`."""
        return bool(every) and it // every != (it - self.round) // every

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

    def offset(self, f):
        """Fragment f's outer steps: the iterations it % round == offset (the last at the round's end)."""
        return ((f + 1) * self.round // self.fragments) % self.round

    @property
    def streaming(self):
        return self.fragments > 1 or self.delay > 0 or self.alpha > 0

    def after_iteration(self, it, trained_samples):
        """Count this replica's samples; at the end of a round (or of training) the outer step.
        Returns whether an outer step left every replica on the global weights."""
        if self.streaming:
            return self._streaming_iteration(it, trained_samples)
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
        def attempt():
            return self._start(range(len(self.glob)), self.samples)
        started = attempt() if self.across is None else self.across.outer(attempt)
        if started is None:  # fault tolerance: healed meanwhile to a peer's state after this outer step
            self.samples = 0
            return
        self._finish(started, alpha=0.0)
        self._average_biases(started["frac"])
        self.samples, self.outer_steps = 0, self.outer_steps + 1

    @torch.no_grad()
    def _streaming_iteration(self, it, trained):
        """Fragments: start each due fragment's all-reduce, finish those started `delay` iterations ago
        (mixing in with alpha); at the last iteration everything is finished and every fragment synced at
        once, unmixed, so training ends on the global weights."""
        self.frag_samples = [n + trained for n in self.frag_samples]
        last = it == self.train_iters
        for p in [p for p in self.pending if p["at"] == it or last]:
            self.pending.remove(p)
            self._finish(p, alpha=self.alpha)
        due = range(self.fragments) if last else [f for f in range(self.fragments) if it % self.round == self.offset(f)]
        for f in due:
            idx = [i for i, g in enumerate(self.frag_of) if g == f]
            p = self._start(idx, self.frag_samples[f], async_op=not last and self.delay > 0)
            self.frag_samples[f], p["at"], p["fragment"] = 0, it + (0 if last else self.delay), f
            if p["at"] == it:
                self._finish(p, alpha=0.0 if last else self.alpha)
            else:
                self.pending.append(p)
        if last or (due and self.offset(due[-1]) == 0):
            self.outer_steps += 1
        return last

    def _start(self, idx, samples, async_op=False):
        """This rank's weighted contribution for the main params idx, summed over the replicas (async_op:
        returned with the pending work)."""
        mains, group = self.optimizer.main_params, self.grid.replica_group
        frac, parts = self._weight(group, samples), []
        for f in {self.frag_of[i] for i in idx}:
            self.frag_syncs[f] += 1
        for b in _buckets([mains[i].numel() for i in idx]):
            ids = [idx[j] for j in b]
            local = torch.cat([mains[i].detach().reshape(-1).double() for i in ids])
            glob = torch.cat([self.glob[i].reshape(-1).double() for i in ids])
            mine = self._contribution(local, glob)
            total, works = mine * frac if frac != 1.0 else mine, []
            if group is not None and self.quantize:  # every replica's payload, summed after dequantizing
                total, works = self._gather_quantized(total, group, async_op)
            elif self.across is not None:
                total = self.across.sum(total.float())
            elif group is not None:
                total = total.float()
                works = [comm.all_reduce(total, group=group, async_op=async_op)]  # (counted with the DP collectives)
                self.bytes_sent += total.numel() * total.element_size()
            parts.append((ids, total, works))
        return {"parts": parts, "frac": frac}

    def _gather_quantized(self, total, group, async_op):
        payload, scale = quantize.quantize(total, self.quantize)
        out = [torch.empty(self.replicas * payload.numel(), dtype=torch.uint8, device=payload.device), None]
        works = [comm.all_gather(out[0], payload, group=group, async_op=async_op)]
        if scale is not None:
            out[1] = torch.empty(self.replicas * scale.numel(), dtype=scale.dtype, device=scale.device)
            works.append(comm.all_gather(out[1], scale, group=group, async_op=async_op))
        self.bytes_sent += quantize.payload_bytes(total.numel(), self.quantize)
        return ("quantized", out, total.numel()), works

    def _received(self, total):
        """The summed contributions: the all-reduced fp32 tensor, or the replicas' dequantized payloads
        summed in replica order (the same on every rank)."""
        if not (isinstance(total, tuple) and total[0] == "quantized"):
            return total.double()
        (payloads, scales), n = total[1], total[2]
        pays = payloads.view(self.replicas, -1)
        sc = scales.view(self.replicas, -1) if scales is not None else [None] * self.replicas
        out = torch.zeros(n, dtype=torch.float64, device=payloads.device)
        for r in range(self.replicas):
            out += quantize.dequantize(pays[r], sc[r], self.quantize, n)
        return out

    def _finish(self, pending, alpha):
        """The outer update of the params of a started all-reduce; the local weights become alpha x local +
        (1 - alpha) x the new global weights."""
        mains = self.optimizer.main_params
        if self.buf is None and self.momentum:
            self.buf = [None] * len(mains)
        for ids, total, works in pending["parts"]:
            for work in works:
                if work is not None:
                    work.wait()
            total = self._received(total)
            glob = torch.cat([self.glob[i].reshape(-1).double() for i in ids])
            new = total if self.method == "local_sgd" else glob - self.lr * self._direction(ids, total)
            sizes = [mains[i].numel() for i in ids]
            mixed = new.split(sizes)
            if alpha:
                local = torch.cat([mains[i].detach().reshape(-1).double() for i in ids])
                mixed = (alpha * local + (1 - alpha) * new).split(sizes)
            for i, part, mine in zip(ids, new.split(sizes), mixed):
                self.glob[i].copy_(part.view_as(self.glob[i]))
                mains[i].copy_(mine.view_as(mains[i]) if alpha else self.glob[i])
        self.optimizer.publish_main_params()

    def _average_biases(self, frac):
        """The expert biases: sum_r w_r bias_r in float64, one all-reduce over the replicas."""
        group = self.grid.replica_group
        if not self.biases or (group is None and self.across is None):
            return
        flat = torch.cat([b.detach().reshape(-1).double() for b in self.biases]) * frac
        if self.across is not None:
            self.across.sum(flat)
        else:
            dist.all_reduce(flat, group=group)
        for b, part in zip(self.biases, flat.split([b.numel() for b in self.biases])):
            b.data.copy_(part.view_as(b))

    def _weight(self, group, samples):
        """This replica's weight: its samples since the last outer step over all replicas' (one all-reduce)."""
        w = torch.tensor([float(samples)], dtype=torch.float64, device=ps.get_device())
        if self.across is not None:
            self.across.sum(w)
        elif group is not None:
            dist.all_reduce(w, group=group)
        self.last_total = w.item()
        return samples / w.item() if w.item() > 0 else 1.0 / self.replicas

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
            self.buf[i] = part.float().view_as(self.glob[i])  # (float() copies out of the float64 buffer)
        return g + self.momentum * buf if self.nesterov else buf

    def combine(self, values, weight):
        """{key: value} of this replica (evaluation) -> the weight-averaged values over the replicas."""
        group = self.grid.replica_group
        if group is None or not values:
            return values
        keys = list(values)
        t = torch.tensor([float(values[k]) * weight for k in keys] + [float(weight)], dtype=torch.float64,
                         device=ps.get_device())
        dist.all_reduce(t, group=group)
        return {k: (t[i] / t[-1]).item() for i, k in enumerate(keys)}


def fragment_of(name, num_layers, fragments):
    """The fragment of a parameter (by its global name): transformer layer i of L in fragment i K // L; the
    embeddings in the first, everything after the layers (final norm, output layer) in the last."""
    m = _LAYER.search(name)
    if m:
        return int(m.group(1)) * fragments // max(num_layers, 1)
    return 0 if "embedding" in name else fragments - 1


_LAYER = re.compile(r"layers\.(\d+)\.")


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
