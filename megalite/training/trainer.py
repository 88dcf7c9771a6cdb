"""The Trainer: a run built (setup.prepare) and its loop. Each iteration is the step between its parts' hooks
(parts.py), in the one order of their collectives; a new behaviour is a new part, not an edit of the loop."""

import dataclasses

from megalite import parallel_state as ps
from megalite.config import fail
from megalite.config.batching import BatchingConfig
from megalite.config.checkpoint import CheckpointConfig
from megalite.config.data import LoaderConfig
from megalite.config.evaluation import EvaluationConfig
from megalite.config.ft import FtConfig
from megalite.config.logging import LoggingConfig
from megalite.config.loop import LoopConfig
from megalite.config.profiling import ProfilingConfig
from megalite.batching.data_iterators import close_iterators
from megalite.batching.iteration_plan import auto_shares
from megalite.logger import TrainingWindow, print_rank_last
from megalite.optimizer.optimizer import NonFiniteGradError
from megalite.rerun import RerunExit, exit_after
from megalite.training import parts, setup, step as steps
from megalite.training.cursor import DataCursor
from megalite.training.profiler import Profiler


@dataclasses.dataclass(frozen=True)
class Step:
    """One iteration as the parts see it after the step, never changed: its plan (samples consumed before it, global
    batch, this rank's micro-batches and loss divisor), what the step returned, and what followed (LR, samples
    trained). What a part tells the parts after it (its `tell`, of the fields it `writes`) comes in a new record."""
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
        self.owns, self.forward_step_func, self.started = owns, forward_step_func, started
        self.record = record  # the caller's RunRecord (training/record.py), or None
        loop = self.loop = LoopConfig.of(args)
        if loop.deterministic_mode:
            from megalite.training.determinism import enable_deterministic
            enable_deterministic()
        sigterm = parts.SigtermFlag(loop)  # from the run's start on
        r = self.prepared = setup.prepare(args, datasets_provider, model_provider, forward_step_func, self.abort,
                                          record)
        args = r.args  # with the vocabulary the data decided (config/run.py): each part's section made of it
        self.chunks, self.optimizer, self.scheduler, self.semi, self.log = r.chunks, r.optimizer, r.scheduler, r.semi, \
            r.log
        self.start_iter = r.start_iter
        # the data's position, and the plan and DP rank the step runs by (a fault-tolerant quorum's split changes them)
        self.cursor = DataCursor(r.train_ds, r.consumed_train, LoaderConfig.of(args), r.chunks, r.plan, r.dp_rank)
        self.window = TrainingWindow(r.start_iter)
        self.evaluation = parts.Evaluation(EvaluationConfig.of(args), r, forward_step_func, self.cursor, self.window) \
            if r.valid_ds is not None or r.test_ds is not None else None
        logging, ft_cfg, checkpoint = LoggingConfig.of(args), FtConfig.of(args), CheckpointConfig.of(args)
        profiling, rank = ProfilingConfig.of(args), ps.grid_of(r.chunks).rank
        self.timers = {} if logging.log_timers_to_tensorboard else None
        auto = auto_shares(BatchingConfig.of(args), r.plan, ps.grid_of(r.chunks))
        self.ft = None
        if ft_cfg.ft_lighthouse:  # fault-tolerant replicas on torchft (training/ft.py): its quorum comes first
            from megalite.training.ft import FaultTolerance  # (semi-synchronous replicas: training/ft_rounds.py)
            from megalite.training.ft_rounds import FaultTolerantRounds
            collaborators = (r.chunks, r.optimizer, r.scheduler, self.cursor, r.converters, r.start_iter, self.abort)
            self.ft = FaultTolerance(ft_cfg, *collaborators) if self.semi is None else \
                FaultTolerantRounds(ft_cfg, self.semi, *collaborators)
        self.saver = parts.Saver(checkpoint, r, self.cursor, self.evaluation, self.ft) if checkpoint.save else None
        optional = (  # the parts' order: the order of their collectives, the same on every rank
            self.ft,
            auto is not None and parts.AutoShares(auto, self.cursor, record),
            loop.hash_interval and parts.ReplicaCheck(loop, r.chunks, r.optimizer, self.abort),
            parts.Losses(r.mcfg, self.window, ps.grid_of(r.chunks), r.aux),
            r.semi is not None and parts.SemiSync(r.semi, loop, r.chunks, self.cursor, r.scheduler, r.start_iter,
                                                  self.abort),
            loop.manual_gc and loop.manual_gc_interval and parts.ManualGC(loop.manual_gc_interval),
            parts.Logging(logging, r, self.cursor, self.window, self.timers, self.read_losses),
            self.evaluation is not None and self.evaluation.valid_ds is not None and self.evaluation,
            self.saver,
            parts.ExitRules(loop, self.saver, started, sigterm),
            profiling.profile and rank in profiling.profile_ranks and Profiler(profiling, rank))
        self.parts = [p for p in optional if p]
        parts.check_order(self.parts)  # what one part tells another: its writer first

    def abort(self, msg):
        """A run that cannot go on: one line per rank, groups released, non-zero exit."""
        if self.owns:
            ps.shutdown_distributed(barrier=False)
        fail(msg)

    def iterations(self):
        loop = self.loop
        its = range(self.start_iter + 1, loop.train_iters + 1 if not loop.skip_train else self.start_iter + 1)
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
            if self.after(it, done):
                break
        return self.finish(last)

    def after(self, it, done):
        """The parts' after hooks in their order, each handed the record as the parts before it told it; the first
        reason to stop (the parts after the one that stops are skipped)."""
        for p in self.parts:
            told = p.tell(it, done)
            if told:
                if undeclared := sorted(set(told) - set(p.writes)):
                    raise ValueError(f"{type(p).__name__} tells Step.{undeclared[0]}, which it does not declare")
                done = dataclasses.replace(done, **told)
            if why := p.after(it, done):
                return why
        return None

    def step(self, it):
        """The iteration's step; then the data position and the LR schedule move on."""
        c = self.cursor
        plan, rank = c.plan, c.rank
        timed = any(p.timed() for p in self.parts)
        s = dict(consumed=c.consumed, batch=plan.global_batch_size(c.consumed),
                 num_micro=plan.num_microbatches(c.consumed, rank), total=plan.total(c.consumed, rank),
                 idle=any(p.idle(it) for p in self.parts), timed=timed,
                 times=self.timers if self.timers is not None or not timed else {})
        reported, stepped, grad_norm = None, True, None
        if not s["idle"]:
            try:
                reported, stepped, grad_norm = steps.train_step(
                    self.forward_step_func, c.iters, self.chunks, self.optimizer, s["num_micro"], self.prepared.shape,
                    self.prepared.dtype, timers=s["times"], loss_divisor=plan.loss_divisor(c.consumed, rank),
                    sync=timed, iteration=it, vote=self.ft.vote if self.ft is not None else None,
                    rerun=self.prepared.rerun, trace=self.record.schedule if self.record is not None else None,
                    converters=self.prepared.converters)
            except steps.StepNotCommitted:
                return Step(**s, committed=False)
            except RerunExit as e:  # as Megatron: the state before this iteration saved, exit 16 / 17
                self.log.close()
                exit_after(e, (lambda: self.saver.save(it - 1)) if self.saver else None, self.prepared.checkpoints,
                           self.owns)
            except NonFiniteGradError as e:
                where = f"in {e.param}" if e.param else "on another rank (this rank's gradients are finite)"
                self.abort(f"iteration {it}: the gradient norm is {e.grad_norm} (NaN/Inf gradient {where}); stopped "
                           "before the optimizer step. Lower --lr, check the data, or use --bf16 / loss scaling")
        trained = plan.replica_samples(c.consumed, rank) if self.semi is not None and not s["idle"] and stepped else 0
        c.advance(s["batch"])
        if stepped:  # as Megatron: a skipped fp16 iteration does not advance the schedule
            self.scheduler.step(s["batch"])
        # the LR as Megatron logs it: after the scheduler step (not the decoupled LR)
        return Step(**s, reported=reported, stepped=stepped, grad_norm=grad_norm, trained=trained, lr=self.scheduler.lr)

    def read_losses(self):
        bad = self.window.read_losses()  # a NaN/Inf loss stops the run
        if bad is not None and self.loop.check_for_nan_in_loss_and_grad:
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
