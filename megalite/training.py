"""pretrain(): set up the grid, model, optimizer and data, then the training loop.

Entry points (pretrain_gpt.py, pretrain_bert.py) supply three functions, as in Megatron:
    datasets_provider(args, num_samples) -> (train, valid, test)   (may set args.vocab_size)
    model_provider(model_config, pre_process, post_process) -> model
    forward_step_func(data_iterator, model) -> (output, loss_func)
"""

import gc
import os
import signal
import time

import torch

from megalite import parallel_state as ps
from megalite.arguments import parse_args
from megalite.checkpointing import CheckpointError, finish_checkpointing, save_checkpoint
from megalite.config import ConfigError, fail
from megalite.data_iterators import build_data_iterator, chunk_iterators, data_iterators  # noqa: F401  (mfu.py)
from megalite.distributed import finalize_model_grads
from megalite.distributed.finalize import scale_grads_by_token_count
from megalite.distributed.collectives import any_rank
from megalite.distributed.replica_check import replicas_differ
from megalite.distributed.semi_sync_async import semi_sync_for
from megalite.optimizer.qk_clip import after_step
from megalite.evaluation import dataset_sizes, eval_batch, evaluate, mean_losses, report_splits, run_forward_backward
from megalite.flops import num_floating_point_operations
from megalite.iteration_plan import auto_shares, batch_schedule, evaluation_plan, training_plan
from megalite.logger import MetricsLogger, TrainingWindow, print_rank_last
from megalite.moe_logging import auxiliary_losses
from megalite.optimizer.model_stats import global_norm_and_zeros
from megalite.optimizer.optimizer import NonFiniteGradError
from megalite.pipeline.schedules import pipeline_tensor_shape
from megalite.rerun import RerunExit, exit_after, get_rerun_state_machine, initialize_rerun_state_machine
from megalite.tensor_parallel import model_parallel_manual_seed
from megalite.training_setup import (align_main_weights, build_model, build_scheduler,  # noqa: F401  (tests)
                                     checkpoint_setup, setup)


_SIGTERM = {"got": False}
# Words in the errors gloo / NCCL / the store raise when a peer is gone or too slow.
COMMUNICATION_ERRORS = ("Timed out", "timed out", "Connection closed", "Connection reset", "NCCL", "gloo",
                        "Broken pipe", "Socket Timeout")


def _abort(msg, owns):
    """A run that cannot go on: one line per rank, groups released, non-zero exit."""
    if owns:
        ps.shutdown_distributed(barrier=False)
    fail(msg)


def train_step(forward_step_func, iters, chunks, optimizer, num_microbatches, shape, dtype, timers=None,
               loss_divisor=None, sync=False, iteration=None):
    """One iteration; timers gets the host-side times (sync: after a device sync, for
    --data-parallel-shares auto)."""
    if sync and ps.get_device().type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    rerun = get_rerun_state_machine()  # --rerun-mode: the iteration again on the same state (megalite/rerun.py)
    iters = rerun.wrap(iters)
    while rerun.should_run_forward_backward(iters, chunks, iteration):
        for c in chunks:
            c.zero_grad_buffer(iteration)
        reported = run_forward_backward(forward_step_func, iters, chunks, num_microbatches, shape, dtype,
                                        loss_scale=optimizer.loss_scale, loss_divisor=loss_divisor)
        rerun.validate_losses(reported)
    rerun.check_exit()  # RerunExit: before the optimizer step
    if sync and ps.get_device().type == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    finalize_model_grads(chunks)
    mcfg = chunks[0].module.config
    if mcfg.calculate_per_token_loss:
        dev = ps.get_device()
        count = sum((r["lm loss"][1].to(dev) for r in reported), torch.zeros((), device=dev))  # last stage only
        scale_grads_by_token_count(chunks, count)
    stepped, grad_norm = optimizer.step()
    if mcfg.qk_clip or mcfg.log_max_attention_logit:  # MuonClip (and the logged maximum), after the update
        after_step(chunks, optimizer, stepped, clip=mcfg.qk_clip)
    if timers is not None:  # --log-timers-to-tensorboard (host-side times)
        timers.update({"forward-backward": t1 - t0, "optimizer": time.perf_counter() - t1})
    return reported, stepped, grad_norm


def _grad_stats(args, chunks, optimizer):
    """--log-params-norm / --log-num-zeros-in-grad (each one all-reduce over the model)."""
    out = {}
    if args.log_params_norm:
        if args.zero_stage == 3:  # the shards (whole parameters exist only while gathered)
            out["params_norm"] = global_norm_and_zeros([pc.param for pc in optimizer.pieces],
                                                       [pc.data for pc in optimizer.pieces], sharded_over_dp=True)[0]
        else:
            params = [p for c in chunks for p in c.parameters() if p.requires_grad]  # (an expert bias is no weight)
            out["params_norm"] = global_norm_and_zeros(params, params)[0]
    if args.log_num_zeros_in_grad:
        sharded = hasattr(optimizer, "pieces")
        params = [pc.param for pc in optimizer.pieces] if sharded else optimizer.model_params
        out["num_zeros"] = global_norm_and_zeros(params, optimizer._grads(), True, sharded)[1]
    return out


def pretrain(datasets_provider, model_provider, forward_step_func, args=None, return_state=False):
    """Train per the command line; returns the list of per-iteration lm losses (and, with
    return_state, the model chunks and optimizer too)."""
    args = args or parse_args()
    started = time.time()
    owns = ps.initialize_distributed(args.distributed_backend, args.distributed_timeout_minutes * 60)
    gc_enabled = gc.isenabled()
    if args.manual_gc:  # as Megatron: collections at the same iterations on every rank
        gc.disable()
        gc.collect()
    try:
        return _pretrain(datasets_provider, model_provider, forward_step_func, args, return_state, started, owns)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not any(w in str(e) for w in COMMUNICATION_ERRORS):
            raise
        # A dead or hung peer: one line (which operation, how long we waited), not a wall of C++.
        _abort(f"communication failed ({first[:300]}); a peer rank died or hung past "
               f"--distributed-timeout-minutes {args.distributed_timeout_minutes}", owns)
    finally:
        if args.manual_gc and gc_enabled:
            gc.enable()


def _pretrain(datasets_provider, model_provider, forward_step_func, args, return_state, started, owns):
    if args.deterministic_mode:
        from megalite.determinism import enable_deterministic
        enable_deterministic()
    if args.exit_signal_handler:
        _SIGTERM["got"] = False
        signal.signal(signal.SIGTERM, lambda *_: _SIGTERM.update(got=True))
    try:
        batches = batch_schedule(args)  # each iteration's global batch (ramp-up), checked
    except (ConfigError, CheckpointError) as e:
        _abort(str(e), owns)
    try:  # torchrun's LOCAL_WORLD_SIZE: the ranks of one node, for --hierarchical-grad-reduce
        ps.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                     args.virtual_pipeline_model_parallel_size, args.context_parallel_size,
                                     args.hierarchical_context_parallel_sizes, args.use_tp_pp_dp_mapping,
                                     int(os.environ.get("LOCAL_WORLD_SIZE", ps.world_size()))
                                     if args.hierarchical_grad_reduce else None,
                                     args.expert_model_parallel_size if args.num_experts else None,
                                     args.expert_tensor_parallel_size, args.semi_sync_replicas)
    except ValueError as e:
        _abort(str(e), owns)
    model_parallel_manual_seed(args.seed)
    initialize_rerun_state_machine(args)
    dp, dp_rank = args.data_parallel_size, ps.get_data_parallel_rank_across_replicas()
    plan = training_plan(args, batches)  # each DP rank's micro-batches (count, size, weight)
    log = MetricsLogger(args)
    try:
        # Data errors are the user's (missing/foreign files, bad paths): one line each.
        wanted = dataset_sizes(args, batches)
        datasets = datasets_provider(args, wanted)
    except (ConfigError, FileNotFoundError, ValueError, RuntimeError) as e:
        _abort(str(e).splitlines()[0] if str(e) else type(e).__name__, owns)
    train_ds, valid_ds, test_ds = report_splits(args, datasets, wanted)  # sizes; an empty split's skip, said once
    try:
        sizing = (train_ds, forward_step_func) if train_ds is not None and not args.skip_train else None
        mcfg, tcfg, chunks, optimizer, scheduler = setup(args, model_provider, plan, sizing)  # sizes by memory too
        semi = semi_sync_for(args, optimizer, chunks)  # replicas' outer steps (loaded too); None without
        start = checkpoint_setup(chunks, optimizer, scheduler, mcfg, args)
        align_main_weights(args, optimizer)  # replicas of different precisions: one set of fp32 main weights
        if semi is not None:
            semi.begin((start or (0,))[0])
    except (ConfigError, CheckpointError) as e:
        _abort(str(e), owns)
    start_iter, consumed_train, consumed_valid = start or (0, 0, 0)
    eval_g, eval_mbs = eval_batch(args)
    eval_plan, auto = evaluation_plan(args, plan, eval_g, eval_mbs), auto_shares(args, plan)
    eval_micro, eval_total = eval_plan.num_microbatches(0, dp_rank), eval_plan.total(0, dp_rank)
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    ramp = "" if batches.is_constant() else f" now, {args.global_batch_size // (args.micro_batch_size * dp)} at " \
        f"the full batch {args.global_batch_size}"
    counts = plan.counts(consumed_train)
    counts = f"{counts[0]}" if not plan.uneven else f"{','.join(map(str, counts))} (DP ranks' shares)" + (
        f" of {','.join(map(str, plan.micros))} samples" if plan.micros else "")
    cp = ps.get_context_parallel_world_size()
    print_rank_last(f"megalite: TP={ps.get_tensor_model_parallel_world_size()} {f'CP={cp} ' if cp > 1 else ''}"
                    f"PP={ps.get_pipeline_model_parallel_world_size()} DP={dp} | parameters on this rank: "
                    f"{n_params:,} | micro-batches per iteration: {counts}{ramp}")
    if semi is not None:
        print_rank_last(f"megalite: {semi.describe()}")
    if args.skip_train or start_iter >= args.train_iters:
        train_ds = None  # nothing left to train on: no iterator (its position may be at the end)
    train_iters = data_iterators(train_ds, consumed_train, args, chunks, plan=plan)
    # The validation set is sized for every evaluation of a run; a resumed run's extra final
    # evaluation (or --skip-train) starts again from its beginning.
    valid_pos = consumed_valid % len(valid_ds) if valid_ds is not None and len(valid_ds) else 0
    valid_iters = data_iterators(valid_ds, valid_pos, args, chunks, eval_mbs, eval_plan)
    shape, dtype = pipeline_tensor_shape(mcfg, plan.micro_of(dp_rank)), mcfg.params_dtype
    eval_shape = pipeline_tensor_shape(mcfg, eval_plan.micro_of(dp_rank))
    padded = getattr(chunks[0].module, "padded_vocab_size", None)
    window = TrainingWindow(start_iter)

    def read_losses():
        bad = window.read_losses()  # a NaN/Inf loss stops the run
        if bad is not None and args.check_for_nan_in_loss_and_grad:
            _abort(f"iteration {bad[0]}: the lm loss is {bad[1]}; stopped", owns)

    def run_eval(its):
        if args.manual_gc and args.manual_gc_eval:
            gc.collect()
        out = evaluate(forward_step_func, its, chunks, eval_micro, args.eval_iters, eval_shape, dtype, eval_total)
        if semi is not None:  # every replica evaluated the global weights on its part of the batches
            out = semi.combine(out, eval_plan.replica_samples(0, dp_rank))
        if args.manual_gc and args.manual_gc_eval:
            gc.collect(generation=0)  # what the evaluation made
        return out

    def save(it):
        save_checkpoint(it, chunks, optimizer, scheduler, mcfg, args, consumed_train, consumed_valid)
        return it

    # As Megatron, a loaded state is saved again at the end when --save is another directory
    # (nothing trained: a re-shard into this run's layout); the same directory already holds it.
    saved_at = start_iter if not start_iter or os.path.realpath(args.save or "") == os.path.realpath(args.load or "") \
        else -1
    timers = {} if args.log_timers_to_tensorboard else None
    # replicas of different precisions agree in their fp32 main weights, not in their model's
    compared = dict(zip(optimizer.model_params, optimizer.main_params)) if args.data_parallel_precisions else None
    for c in chunks:
        c.train()
    last = start_iter  # the last iteration run (a replica of fewer inner steps has fewer losses)
    its = range(start_iter + 1, args.train_iters + 1 if not args.skip_train else start_iter + 1)
    for it in semi.iterations(its) if semi is not None else its:
        last = it
        if semi is not None and (slot := semi.slot_start(it)) is not None:  # asynchronous: a slot's data and LR
            consumed_train, rank = slot
            train_iters = data_iterators(train_ds, consumed_train, args, chunks, plan=plan, rank=rank)
            scheduler.step(consumed_train - scheduler.num_steps)
        num_micro, batch = plan.num_microbatches(consumed_train, dp_rank), plan.global_batch_size(consumed_train)
        total = plan.total(consumed_train, dp_rank)  # uneven shares: losses over the replica's count
        profiling = auto is not None and not auto.done
        step_times = timers if timers is not None or not profiling else {}
        idle = semi is not None and not semi.trains(it)  # a replica of fewer inner steps waits for the round's end
        try:
            reported, stepped, grad_norm = (None, True, None) if idle else train_step(
                forward_step_func, train_iters, chunks, optimizer, num_micro, shape, dtype, step_times,
                plan.loss_divisor(consumed_train, dp_rank), profiling, it)
        except RerunExit as e:  # as Megatron: the state before this iteration saved, exit 16 / 17
            log.close()
            exit_after(e, (lambda: save(it - 1)) if args.save else None, owns)
        except NonFiniteGradError as e:
            where = f"in {e.param}" if e.param else "on another rank (this rank's gradients are finite)"
            _abort(f"iteration {it}: the gradient norm is {e.grad_norm} (NaN/Inf gradient {where}); stopped before "
                   "the optimizer step. Lower --lr, check the data, or use --bf16 / loss scaling", owns)
        if profiling and (chosen := auto.observe(step_times["forward-backward"], num_micro, consumed_train)):
            print_rank_last(f"megalite: --data-parallel-shares auto: ms per micro-batch by DP replica "
                            f"{', '.join(f'{1e3 * t:.1f}' for t in chosen[0])} -> micro-batches per iteration "
                            f"{','.join(map(str, chosen[1]))} from iteration {it + 1}")
            train_iters = data_iterators(train_ds, consumed_train + batch, args, chunks, plan=plan)
        trained = 0 if semi is None or idle or not stepped else plan.replica_samples(consumed_train, dp_rank)
        consumed_train += batch
        if stepped:  # as Megatron: a skipped fp16 iteration does not advance the schedule
            scheduler.step(batch)
        lr = scheduler.lr  # as Megatron logs it: after the scheduler step (not the decoupled LR)
        hash_every = 1 if args.test_mode else args.check_weight_hash_across_dp_replicas_interval
        if hash_every and it % hash_every == 0 and (drifted := replicas_differ(chunks, tp_too=args.test_mode,
                                                                                 values=compared)):
            _abort(f"iteration {it}: replicas hold different weights ({', '.join(drifted[:3])}"
                   f"{', ...' if len(drifted) > 3 else ''}): a gradient reduction or a device is faulty", owns)
        if not idle:
            loss, means = mean_losses(reported, read=False, total=total)  # lm loss (every rank); all (last stage)
            aux = auxiliary_losses(mcfg, num_micro, total)  # MoE routers', DSA's (collective: every rank)
            if aux and ps.is_pipeline_last_stage(ignore_virtual=True):  # the stage that logs every loss
                means = {**means, **aux}
            window.add(loss, means, stepped)
        if semi is not None and semi.after_iteration(it, trained):  # an outer step: replicas hold the same weights
            if semi.check_due(it, hash_every) and (drifted := replicas_differ(chunks, across_replicas=True)):
                _abort(f"iteration {it}: semi-synchronous replicas differ after the outer step ({drifted[0]})", owns)
            if (line := semi.announcement(it)) is not None:  # --semi-sync-steps auto's choice
                print_rank_last(line)
            if semi.H < semi.round and it < args.train_iters:
                train_iters = data_iterators(train_ds, consumed_train, args, chunks, plan=plan)  # past idle ticks
        if args.manual_gc and args.manual_gc_interval and it % args.manual_gc_interval == 0:
            gc.collect()
        if it % args.log_interval == 0 or it == args.train_iters:
            read_losses()
            f = window.close(it)
            flops = num_floating_point_operations(mcfg, batch, padded) if padded else 0.0
            log.iteration(it, {**f, "consumed": consumed_train, "batch_size": batch, "lr": lr,
                               "tflops": flops / (f["elapsed"] * ps.world_size()) / 1e12,
                               "loss_scale": optimizer.loss_scale, "grad_norm": grad_norm, "timers": timers,
                               "max_attention_logit": getattr(optimizer, "max_attention_logit", None)
                               if args.log_max_attention_logit else None,
                               **_grad_stats(args, chunks, optimizer)})
            window.restart()
        if valid_ds is not None and args.eval_interval and it % args.eval_interval == 0:
            t = time.perf_counter()
            log.evaluation(it, "validation", run_eval(valid_iters))
            consumed_valid += args.eval_iters * eval_g
            window.t0 += time.perf_counter() - t  # as Megatron: evaluation is not iteration time
        if args.save and args.save_interval and it % args.save_interval == 0:
            saved_at = save(it)
        if args.exit_interval and it % args.exit_interval == 0:
            if args.save and saved_at != it:
                saved_at = save(it)
            print_rank_last(f"megalite: exiting at iteration {it} (--exit-interval {args.exit_interval})")
            break
        if args.exit_signal_handler or args.exit_duration_in_mins:
            why = "SIGTERM received" if _SIGTERM["got"] else "--exit-duration-in-mins reached" if \
                args.exit_duration_in_mins and time.time() - started > 60 * args.exit_duration_in_mins else None
            if any_rank(why is not None):  # every rank stops at the same iteration
                if args.save and saved_at != it:
                    saved_at = save(it)
                print_rank_last(f"megalite: exiting at iteration {it} ({why or 'another rank asked to stop'})")
                break
    read_losses()  # a loop left early (exit flags) still reports every loss
    if semi is not None and semi.asynchronous and last > start_iter:  # every replica holds the final weights
        last, consumed_train = args.train_iters, args.train_iters * args.global_batch_size
        scheduler.step(consumed_train - scheduler.num_steps)
    for c in chunks:
        c.finish_param_sync()  # --overlap-param-gather: the last step's all-gathers
    losses = window.losses
    if args.save and saved_at != last:  # as Megatron: the final state is saved too
        save(last)
    finish_checkpointing()
    if losses:
        print_rank_last(f"megalite: done {last} iterations | first lm loss {losses[0]:.4f} | "
                        f"last lm loss {losses[-1]:.4f}")
    # As Megatron, after training: the validation set (where it was left) and the test set.
    for split, ds in (("validation", valid_ds), ("test", test_ds)):
        if ds is not None:
            its = valid_iters if split == "validation" else data_iterators(ds, 0, args, chunks, eval_mbs, eval_plan)
            log.evaluation(last, split, run_eval(its), final=True)
    log.close()
    if owns and not return_state:
        ps.shutdown_distributed()  # a finished job exits 0: no communication thread left behind
    return (losses, chunks, optimizer) if return_state else losses
