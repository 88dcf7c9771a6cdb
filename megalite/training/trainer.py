"""The Trainer: a run built (setup.prepare) and its loop. Each iteration is the step between its parts' hooks
(parts.py), in the one order of their collectives; a new behaviour is a new part, not an edit of the loop."""

import dataclasses

from megalite import parallel_state as ps
from megalite.config import fail
from megalite.config.batching import BatchingConfig
from megalite.config.checkpoint import CheckpointConfig
from megalite.config.data import LoaderConfig
from megalite.config.ft import FtConfig
from megalite.batching.data_iterators import close_iterators
from megalite.batching.iteration_plan import auto_shares
from megalite.logger import TrainingWindow, print_rank_last
from megalite.optimizer.optimizer import NonFiniteGradError
from megalite.rerun import RerunExit, exit_after
from megalite.training import parts, setup, step as steps
from megalite.training.cursor import DataCursor


@dataclasses.dataclass
class Step:
    """One iteration as the parts see it after the step: its plan (samples consumed before it, global batch,
    this rank's micro-batches and loss divisor), what the step returned, and what followed (LR, samples trained)."""
    consumed: int
    batch: int
    num_micro: int
    total: object
    idle: bool
    timed: bool
    times: dict
    reported: list = None
    stepped: bool = True
    grad_norm: object = None
    trained: int = 0
    lr: float = None
    committed: bool = True  # fault-tolerant replicas: False when the quorum voted the step away (it runs again)
    across: object = None  # fault-tolerant replicas: averages a tensor over the quorum (the logged losses)


class Trainer:
    def __init__(self, datasets_provider, model_provider, forward_step_func, args, started, owns, record=None):
        self.args, self.owns, self.forward_step_func, self.started = args, owns, forward_step_func, started
        self.record = record  # the caller's RunRecord (training/record.py), or None
        if args.deterministic_mode:
            from megalite.training.determinism import enable_deterministic
            enable_deterministic()
        sigterm = parts.SigtermFlag(args)  # from the run's start on
        r = self.prepared = setup.prepare(args, datasets_provider, model_provider, forward_step_func, self.abort,
                                          record)
        args = self.args = r.args  # with the vocabulary the data decided (config/run.py)
        self.chunks, self.optimizer, self.scheduler, self.semi, self.log = r.chunks, r.optimizer, r.scheduler, r.semi, \
            r.log
        self.start_iter = r.start_iter
        # the data's position, and the plan and DP rank the step runs by (a fault-tolerant quorum's split changes them)
        self.cursor = DataCursor(r.train_ds, r.consumed_train, LoaderConfig.of(args), r.chunks, r.plan, r.dp_rank)
        self.window = TrainingWindow(r.start_iter)
        self.evaluation = parts.Evaluation(args, r, forward_step_func, self.cursor, self.window) \
            if r.valid_ds is not None or r.test_ds is not None else None
        self.timers = {} if args.log_timers_to_tensorboard else None
        auto = auto_shares(BatchingConfig.of(args), r.plan, ps.grid_of(r.chunks))
        self.ft = None
        if args.ft_lighthouse:  # fault-tolerant replicas on torchft (training/ft.py): its quorum comes first
            from megalite.training.ft import FaultTolerance  # (semi-synchronous replicas: training/ft_rounds.py)
            from megalite.training.ft_rounds import FaultTolerantRounds
            collaborators = (r.chunks, r.optimizer, r.scheduler, self.cursor, r.converters, r.start_iter, self.abort)
            ft_cfg = FtConfig.of(args)
            self.ft = FaultTolerance(ft_cfg, *collaborators) if self.semi is None else \
                FaultTolerantRounds(ft_cfg, self.semi, *collaborators)
        self.saver = parts.Saver(CheckpointConfig.of(args), r, self.cursor, self.evaluation, self.ft) \
            if args.save else None
        optional = (  # the parts' order: the order of their collectives, the same on every rank
            self.ft,
            auto is not None and parts.AutoShares(auto, self.cursor, record),
            parts.hash_interval(args) and parts.ReplicaCheck(args, r.chunks, r.optimizer, self.abort),
            parts.Losses(r.mcfg, self.window, ps.grid_of(r.chunks), r.aux),
            r.semi is not None and parts.SemiSync(r.semi, args, r.chunks, self.cursor, r.scheduler, r.start_iter,
                                                  self.abort),
            args.manual_gc and args.manual_gc_interval and parts.ManualGC(args.manual_gc_interval),
            parts.Logging(args, r, self.cursor, self.window, self.timers, self.read_losses),
            self.evaluation is not None and self.evaluation.valid_ds is not None and self.evaluation,
            self.saver,
            parts.ExitRules(args, self.saver, started, sigterm))
        self.parts = [p for p in optional if p]
        parts.check_order(self.parts)  # what one part tells another: its writer first

    def abort(self, msg):
        """A run that cannot go on: one line per rank, groups released, non-zero exit."""
        if self.owns:
            ps.shutdown_distributed(barrier=False)
        fail(msg)

    def iterations(self):
        a = self.args
        its = range(self.start_iter + 1, a.train_iters + 1 if not a.skip_train else self.start_iter + 1)
        for p in self.parts:
            its = p.iterations(its)
        return its

    def train(self):
        """The loop; returns (lm losses, chunks, optimizer)."""
        for c in self.chunks:
            c.train()
        last = self.start_iter  # the last iteration run (a replica of fewer inner steps has fewer losses)
        for it in self.iterations():
            last = it
            for p in self.parts:
                p.before(it)
            done = self.step(it)
            if not done.committed:  # voted away (a replica failed): the same batch again, after a new quorum
                continue
            if any(p.after(it, done) for p in self.parts):  # (a stop skips the parts after the one that stops)
                break
        return self.finish(last)

    def step(self, it):
        """The iteration's step; then the data position and the LR schedule move on."""
        c = self.cursor
        plan, rank = c.plan, c.rank
        timed = any(p.timed() for p in self.parts)
        s = Step(c.consumed, plan.global_batch_size(c.consumed), plan.num_microbatches(c.consumed, rank),
                 plan.total(c.consumed, rank), any(p.idle(it) for p in self.parts), timed,
                 self.timers if self.timers is not None or not timed else {})
        if not s.idle:
            try:
                s.reported, s.stepped, s.grad_norm = steps.train_step(
                    self.forward_step_func, c.iters, self.chunks, self.optimizer, s.num_micro, self.prepared.shape,
                    self.prepared.dtype, timers=s.times, loss_divisor=plan.loss_divisor(c.consumed, rank), sync=timed,
                    iteration=it, vote=self.ft.vote if self.ft is not None else None, rerun=self.prepared.rerun,
                    trace=self.record.schedule if self.record is not None else None,
                    converters=self.prepared.converters)
            except steps.StepNotCommitted:
                s.committed = False
                return s
            except RerunExit as e:  # as Megatron: the state before this iteration saved, exit 16 / 17
                self.log.close()
                exit_after(e, (lambda: self.saver.save(it - 1)) if self.saver else None, self.prepared.checkpoints,
                           self.owns)
            except NonFiniteGradError as e:
                where = f"in {e.param}" if e.param else "on another rank (this rank's gradients are finite)"
                self.abort(f"iteration {it}: the gradient norm is {e.grad_norm} (NaN/Inf gradient {where}); stopped "
                           "before the optimizer step. Lower --lr, check the data, or use --bf16 / loss scaling")
        if self.semi is not None and not s.idle and s.stepped:
            s.trained = plan.replica_samples(c.consumed, rank)
        c.advance(s.batch)
        if s.stepped:  # as Megatron: a skipped fp16 iteration does not advance the schedule
            self.scheduler.step(s.batch)
        s.lr = self.scheduler.lr  # as Megatron logs it: after the scheduler step (not the decoupled LR)
        return s

    def read_losses(self):
        bad = self.window.read_losses()  # a NaN/Inf loss stops the run
        if bad is not None and self.args.check_for_nan_in_loss_and_grad:
            self.abort(f"iteration {bad[0]}: the lm loss is {bad[1]}; stopped")

    def finish(self, last):
        self.read_losses()  # a loop left early (exit flags) still reports every loss
        for c in self.chunks:
            c.finish_param_sync()  # --overlap-param-gather: the last step's all-gathers
        for p in self.parts:
            last = p.finish(last)
        self.prepared.checkpoints.close()
        losses = self.window.losses
        if losses:
            print_rank_last(f"megalite: done {last} iterations | first lm loss {losses[0]:.4f} | "
                            f"last lm loss {losses[-1]:.4f}")
        if self.evaluation is not None:  # as Megatron, after training: the validation and test sets
            self.evaluation.final(last)
            self.evaluation.valid_iters = None
        close_iterators(self.cursor.iters)  # the data loaders' worker processes end now, not when a collection
        self.cursor.iters = None            # finds them
        self.log.close()
        return losses, self.chunks, self.optimizer
