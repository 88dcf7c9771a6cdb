"""The parts of a training run: each optional behaviour of the loop, with the hooks the Trainer calls around every
iteration (trainer.py). A part's `after` issues its collectives, if any, so every rank must call the parts in one
order: `Trainer.parts` is that order (DESIGN: the same collectives on every rank). A new behaviour is a new part.

    before(it)             before the iteration's step (an asynchronous replica's new slot)
    tell(it, step) -> dict what the part tells the parts after it: values of the Step fields it `writes`
    after(it, step) -> why the iteration done (step: trainer.Step); a reason to stop the run after it, or None
    iterations(its)        the loop's iterations (the asynchronous replicas' come from their slots)
    idle(it)               this rank sits the iteration out (a replica of fewer inner steps)
    timed()                the step is to be timed on the device's clock (--data-parallel-shares auto)
    finish(last) -> last   after the loop (the last iteration run, possibly moved)
"""

import gc
import os
import signal
import time

import torch

import kernels
from megalite import parallel_state as ps
from megalite.checkpoint.manager import save_checkpoint
from megalite.batching.data_iterators import close_iterators, data_iterators
from megalite.distributed.collectives import any_rank
from megalite.distributed.replica_check import replicas_differ
from megalite.planner.flops import num_floating_point_operations
from megalite.logger import print_rank_last
from megalite.training.auxiliary_losses import auxiliary_losses
from megalite.training.evaluation import evaluate
from megalite.training.step import grad_stats, mean_losses


class Part:
    """A behaviour of the loop. What a part tells the parts after it passes through a field of the iteration's Step
    (trainer.py, immutable: `tell` gives the values, the Trainer hands the parts after it a new record), declared:
    the part that tells it names it in `writes`, a part that reads it in `reads`, and check_order holds every reader
    after its writers."""
    writes = ()
    reads = ()

    def before(self, it):
        pass

    def tell(self, it, step):
        return {}

    def after(self, it, step):
        return None

    def iterations(self, its):
        return its

    def idle(self, it):
        return False

    def timed(self):
        return False

    def finish(self, last):
        return last


def check_order(parts):
    """ValueError where a part reads a Step field that a part after it writes (it would read last iteration's, or
    nothing)."""
    written, writers = set(), {f: type(p).__name__ for p in parts for f in p.writes}
    for p in parts:
        if early := [f for f in p.reads if f in writers and f not in written]:
            raise ValueError(f"{type(p).__name__} reads Step.{early[0]}, which {writers[early[0]]} writes after it")
        written |= set(p.writes)


class AutoShares(Part):
    """--data-parallel-shares auto: the first iterations timed, then each DP replica's micro-batches set by its
    speed (megalite/batching/iteration_plan.py), and the data read on by the new counts."""

    def __init__(self, auto, cursor, record):
        self.auto, self.cursor, self.record = auto, cursor, record  # record: the caller's RunRecord, or None

    def timed(self):
        return not self.auto.done

    def after(self, it, step):
        if step.timed and (chosen := self.auto.observe(step.times["forward-backward"], step.num_micro, step.consumed)):
            print_rank_last(f"megalite: --data-parallel-shares auto: ms per micro-batch by DP replica "
                            f"{', '.join(f'{1e3 * t:.1f}' for t in chosen[0])} -> micro-batches per iteration "
                            f"{','.join(map(str, chosen[1]))} from iteration {it + 1}")
            self.cursor.rebuild()  # (the cursor stands past this iteration)
            if self.record is not None:
                self.record.shares = chosen


class ReplicaCheck(Part):
    """--check-weight-hash-across-dp-replicas-interval (every iteration under --test-mode): the DP replicas'
    weights (fp32 main weights where replicas compute in different precisions) compared."""

    def __init__(self, loop, chunks, optimizer, abort):
        """loop: the LoopConfig (config/loop.py)."""
        self.every, self.tp_too, self.chunks, self.abort = loop.hash_interval, loop.test_mode, chunks, abort
        self.compared = dict(zip(optimizer.model_params, optimizer.main_params)) \
            if loop.data_parallel_precisions else None

    def after(self, it, step):
        if it % self.every == 0 and (drifted := replicas_differ(self.chunks, tp_too=self.tp_too, values=self.compared)):
            self.abort(f"iteration {it}: replicas hold different weights ({', '.join(drifted[:3])}"
                       f"{', ...' if len(drifted) > 3 else ''}): a gradient reduction or a device is faulty")


class Losses(Part):
    """The iteration's losses (lm loss on every rank; the routers' and DSA's on the last stage) into the window
    the log line reads."""
    reads = ("across",)  # fault-tolerant replicas: the mean over the quorum

    def __init__(self, mcfg, window, grid, aux):
        self.mcfg, self.window, self.grid, self.aux = mcfg, window, grid, aux  # aux: the chunks' AuxLossTracker

    def after(self, it, step):
        if step.idle:
            return
        # lm loss (every rank); all (last)
        loss, means = mean_losses(step.reported, read=False, total=step.total, grid=self.grid)
        if step.across is not None:  # fault-tolerant replicas: the mean over the quorum (one collective)
            parts = [loss, *means.values()]
            flat = step.across(torch.cat([v.detach().float().reshape(-1) for v in parts]))
            parts = [f.view_as(v).to(v.dtype) for f, v in zip(flat.split([v.numel() for v in parts]), parts)]
            loss, means = parts[0], dict(zip(means, parts[1:]))
        # the MoE routers', DSA's and MTP's (collective)
        aux = auxiliary_losses(self.mcfg, step.num_micro, step.total, self.grid, self.aux)
        if aux and self.grid.last_stage():  # the stage that logs every loss
            means = {**means, **aux}
        self.window.add(loss, means, step.stepped)


class SemiSync(Part):
    """Semi-synchronous (and asynchronous) replicas: their iterations, idle ticks, outer steps and slots
    (megalite/distributed/semi_sync*.py)."""

    def __init__(self, semi, loop, chunks, cursor, scheduler, start_iter, abort):
        """loop: the LoopConfig (the run's length, the replicas' weight checks)."""
        self.semi, self.loop, self.chunks, self.cursor, self.scheduler, self.start, self.abort = \
            semi, loop, chunks, cursor, scheduler, start_iter, abort

    def iterations(self, its):
        return self.semi.iterations(its)

    def idle(self, it):
        return not self.semi.trains(it)  # a replica of fewer inner steps waits for the round's end

    def before(self, it):
        if (slot := self.semi.slot_start(it)) is not None:  # asynchronous: a slot's data and LR
            consumed, rank = slot
            self.cursor.rebuild(consumed, rank)
            self.scheduler.step(consumed - self.scheduler.num_steps)

    def after(self, it, step):
        semi = self.semi
        if not semi.after_iteration(it, step.trained):
            return
        # an outer step: the replicas hold the same weights
        if semi.check_due(it, self.loop.hash_interval) and (drifted := replicas_differ(self.chunks,
                                                                                        across_replicas=True)):
            self.abort(f"iteration {it}: semi-synchronous replicas differ after the outer step ({drifted[0]})")
        if (line := semi.announcement(it)) is not None:  # --semi-sync-steps auto's choice
            print_rank_last(line)
        if semi.H < semi.round and it < self.loop.train_iters:
            self.cursor.rebuild()  # past idle ticks

    def finish(self, last):
        if self.semi.asynchronous and last > self.start:  # every replica holds the final weights
            last, self.cursor.consumed = self.loop.train_iters, self.loop.train_iters * self.loop.global_batch_size
            self.scheduler.step(self.cursor.consumed - self.scheduler.num_steps)
        return last


class ManualGC(Part):
    """--manual-gc-interval: collections at the same iterations on every rank (as Megatron)."""

    def __init__(self, interval):
        self.interval = interval

    def after(self, it, step):
        if it % self.interval == 0:
            gc.collect()


class Logging(Part):
    """The log line every --log-interval iterations (and at the last), with TensorBoard / W&B / JSON; after the
    first iteration, once, the kernels' measured choices (kernels/choice.py: those made in setup, and those the
    first iteration made on this rank), when any was measured."""

    def __init__(self, cfg, prepared, cursor, window, timers, read_losses):
        """cfg: the LoggingConfig; prepared: the run (its chunks, optimizer, model config, metrics logger); window: the
        losses and times since the last line; timers: --log-timers-to-tensorboard's, or None; read_losses: the
        window's losses read (the run stops on a NaN one)."""
        self.cfg, self.run, self.cursor, self.window, self.timers, self.read_losses = \
            cfg, prepared, cursor, window, timers, read_losses
        self.padded = getattr(prepared.chunks[0].module, "padded_vocab_size", None)
        self.kernels_said = False

    def after(self, it, step):
        if not it % self.cfg.log_interval or it == self.cfg.train_iters:
            self.log(it, step)
        if not self.kernels_said:
            self.kernels_said = True
            line = kernels.choice.summary()
            if line:
                print_rank_last(line)

    def log(self, it, step):
        cfg, run = self.cfg, self.run
        self.read_losses()
        f = self.window.close(it)
        flops = num_floating_point_operations(run.mcfg, step.batch, self.padded) if self.padded else 0.0
        run.log.iteration(it, {**f, "consumed": self.cursor.consumed, "batch_size": step.batch, "lr": step.lr,
                               "tflops": flops / (f["elapsed"] * ps.grid_of(run.chunks).world_size()) / 1e12,
                               "loss_scale": run.optimizer.loss_scale, "grad_norm": step.grad_norm,
                               "timers": self.timers, "max_attention_logit": getattr(
                                   run.optimizer, "max_attention_logit", None) if cfg.log_max_attention_logit else None,
                               **grad_stats(cfg, run.chunks, run.optimizer)})
        self.window.restart()


class Evaluation(Part):
    """Validation every --eval-interval iterations (not counted as iteration time), and the validation and test
    sets after training (as Megatron)."""

    def __init__(self, cfg, prepared, forward_step_func, cursor, window):
        """cfg: the EvaluationConfig; prepared: the run (its splits, chunks, evaluation plan, metrics logger,
        semi-synchronous replicas); cursor: where training stands (its DP rank); window: the training times,
        evaluation's taken out."""
        self.cfg, self.run, self.forward_step_func, self.cursor, self.window = \
            cfg, prepared, forward_step_func, cursor, window
        r = prepared
        self.valid_ds, self.test_ds, self.consumed, self.g = r.valid_ds, r.test_ds, r.consumed_valid, r.eval_g
        self.mbs, self.plan, self.shape = r.eval_mbs, r.eval_plan, r.eval_shape
        self.micro, self.total = r.eval_plan.num_microbatches(0, r.dp_rank), r.eval_plan.total(0, r.dp_rank)
        # The validation set is sized for every evaluation of a run; a resumed run's extra final
        # evaluation (or --skip-train) starts again from its beginning.
        ds = self.valid_ds
        self.loader = cfg.loader
        self.valid_iters = data_iterators(ds, self.consumed % len(ds) if ds is not None and len(ds) else 0,
                                          self.loader, r.chunks, self.mbs, self.plan)

    def evaluate(self, its):
        cfg, run = self.cfg, self.run
        if cfg.manual_gc and cfg.manual_gc_eval:
            gc.collect()
        out = evaluate(self.forward_step_func, its, run.chunks, self.micro, cfg.eval_iters, self.shape, run.dtype,
                       self.total)
        if run.semi is not None:  # every replica evaluated the global weights on its part of the batches
            out = run.semi.combine(out, self.plan.replica_samples(0, self.cursor.rank))
        if cfg.manual_gc and cfg.manual_gc_eval:
            gc.collect(generation=0)  # what the evaluation made
        return out

    def after(self, it, step):
        if self.valid_ds is None or not self.cfg.eval_interval or it % self.cfg.eval_interval:
            return
        t = time.perf_counter()
        self.run.log.evaluation(it, "validation", self.evaluate(self.valid_iters))
        self.consumed += self.cfg.eval_iters * self.g
        self.window.t0 += time.perf_counter() - t  # as Megatron: evaluation is not iteration time

    def final(self, last):
        for split, ds in (("validation", self.valid_ds), ("test", self.test_ds)):
            if ds is not None:
                its = self.valid_iters if split == "validation" else \
                    data_iterators(ds, 0, self.loader, self.run.chunks, self.mbs, self.plan)
                self.run.log.evaluation(last, split, self.evaluate(its), final=True)
                close_iterators(its)


class Saver(Part):
    """--save: every --save-interval iterations, and the final state (as Megatron, a loaded state is saved again
    at the end when --save is another directory: nothing trained is a re-shard into this run's layout)."""

    def __init__(self, cfg, prepared, cursor, evaluation, ft):
        """cfg: the CheckpointConfig (config/checkpoint.py); prepared: the run (its state, checkpoint writer, what
        it loaded); cursor: the training samples consumed; evaluation: the Evaluation part (validation samples
        consumed), or None; ft: fault-tolerant replicas (one live replica writes), or None."""
        self.cfg, self.run, self.cursor, self.evaluation, self.ft = cfg, prepared, cursor, evaluation, ft
        start, same = prepared.start_iter, os.path.realpath(cfg.save or "") == os.path.realpath(prepared.load or "")
        self.saved_at = start if not start or same else -1

    def save(self, it):
        r = self.run
        if self.ft is not None and not self.ft.writes_checkpoints():
            self.saved_at = it
            return
        save_checkpoint(it, r.chunks, r.optimizer, r.scheduler, r.mcfg, self.cfg, self.cursor.consumed,
                        self.evaluation.consumed if self.evaluation is not None else r.consumed_valid,
                        io=r.checkpoints)
        self.saved_at = it

    def after(self, it, step):
        if self.cfg.save_interval and it % self.cfg.save_interval == 0:
            self.save(it)

    def finish(self, last):
        if self.saved_at != last:  # as Megatron: the final state is saved too
            self.save(last)
        return last


class SigtermFlag:
    """--exit-signal-handler: a SIGTERM from the run's start on is remembered here (ExitRules stops at the next
    iteration's end)."""

    def __init__(self, loop):
        self.got = False
        if loop.exit_signal_handler:
            signal.signal(signal.SIGTERM, self._received)

    def _received(self, *_):
        self.got = True


class ExitRules(Part):
    """--exit-interval, --exit-signal-handler (SIGTERM), --exit-duration-in-mins: the state saved (with --save),
    then the run stops; every rank at the same iteration."""

    def __init__(self, loop, saver, started, sigterm):
        """loop: the LoopConfig; saver: the Saver part, or None; started: the run's start (time.time());
        sigterm: the run's SigtermFlag."""
        self.loop, self.saver, self.started, self.sigterm = loop, saver, started, sigterm

    def _stop(self, it, why):
        if self.saver is not None and self.saver.saved_at != it:
            self.saver.save(it)
        print_rank_last(f"megalite: exiting at iteration {it} ({why})")
        return why

    def after(self, it, step):
        loop = self.loop
        if loop.exit_interval and it % loop.exit_interval == 0:
            return self._stop(it, f"--exit-interval {loop.exit_interval}")
        if loop.exit_signal_handler or loop.exit_duration_in_mins:
            why = "SIGTERM received" if self.sigterm.got else "--exit-duration-in-mins reached" if \
                loop.exit_duration_in_mins and time.time() - self.started > 60 * loop.exit_duration_in_mins else None
            if any_rank(why is not None):  # every rank stops at the same iteration
                return self._stop(it, why or "another rank asked to stop")
        return None
