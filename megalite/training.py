"""pretrain(): set up the grid, model, optimizer and data, then the training loop.

Entry points (pretrain_gpt.py, pretrain_bert.py) supply three functions, as in Megatron:
    datasets_provider(args, num_samples) -> (train, valid, test)   (may set args.vocab_size)
    model_provider(model_config, pre_process, post_process) -> model
    forward_step_func(data_iterator, model) -> (output, loss_func)
"""

import math
import signal
import time

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megalite import parallel_state as ps
from megalite.arguments import model_config, parse_args, training_config
from megalite.checkpointing import (
    CheckpointError,
    check_save_dir,
    finish_checkpointing,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
    unwrap_checkpoint_error,
)
from megalite.config import ConfigError, fail
from megalite.distributed import DistributedDataParallel, finalize_model_grads
from megalite.distributed.collectives import any_rank, average_over_data_parallel, broadcast_from_last_rank
from megalite.flops import num_floating_point_operations
from megalite.optimizer import LRScheduler, MixedPrecisionOptimizer
from megalite.optimizer.optimizer import NonFiniteGradError
from megalite.optimizer.distributed_optimizer import DistributedOptimizer
from megalite.pipeline.schedules import get_forward_backward_func, pipeline_tensor_shape
from megalite.tensor_parallel import model_parallel_manual_seed


_SIGTERM = {"got": False}


def _abort(msg, owns):
    """A run that cannot go on: one line per rank, groups released, non-zero exit."""
    if owns:
        ps.shutdown_distributed(barrier=False)
    fail(msg)


def print_rank_last(msg):
    """Megatron logs from the last rank: it holds the loss (last pipeline stage)."""
    if ps.global_rank() == ps.world_size() - 1:
        print(msg, flush=True)


def build_data_iterator(dataset, consumed_samples, args):
    """Yield {"text": LongTensor [micro, seq+1]} for this DP rank, resuming at consumed_samples.
    Only pipeline stages that consume tokens or labels (first and last) read data."""
    if dataset is None or not (ps.is_pipeline_first_stage(ignore_virtual=True)
                                or ps.is_pipeline_last_stage(ignore_virtual=True)):
        return None
    from megalite.data import MegatronPretrainingSampler
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, args.micro_batch_size,
                                         ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    device = ps.get_device()

    def gen():
        for indices in sampler:
            text = torch.stack([torch.as_tensor(dataset[i]["text"], dtype=torch.long) for i in indices])
            yield {"text": text.to(device, non_blocking=True)}
    return gen()


def chunk_iterators(it, num_chunks):
    """Per model chunk: the first chunk of the first stage and the last chunk of the last
    stage read the data; other chunks get None."""
    its = [None] * num_chunks
    if ps.is_pipeline_first_stage(ignore_virtual=True):
        its[0] = it
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        its[-1] = it
    return its


def build_model(mcfg, model_provider, args):
    """This rank's model chunks (v of them with interleaving), each wrapped for DP."""
    v = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    chunks = []
    for j in range(v):
        ps.set_virtual_pipeline_model_parallel_rank(j)
        m = model_provider(mcfg, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
        chunks.append(DistributedDataParallel(m, bucket_size=args.ddp_bucket_size,
                                              overlap_grad_reduce=args.overlap_grad_reduce,
                                              use_distributed_optimizer=args.use_distributed_optimizer,
                                              zero_stage=args.zero_stage or 1,
                                              overlap_param_gather=args.overlap_param_gather))
    ps.set_virtual_pipeline_model_parallel_rank(0)
    return chunks


def setup(args, model_provider):
    tcfg = training_config(args)
    mcfg = model_config(args, args.vocab_size)
    mcfg.check_parallel(ps.get_tensor_model_parallel_world_size())
    chunks = build_model(mcfg, model_provider, args)
    optimizer = (DistributedOptimizer if args.use_distributed_optimizer else MixedPrecisionOptimizer)(chunks, tcfg)
    scheduler = LRScheduler(optimizer, tcfg.lr, tcfg.min_lr, tcfg.lr_warmup_iters,
                            tcfg.lr_decay_iters or tcfg.train_iters, tcfg.lr_decay_style)
    return mcfg, tcfg, chunks, optimizer, scheduler


def checkpoint_setup(chunks, optimizer, scheduler, mcfg, args):
    """Check --save early; load --load. Returns (iteration, consumed train, consumed valid) or None."""
    if args.save:
        check_save_dir(args.save)
        if not args.load and read_tracker(args.save) is not None:
            args.load = args.save  # a restarted job resumes by itself (torchrun --max-restarts)
    if not args.load:
        return None
    try:
        loaded = load_checkpoint(chunks, optimizer, scheduler, mcfg, args)
    except CheckpointException as e:  # DCP wraps every rank's error; ours is one line
        raise unwrap_checkpoint_error(e) from None
    if loaded is None and args.exit_on_missing_checkpoint:
        raise CheckpointError(f"--load {args.load} holds no checkpoint and --exit-on-missing-checkpoint is set")
    if loaded is not None:
        print_rank_last(f"megalite: loaded checkpoint from {args.load} at iteration {loaded[0]}")
    return loaded


def _fwd_bwd(forward_step_func, iters, chunks, num_microbatches, shape, dtype, **kw):
    fwd_bwd = get_forward_backward_func()
    model = chunks if len(chunks) > 1 else chunks[0]
    data = iters if len(chunks) > 1 else iters[0]
    return fwd_bwd(forward_step_func, data, model, num_microbatches, tensor_shape=shape, dtype=dtype, **kw)


def train_step(forward_step_func, iters, chunks, optimizer, num_microbatches, shape, dtype):
    for c in chunks:
        c.zero_grad_buffer()
    reported = _fwd_bwd(forward_step_func, iters, chunks, num_microbatches, shape, dtype,
                        loss_scale=optimizer.loss_scale)
    finalize_model_grads(chunks)
    stepped, grad_norm = optimizer.step()
    return reported, stepped, grad_norm


def _mean_loss(reported):
    """Mean over micro-batches and DP ranks, the same number on every rank."""
    dev = ps.get_device()
    if reported:
        vals = torch.stack([r["lm loss"].float() for r in reported]).mean().reshape(1).to(dev)
        vals = average_over_data_parallel(vals)
    else:  # a stage without the loss (pipeline)
        vals = torch.zeros(1, device=dev)
    return broadcast_from_last_rank(vals).item()


def evaluate(forward_step_func, iters, chunks, num_microbatches, eval_iters, shape, dtype):
    for c in chunks:
        c.eval()
    losses = []
    with torch.no_grad():
        for _ in range(eval_iters):
            reported = _fwd_bwd(forward_step_func, iters, chunks, num_microbatches, shape, dtype, forward_only=True)
            losses.append(_mean_loss(reported))
    for c in chunks:
        c.train()
    return sum(losses) / len(losses)


def _tensorboard(args):
    """The writer on the last rank; the import is checked on every rank so all fail alike."""
    if not args.tensorboard_dir:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        fail("--tensorboard-dir needs the tensorboard package: pip install 'megalite[tensorboard]'")
    return SummaryWriter(log_dir=args.tensorboard_dir) if ps.global_rank() == ps.world_size() - 1 else None


def pretrain(datasets_provider, model_provider, forward_step_func, args=None, return_state=False):
    """Train per the command line; returns the list of per-iteration lm losses (and, with
    return_state, the model chunks and optimizer too)."""
    args = args or parse_args()
    started = time.time()
    owns = ps.initialize_distributed(args.distributed_backend, args.distributed_timeout_minutes * 60)
    if args.exit_signal_handler:
        _SIGTERM["got"] = False
        signal.signal(signal.SIGTERM, lambda *_: _SIGTERM.update(got=True))
    ps.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                 args.virtual_pipeline_model_parallel_size)
    model_parallel_manual_seed(args.seed)
    dp = ps.get_data_parallel_world_size()
    g = args.global_batch_size
    do_eval = args.eval_interval > 0 and args.eval_iters > 0  # Megatron: --eval-iters 0 turns it off
    num_samples = (args.train_iters * g,
                   (args.train_iters // args.eval_interval + 1) * args.eval_iters * g if do_eval else 0,
                   args.eval_iters * g)
    writer = _tensorboard(args)
    try:
        # Data errors are the user's (missing/foreign files, bad paths): one line each.
        train_ds, valid_ds, _ = datasets_provider(args, num_samples)
    except (ConfigError, FileNotFoundError, ValueError, RuntimeError) as e:
        _abort(str(e).splitlines()[0] if str(e) else type(e).__name__, owns)
    if not do_eval:
        valid_ds = None
    try:
        mcfg, tcfg, chunks, optimizer, scheduler = setup(args, model_provider)
        start = checkpoint_setup(chunks, optimizer, scheduler, mcfg, args)
    except (ConfigError, CheckpointError) as e:
        _abort(str(e), owns)
    start_iter, consumed_train, consumed_valid = start or (0, 0, 0)
    num_micro = tcfg.num_microbatches(dp)
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    print_rank_last(f"megalite: TP={ps.get_tensor_model_parallel_world_size()} "
                    f"PP={ps.get_pipeline_model_parallel_world_size()} DP={dp} | parameters on this rank: "
                    f"{n_params:,} | micro-batches per iteration: {num_micro}")
    train_iters = chunk_iterators(build_data_iterator(train_ds, consumed_train, args), len(chunks))
    valid_iters = chunk_iterators(build_data_iterator(valid_ds, consumed_valid, args), len(chunks))
    shape, dtype = pipeline_tensor_shape(mcfg, args.micro_batch_size), mcfg.params_dtype
    padded = getattr(chunks[0].module, "padded_vocab_size", None)
    flops_per_iter = num_floating_point_operations(mcfg, g, padded) if padded else 0.0
    losses, skipped, skipped_before, window, window_losses = [], 0, 0, start_iter, []
    saved_at = start_iter
    window_start = time.perf_counter()
    for c in chunks:
        c.train()
    for it in range(start_iter + 1, args.train_iters + 1):
        try:
            reported, stepped, grad_norm = train_step(forward_step_func, train_iters, chunks, optimizer, num_micro,
                                                      shape, dtype)
        except NonFiniteGradError as e:
            where = f"in {e.param}" if e.param else "on another rank (this rank's gradients are finite)"
            _abort(f"iteration {it}: the gradient norm is {e.grad_norm} (NaN/Inf gradient {where}); stopped before "
                   "the optimizer step. Lower --lr, check the data, or use --bf16 / loss scaling", owns)
        scheduler.step()
        lr = optimizer.param_groups[0]["lr"]  # as Megatron logs it: after the scheduler step
        loss = _mean_loss(reported)
        if args.check_for_nan_in_loss_and_grad and not math.isfinite(loss):
            _abort(f"iteration {it}: the lm loss is {loss}; stopped", owns)
        losses.append(loss)
        window_losses.append(loss)  # the forward's loss is valid even when the step was skipped
        skipped += 0 if stepped else 1
        if it % args.log_interval == 0 or it == args.train_iters:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            elapsed = (time.perf_counter() - window_start) / (it - window)
            tflops = flops_per_iter / (elapsed * ps.world_size()) / 1e12
            shown = sum(window_losses) / len(window_losses) if window_losses else float("nan")
            gn = f"{grad_norm:.3f}" if grad_norm is not None else "nan"
            print_rank_last(
                f" iteration {it:8d}/{args.train_iters:8d} | consumed samples: {it * g:12d} | "
                f"elapsed time per iteration (ms): {elapsed * 1000:.1f} | "
                f"throughput per GPU (TFLOP/s/GPU): {tflops:.3f} | learning rate: {lr:.6E} | "
                f"global batch size: {g:5d} | lm loss: {shown:.6E} | loss scale: {optimizer.loss_scale:.1f} | "
                f"grad norm: {gn} | number of skipped iterations: {skipped - skipped_before:3d} |")
            if writer is not None:
                writer.add_scalar("lm loss", shown, it)
                writer.add_scalar("learning-rate", lr, it)
                writer.add_scalar("loss-scale", optimizer.loss_scale, it)
                if grad_norm is not None:
                    writer.add_scalar("grad-norm", grad_norm, it)
            window, window_losses, skipped_before = it, [], skipped
            window_start = time.perf_counter()
        if valid_ds is not None and it % args.eval_interval == 0:
            v = evaluate(forward_step_func, valid_iters, chunks, num_micro, args.eval_iters, shape, dtype)
            print_rank_last(f" validation loss at iteration {it} | lm loss value: {v:.6E} | "
                            f"lm loss PPL: {math.exp(min(v, 20)):.6E} |")
            consumed_valid += args.eval_iters * g
        if args.save and args.save_interval and it % args.save_interval == 0:
            save_checkpoint(it, chunks, optimizer, scheduler, mcfg, args, it * g, consumed_valid)
            saved_at = it
        if args.exit_interval and it % args.exit_interval == 0:
            if args.save and saved_at != it:
                save_checkpoint(it, chunks, optimizer, scheduler, mcfg, args, it * g, consumed_valid)
                saved_at = it
            print_rank_last(f"megalite: exiting at iteration {it} (--exit-interval {args.exit_interval})")
            break
        if args.exit_signal_handler or args.exit_duration_in_mins:
            why = "SIGTERM received" if _SIGTERM["got"] else "--exit-duration-in-mins reached" if \
                args.exit_duration_in_mins and time.time() - started > 60 * args.exit_duration_in_mins else None
            if any_rank(why is not None):  # every rank stops at the same iteration
                if args.save and saved_at != it:
                    save_checkpoint(it, chunks, optimizer, scheduler, mcfg, args, it * g, consumed_valid)
                    saved_at = it
                print_rank_last(f"megalite: exiting at iteration {it} ({why or 'another rank asked to stop'})")
                break
    for c in chunks:
        c.finish_param_sync()  # --overlap-param-gather: the last step's all-gathers
    last = start_iter + len(losses)
    if args.save and saved_at != last:  # as Megatron: the final state is saved too
        save_checkpoint(last, chunks, optimizer, scheduler, mcfg, args, last * g, consumed_valid)
    finish_checkpointing()
    if losses:
        print_rank_last(f"megalite: done {last} iterations | first lm loss {losses[0]:.4f} | "
                        f"last lm loss {losses[-1]:.4f}")
    if writer is not None:
        writer.close()
    if owns and not return_state:
        ps.shutdown_distributed()  # a finished job exits 0: no communication thread left behind
    return (losses, chunks, optimizer) if return_state else losses
