"""Megatron-LM's re-run state machine (megatron/core/rerun_state_machine.py): --rerun-mode
validate_results re-runs an iteration whose loss fails validation, on the same state, to tell a
transient fault from a persistent one; --error-injection-rate/-type fake such faults.

What is reproduced of Megatron's behaviour:
- Each micro-batch's local loss (last pipeline stage) is validated before the optimizer step:
  "found NaN/Inf in local forward loss calculation" (fatal; with --check-for-nan-in-loss-and-grad)
  and "Spiky loss" (>= 10x the largest of the first 100 losses; non-fatal; --check-for-spiky-loss).
  The process's first iteration is not validated (no checkpoint could be taken yet).
- A rejected result on any rank re-runs the iteration on every rank (a world all-reduce decides)
  with the same micro-batches (replayed) and the same RNG states. At the failed validation:
  * a different result: "Possible transient error!"; fatal -> exit 17 (EXIT_CODE_FAILED_ON_RESULT_
    VALIDATION, "The job can be resumed from a previous checkpoint"); non-fatal -> training goes on;
  * the same result: reproducible; fatal -> a checkpoint of the state before the iteration (with
    --save) and exit 16 (EXIT_CODE_RESUME_TO_DISAMBIGUATE); non-fatal -> training goes on.
- Injection: at each validation of an initial run, (randint(0, rate - 1) + rank) % rate == 0 injects
  a rejection (at most one per iteration); transient_error then compares as different on the re-run,
  persistent_error and correct_result as equal (they differ only on Megatron's second re-run).
- report_stats (Megatron's REPORT_DETERMINISM_STATS): every iteration runs twice and the relative
  differences of the validated results are logged every 2 iterations.
Not reproduced: the second re-run after resuming from that checkpoint on another GPU (Megatron's
verdicts "Possible persistent error" / "Correct result", exit 17): megalite's checkpoint does not
carry the machine's state, so a resumed job runs the iteration again as a first iteration.
"""

import math
import os
import random
import sys

import torch

from megalite import parallel_state as ps
from megalite.distributed.collectives import any_rank, max_per_data_parallel_rank, sum_over_data_parallel
from megalite.logger import print_rank_last
from megalite.tensor_parallel.random import get_rng_states, set_rng_states

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17
_ERROR_NAMES = {"correct_result": "Expected result", "transient_error": "Transient error",
                "persistent_error": "Persistent error"}
SPIKY_LOSS_FACTOR, SPIKY_LOSS_SAMPLES, REPORTING_INTERVAL_ITERATIONS = 10, 100, 2
NAN, INF, SPIKY = ("found NaN in local forward loss calculation", "found Inf in local forward loss calculation",
                   "Spiky loss")
MATCH, MISMATCH = 0.0, math.inf


class RerunExit(Exception):
    """Raised by train_step before the optimizer step: the loop saves (checkpoint) and exits (code)."""

    def __init__(self, code, checkpoint, message):
        super().__init__(message)
        self.code, self.checkpoint, self.message = code, checkpoint, message


def compare(a, b):
    """Megatron's _compare_floats: 0 when equal (NaN == NaN), inf when one is NaN/Inf and the other not."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return MATCH
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return MISMATCH
    return abs((a - b) / (a + b) * 2)


class ReplayIterator:
    """Megatron's RerunDataIterator: keeps the micro-batches of this iteration; rewind() replays them."""

    def __init__(self, it):
        self.it, self.saved, self.pos, self.replaying = it, [], 0, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.replaying:
            if self.pos >= len(self.saved):
                raise RuntimeError("the re-run read more micro-batches than the initial run")
            self.pos += 1
            return self.saved[self.pos - 1]
        batch = next(self.it)
        self.saved.append(dict(batch) if isinstance(batch, dict) else batch)  # a shallow copy, as Megatron
        return batch

    def rewind(self):
        self.replaying, self.pos = True, 0


class ErrorInjector:
    """Megatron's RerunErrorInjector. The draws come from a generator seeded by (--seed, pipeline
    stage, iteration): deterministic given the seed, and a resumed run draws as an uninterrupted one."""

    def __init__(self, rate=0, kind="transient_error", seed=0):
        self.rate, self.kind, self.seed = rate, kind, seed
        self.injected = None  # the kind injected and not yet resolved by a re-run
        self.rng, self.iteration = None, None

    def maybe_inject(self, iteration, rank, pp_rank):
        if self.rate <= 0 or self.injected is not None:
            return False
        if self.iteration != iteration:
            self.rng, self.iteration = random.Random(f"{self.seed}/{pp_rank}/{iteration}"), iteration
        if (self.rng.randint(0, self.rate - 1) + rank) % self.rate:
            return False
        self.injected = self.kind
        print(f"megalite: rank {rank}: Injecting error type {_ERROR_NAMES[self.kind]}", flush=True)
        return True

    def maybe_miscompare(self, comparison):
        """On the in-place re-run: an injected transient error differs (and is resolved), the others match."""
        if self.injected is None:
            return comparison
        if self.injected == "transient_error":
            self.injected = None
            return MISMATCH
        return MATCH


def _compressors(chunks):
    return list({id(c.compressor): c.compressor for c in chunks if getattr(c, "compressor", None)}.values())


def _save_model_state(chunks):
    """What a forward-backward changes outside the gradients: --grad-compression's error feedback."""
    return [(c, {k: dict(v) for k, v in vars(c).items() if isinstance(v, dict)}) for c in _compressors(chunks)]


def _reset_model_state(chunks, saved):
    """Before a re-run: the first run's reductions finished, its side effects undone (the loop zeroes grads)."""
    from megalite.moe.aux_losses import trackers
    for c in chunks:
        c.finish_grad_sync()  # overlapped bucket reductions of the first run may be in flight
    for comp, dicts in saved:
        vars(comp).update({k: dict(v) for k, v in dicts.items()})
    for t in trackers(chunks):  # the auxiliary losses recorded; the routers' token counts (expert bias) too
        t.clear()
    for c in chunks:
        for m in c.modules():
            if getattr(m, "local_tokens_per_expert", None) is not None:
                m.local_tokens_per_expert.zero_()


def _where():
    dev = ps.get_device()
    return f"Rank {ps.global_rank()}, node {os.uname()[1]}, device {dev.index if dev.type == 'cuda' else dev.type}"


class RerunStateMachine:
    """The loop (Megatron's train_step):
        iters = machine.wrap(iters)
        while machine.should_run_forward_backward(iters, chunks, iteration):
            zero grads; reported = forward-backward; machine.validate_losses(reported)
        machine.check_exit()   # raises RerunExit
    """

    def __init__(self, mode="disabled", check_nan=True, check_spiky=False, injector=None, grid=None):
        self.mode, self.check_nan, self.check_spiky = mode, check_nan, check_spiky
        self.grid = grid  # the run's layout: report_stats sums over its DP group (needed by that mode only)
        self.injector = injector or ErrorInjector()
        self.state, self.iteration, self.first_iteration_complete = "not_running", None, False
        self.max_loss, self.loss_count = 0.0, 0
        self.messages = ([NAN, INF] if check_nan else []) + ([SPIKY] if check_spiky else [])
        # report_stats, per validation: samples, identical ones, sum and max of the relative differences
        self.stats = {m: [0, 0, 0.0, 0.0] for m in self.messages}
        self._new_iteration()

    @property
    def active(self):
        """Does the loop validate at all? (disabled: megalite's own NaN stop, no per-iteration read)"""
        return self.mode != "disabled" or self.check_spiky

    @property
    def reruns(self):
        return self.mode != "disabled"

    def _new_iteration(self):
        self.rerun_requested = self.checkpoint_requested = self.continue_requested = False
        self.failed, self.initial_result, self.results = None, None, {}

    def wrap(self, iters):
        if not self.reruns:
            return iters
        wrapped = {}
        return [None if it is None else wrapped.setdefault(id(it), ReplayIterator(it)) for it in iters]

    def should_run_forward_backward(self, iters, chunks, iteration):
        if not self.reruns:  # one run
            self.iteration, self.state = iteration, "initial_run" if self.state == "not_running" else "not_running"
            return self.state == "initial_run"
        if self.state == "not_running":
            self._new_iteration()
            self.iteration, self.state = iteration, "initial_run"
            self.saved = (get_rng_states(), _save_model_state(chunks))
            return True
        if self.state == "initial_run":
            rerun = self.mode == "report_stats" or (self.mode == "validate_results" and any_rank(self.rerun_requested))
            if not rerun:
                self.state = "not_running"
                return False
            if self.mode == "validate_results":
                print_rank_last("megalite: Need to rerun step to check reproducibility of initial result")
            self.state = "rerunning_in_place"
            self._restore(iters, chunks)
            return True
        if self.state == "rerunning_in_place":
            if self.mode == "report_stats":
                self.state = "not_running"
                if iteration % REPORTING_INTERVAL_ITERATIONS == 0:
                    self._report_stats()
                return False
            if any_rank(self.continue_requested):
                print_rank_last("megalite: Continuing normal execution because failed validation was not fatal")
                self.state = "not_running"
                return False
            if any_rank(self.checkpoint_requested):
                self.state = "will_rerun_from_checkpoint"
            set_rng_states(self.saved[0])  # as Megatron: a checkpoint taken now resumes at this iteration's start
            return False
        raise RuntimeError(f"re-run state machine: unexpected state {self.state}")

    def _restore(self, iters, chunks):
        set_rng_states(self.saved[0])
        _reset_model_state(chunks, self.saved[1])
        for it in {id(i): i for i in iters if i is not None}.values():
            it.rewind()

    def check_exit(self):
        """Megatron's should_checkpoint_and_exit, as an exception for the loop."""
        self.first_iteration_complete = True
        state, self.state = self.state, "not_running"
        if state == "rerunning_in_place":
            raise RerunExit(EXIT_CODE_FAILED_ON_RESULT_VALIDATION, False,
                            "Exiting now. The job can be resumed from a previous checkpoint")
        if state == "will_rerun_from_checkpoint":
            raise RerunExit(EXIT_CODE_RESUME_TO_DISAMBIGUATE, True,
                            "Saving a checkpoint and exiting now. Please resume the job from the checkpoint to "
                            "rerun the last iteration and establish a diagnostic")

    def validate_losses(self, reported):
        """Every micro-batch's local loss (this rank's reported "lm loss", or its first loss), in order."""
        if not self.active or not reported:
            return
        key = "lm loss" if "lm loss" in reported[0] else next(iter(reported[0]))
        values = torch.stack([r[key].reshape(-1)[0].float() for r in reported]).tolist()  # one host read
        for seq, v in enumerate(values, 1):
            if self.check_nan and self.reruns:  # (disabled: megalite's own NaN stop)
                self.validate(v, math.isnan, NAN, seq, fatal=True)
                self.validate(v, math.isinf, INF, seq, fatal=True)
            if self.check_spiky:
                self.validate(v, self._is_spiky, SPIKY, seq, fatal=False)

    def _is_spiky(self, v):
        """Megatron's is_unexpectedly_large(threshold=10, context="loss"): the max of the first 100 values."""
        if math.isnan(v) or math.isinf(v):
            return False
        if self.loss_count < SPIKY_LOSS_SAMPLES:
            self.loss_count += 1
            self.max_loss = max(self.max_loss, abs(v))
            return False
        return abs(v) >= self.max_loss * SPIKY_LOSS_FACTOR

    def _log(self, msg, fatal):
        print(f"megalite: {'ERROR' if fatal else 'WARNING'}: {_where()}, iteration #{self.iteration}: {msg}!",
              flush=True)

    def validate(self, value, rejection, message, seq, fatal):
        call = (message, seq)
        if self.mode == "disabled":  # only --check-for-spiky-loss gets here: a warning
            if rejection(value):
                print(f"megalite: WARNING: {_where()}, iteration {self.iteration}: Unexpected result {value} "
                      f"(message='{message}')", flush=True)
            return
        if self.mode == "report_stats":
            if self.state == "initial_run":
                self.results[call] = value
            elif self.state == "rerunning_in_place":
                d, st = compare(self.results[call], value), self.stats[message]
                st[:] = [st[0] + 1, st[1] + (d == 0), st[2] + d, max(st[3], d)]
            return
        if self.state == "initial_run" and not self.rerun_requested:
            if not self.first_iteration_complete:
                return
            if self.injector.maybe_inject(self.iteration, ps.global_rank(), ps.get_pipeline_model_parallel_rank()) \
                    or rejection(value):
                self.failed, self.initial_result, self.rerun_requested = call, value, True
                print(f"megalite: ERROR: Unexpected result {value} on rank {ps.global_rank()} at iteration "
                      f"#{self.iteration} invocation #{seq} (message='{message}')", flush=True)
        elif self.state == "rerunning_in_place" and call == self.failed:
            if self.injector.maybe_miscompare(compare(self.initial_result, value)) > 0.0:  # tolerance 0
                self.continue_requested = not fatal
                self._log("First rerun: unexpected result is not reproducible within the tolerance "
                          f"({value} != {self.initial_result})", fatal)
                self._log("Possible transient error!", fatal)
            else:
                self.checkpoint_requested, self.continue_requested = fatal, not fatal
                self._log("First rerun: unexpected result is reproducible within the tolerance "
                          f"({value} = {self.initial_result}). Need to rerun on a different GPU to verify "
                          "correctness.", fatal)

    def _report_stats(self):
        """Every rank takes part: sums over the DP group, maxima over the world; the last rank prints."""
        if not self.messages:
            return
        sums = sum_over_data_parallel(torch.tensor([self.stats[m][k] for m in self.messages for k in range(3)],
                                                   dtype=torch.float64, device=ps.get_device()), self.grid).tolist()
        print_rank_last("megalite: Stats on computation determinism in validation calls")
        for i, m in enumerate(self.messages):
            n, same, total = sums[3 * i:3 * i + 3]
            top = max(max_per_data_parallel_rank(self.stats[m][3], self.grid))
            line = f"{int(n):,} samples, all identical" if n == same else \
                f"{int(n):,}/{int(same):,} total/identical samples, rel. variability: avg= {total / n:.3E}, " \
                f"max: {top:.3E}"
            print_rank_last(f"megalite:   From validation call '{m}':\nmegalite:     {line}")


def initialize_rerun_state_machine(cfg, grid):
    """From its RerunConfig (config/rerun.py; setup makes the run's one, once the grid exists; the Trainer hands it
    to each step)."""
    injector = ErrorInjector(cfg.error_injection_rate, cfg.error_injection_type, cfg.seed)
    m = RerunStateMachine(cfg.rerun_mode, cfg.check_for_nan_in_loss_and_grad, cfg.check_for_spiky_loss, injector,
                          grid)
    if cfg.rerun_mode != "disabled":
        inject = f"; injecting {cfg.error_injection_type} at 1 in {cfg.error_injection_rate} validations" \
            if cfg.error_injection_rate > 0 and cfg.rerun_mode == "validate_results" else ""
        print_rank_last(f"megalite: RerunStateMachine initialized in mode {cfg.rerun_mode}{inject}")
        if cfg.rerun_mode == "validate_results":
            print_rank_last("megalite: Result validation enabled")
    return m


def exit_after(e, save, checkpoints, owns):
    """RerunExit in the loop: the checkpoint (save: a function, None without --save; checkpoints: the run's
    CheckpointIO, closed after it), the message, the exit."""
    print_rank_last(f"megalite: {e.message}" + ("" if not e.checkpoint or save else " (no --save: nothing saved)"))
    if e.checkpoint and save is not None:
        save()
    checkpoints.close()
    if owns:
        ps.shutdown_distributed()
    sys.exit(e.code)
