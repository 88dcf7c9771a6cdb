"""One training iteration: the forward-backward over the micro-batches (the layout's schedule), gradient
finalisation and the optimizer step (train_step); the means of the reported losses over micro-batches and DP
ranks (mean_losses); the optional statistics of the log line (grad_stats)."""

import time

import torch

from megalite import parallel_state as ps
from megalite.distributed import finalize_model_grads
from megalite.distributed.collectives import (average_over_data_parallel, broadcast_from_last_rank,
                                              sum_over_data_parallel)
from megalite.distributed.finalize import scale_grads_by_token_count
from megalite.optimizer.model_stats import global_norm_and_zeros
from megalite.optimizer.qk_clip import after_step
from megalite.pipeline.schedules import run_forward_backward
from megalite.rerun import RerunStateMachine
from megalite.training.converters import converters_for


class StepNotCommitted(Exception):
    """The vote after the gradients were reduced went against this step (a fault-tolerant replica failed during it:
    training/ft.py): nothing was applied; the step is run again."""


def train_step(forward_step_func, iters, chunks, optimizer, num_microbatches, shape, dtype, *, timers=None,
               loss_divisor=None, sync=False, iteration=None, vote=None, rerun=None, trace=None, converters=None):
    """One iteration; timers gets the host-side times (sync: after a device sync, for
    --data-parallel-shares auto). vote(chunks, amaxes), between the gradients' finalisation and the optimizer step:
    False raises StepNotCommitted (fault-tolerant replicas' cross-replica reduction and commit vote; amaxes: the
    iteration's FP8 amaxes, which it reduces over the quorum too, taken into the histories only once committed).
    rerun: the run's RerunStateMachine (--rerun-mode: the iteration again on the same state, megalite/rerun.py);
    None: a disabled one, as for a step called on its own. trace: a ScheduleTrace the schedule fills
    (pipeline/run.py)."""
    if sync and ps.get_device().type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    rerun = RerunStateMachine() if rerun is None else rerun
    iters = rerun.wrap(iters)
    while rerun.should_run_forward_backward(iters, chunks, iteration):
        for c in chunks:
            c.zero_grad_buffer(iteration)
        reported = run_forward_backward(forward_step_func, iters, chunks, num_microbatches, shape, dtype,
                                        loss_scale=optimizer.loss_scale, loss_divisor=loss_divisor, trace=trace)
        rerun.validate_losses(reported)
    rerun.check_exit()  # RerunExit: before the optimizer step
    if sync and ps.get_device().type == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    finalize_model_grads(chunks)
    mcfg = chunks[0].module.config
    converters = converters_for(chunks) if converters is None else converters
    gathered = [t for c in converters for t in c.after_gradients()]
    if mcfg.calculate_per_token_loss:
        dev = ps.get_device()
        count = sum((r["lm loss"][1].to(dev) for r in reported), torch.zeros((), device=dev))  # last stage only
        scale_grads_by_token_count(chunks, count)
    if vote is not None and not vote(chunks, gathered):
        for c in converters:
            c.discard()
        raise StepNotCommitted(iteration)
    for c in converters:
        c.commit()
    stepped, grad_norm = optimizer.step()
    if mcfg.qk_clip or mcfg.log_max_attention_logit:  # MuonClip (and the logged maximum), after the update
        after_step(chunks, optimizer, stepped, clip=mcfg.qk_clip)
    if timers is not None:  # --log-timers-to-tensorboard (host-side times)
        timers.update({"forward-backward": t1 - t0, "optimizer": time.perf_counter() - t1})
    return reported, stepped, grad_norm


def mean_losses(reported, read=True, total=None, *, grid):
    """(lm loss on every rank, {key: mean} of every loss the loss function reports, e.g. "lm loss"
    and "sop loss"): means over micro-batches and DP ranks; the last pipeline stage holds them
    all, other stages get {"lm loss": ...} (the first key when there is no "lm loss").
    total: with uneven shares or micro-batch sizes, this rank's loss divisor (IterationPlan.total):
    each rank's losses are summed and divided by it, then summed over DP ranks. grid: the losses' layout."""
    dev = ps.get_device()
    out = {}
    if reported:
        keys = list(reported[0])
        if reported[0][keys[0]].numel() == 2:  # [loss sum, token count] (--calculate-per-token-loss)
            sums = torch.stack([torch.stack([r[k].float().to(dev) for k in keys]) for r in reported]).sum(0)
            sums = average_over_data_parallel(sums.reshape(-1), grid).reshape(len(keys), 2)
            vals = sums[:, 0] / sums[:, 1].clamp(min=1.0)  # sum over tokens / tokens, batch-wide
        else:
            vals = torch.stack([torch.stack([r[k].float().reshape(()).to(dev) for k in keys]) for r in reported])
            vals = (average_over_data_parallel(vals.mean(0), grid) if total is None else
                    sum_over_data_parallel(vals.sum(0) / total, grid))
        out = dict(zip(keys, vals.unbind()))  # device scalars: read when logged, no sync here
        lm = vals[keys.index("lm loss") if "lm loss" in keys else 0].reshape(1).clone()
    else:  # a stage without the loss (pipeline)
        lm = torch.zeros(1, device=dev)
    lm = broadcast_from_last_rank(lm, grid)
    if read:  # the training loop passes read=False: it reads its losses once per logging window
        lm = lm.item()
    return lm, out or {"lm loss": lm}


def grad_stats(cfg, chunks, optimizer):
    """--log-params-norm / --log-num-zeros-in-grad (cfg: the LoggingConfig; each one all-reduce over the model)."""
    out = {}
    if cfg.log_params_norm:
        if cfg.zero_stage == 3:  # the shards (whole parameters exist only while gathered)
            out["params_norm"] = global_norm_and_zeros([pc.param for pc in optimizer.pieces],
                                                       [pc.data for pc in optimizer.pieces], sharded_over_dp=True)[0]
        else:
            params = [p for c in chunks for p in c.parameters() if p.requires_grad]  # (an expert bias is no weight)
            out["params_norm"] = global_norm_and_zeros(params, params)[0]
    if cfg.log_num_zeros_in_grad:
        sharded = hasattr(optimizer, "pieces")
        params = [pc.param for pc in optimizer.pieces] if sharded else optimizer.model_params
        out["num_zeros"] = global_norm_and_zeros(params, optimizer._grads(), True, sharded)[1]
    return out
