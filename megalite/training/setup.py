"""Building what a run trains: the grid, the data, the model chunks wrapped for data parallelism, the optimizer,
the LR schedule, and the state loaded from --load (prepare: everything a Trainer holds; trainer.py runs the loop)."""

import contextlib
import dataclasses
import inspect
import os

from torch.distributed.checkpoint.api import CheckpointException

import kernels
from megalite import parallel_state as ps
from megalite.config.from_flags import ddp_config, model_config, training_config
from megalite.checkpoint.megatron import is_megatron_checkpoint
from megalite.checkpoint.manager import (CheckpointError, check_save_dir, load_checkpoint, read_tracker,
                                         unwrap_checkpoint_error)
from megalite.checkpoint.writer import CheckpointIO
from megalite.moe.aux_losses import share_tracker
from megalite.config import ConfigError
from megalite.distributed import DistributedDataParallel
from megalite.distributed.semi_sync_async import semi_sync_for
from megalite.batching.iteration_plan import batch_schedule, evaluation_plan, reduces_once, training_plan
from megalite.logger import MetricsLogger, print_rank_last
from megalite.training.memory_budget import fit_to_budget, report_fit
from megalite.config.from_flags import with_rank_precision
from megalite.optimizer import LRScheduler, MixedPrecisionOptimizer
from megalite.optimizer.distributed_optimizer import DistributedOptimizer
from megalite.optimizer.lr_scheduler import schedule_steps, weight_decay_schedule, wsd_steps
from megalite.parallel.pipeline_stages import placement_of
from megalite.pipeline.schedules import pipeline_tensor_shape
from megalite.rerun import initialize_rerun_state_machine
from megalite.tensor_parallel import model_parallel_manual_seed
from megalite.config.batching import BatchingConfig
from megalite.config.checkpoint import CheckpointConfig
from megalite.config.compression import GradCompressionConfig
from megalite.config.evaluation import EvaluationConfig
from megalite.config.kernels import KernelConfig
from megalite.config.loop import LoopConfig
from megalite.config.mixed_gpu import MixedGpuConfig
from megalite.config.parallel import ParallelConfig
from megalite.config.logging import LoggingConfig
from megalite.config.pipeline import AutoLayoutConfig
from megalite.config.rerun import RerunConfig
from megalite.config.semi_sync import SemiSyncConfig
from megalite.training.converters import converters_for
from megalite.training.evaluation import dataset_sizes, report_splits
from megalite.training.kernel_choice import decide_kernels
from megalite.training.prepared import PreparedRun


def prepare(args, datasets_provider, model_provider, forward_step_func, abort, record=None):
    """Everything a run holds before its first iteration, a PreparedRun (training/prepared.py): the grid
    initialised and seeded, the batch schedule and the DP ranks' plan, the datasets, the model, optimizer and
    schedule (loaded from --load), the semi-synchronous replicas' outer state, the evaluation plan and the tensor
    shapes the schedules send.
    abort(message): a user's error (flags, files, sizes) ends the run in one line on every rank."""
    try:
        batching = BatchingConfig.of(args)  # (the data's provider changes none of these)
        batches = batch_schedule(batching)  # each iteration's global batch (ramp-up), checked
    except (ConfigError, CheckpointError) as e:
        abort(str(e))
    parallel = ParallelConfig.of(args)
    try:
        initialize_grid(parallel)
    except ValueError as e:
        abort(str(e))
    model_parallel_manual_seed(parallel.seed)
    kernels.set_self_check("off" if KernelConfig.of(args).no_kernel_self_check else "cuda")
    r = PreparedRun(args=args, batches=batches, dp_rank=ps.get_data_parallel_rank_across_replicas())
    # --rerun-mode: the run's one, handed to each step
    r.rerun = initialize_rerun_state_machine(RerunConfig.of(args), ps.current_grid())
    r.checkpoints = CheckpointIO()  # the checkpoint group and async writer: the run's, closed at its end
    r.plan = training_plan(batching, batches)  # each DP rank's micro-batches (count, size, weight)
    r.log = MetricsLogger(LoggingConfig.of(args))
    loop = LoopConfig.of(args)
    try:
        # Data errors are the user's (missing/foreign files, bad paths): one line each.
        evaluation = EvaluationConfig.of(args)
        wanted = dataset_sizes(evaluation, batches)
        draft = args.draft()  # Megatron's contract: the provider may set the vocab size (config/run.py)
        datasets = datasets_provider(draft, wanted)
        r.args = args = args.with_data(draft)
        evaluation = EvaluationConfig.of(args)  # (with the data's paths)
    except (ConfigError, FileNotFoundError, ValueError, RuntimeError) as e:
        abort(str(e).splitlines()[0] if str(e) else type(e).__name__)
    # sizes; an empty split's skip, said once
    r.train_ds, r.valid_ds, r.test_ds = report_splits(evaluation, datasets, wanted)
    try:
        sizing = (r.train_ds, forward_step_func) if r.train_ds is not None and not loop.skip_train else None
        # (sized by memory too)
        r.mcfg, r.tcfg, r.chunks, r.optimizer, r.scheduler = setup(args, model_provider, r.plan, sizing, record)
        r.aux = share_tracker(r.chunks)  # one record of the auxiliary losses for this rank's chunks (the log line)
        r.converters = converters_for(r.chunks)  # what changes how the layers compute (FP8): the step's hooks
        for converter in r.converters:
            converter.set_plan(r.plan, r.mcfg.calculate_per_token_loss)
        # replicas' outer steps (loaded too); None without
        r.semi = semi_sync_for(SemiSyncConfig.of(args), r.optimizer, r.chunks)
        checkpoint = CheckpointConfig.of(args)
        r.load = load_root(checkpoint)
        start = checkpoint_setup(r.chunks, r.optimizer, r.scheduler, r.mcfg, checkpoint, r.load, r.checkpoints)
        # replicas of different precisions: one set of fp32 main weights
        align_main_weights(loop.data_parallel_precisions, r.optimizer)
        if r.semi is not None:
            r.semi.begin((start or (0,))[0])
    except (ConfigError, CheckpointError) as e:
        abort(str(e))
    r.start_iter, r.consumed_train, r.consumed_valid = start or (0, 0, 0)
    r.eval_g, r.eval_mbs = evaluation.batch
    r.eval_plan = evaluation_plan(batching, r.plan, r.eval_g, r.eval_mbs, evaluation.eval_micro_batch_sizes)
    grid = ps.grid_of(r.chunks)
    r.shape, r.dtype = pipeline_tensor_shape(r.mcfg, r.plan.micro_of(r.dp_rank), grid), r.mcfg.params_dtype
    r.eval_shape = pipeline_tensor_shape(r.mcfg, r.eval_plan.micro_of(r.dp_rank), grid)
    _describe(batching, r)
    if loop.skip_train or r.start_iter >= loop.train_iters:
        r.train_ds = None  # nothing left to train on: no iterator (its position may be at the end)
    return r


def initialize_grid(cfg):
    """The global grid of a ParallelConfig (torchrun's LOCAL_WORLD_SIZE: the ranks of one node, for
    --hierarchical-grad-reduce); ValueError for sizes the world cannot hold."""
    ps.initialize_model_parallel(
        cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size,
        context_parallel_size=cfg.context_parallel_size,
        hierarchical_context_parallel_sizes=cfg.hierarchical_context_parallel_sizes,
        use_tp_pp_dp_mapping=cfg.use_tp_pp_dp_mapping,
        ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", ps.world_size())) if cfg.hierarchical_grad_reduce
        else None,
        expert_model_parallel_size=cfg.expert_model_parallel_size if cfg.num_experts else None,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel_size, replicas=cfg.semi_sync_replicas,
        pipeline_placement=placement_of(cfg.pipeline_schedule))


def _describe(batching, r):
    """The run's one-line summary (grid, parameters, micro-batches per iteration) and the replicas' own."""
    dp, g = batching.data_parallel_size, batching.global_batch_size
    n_params = sum(p.numel() for c in r.chunks for p in c.parameters())
    ramp = "" if r.batches.is_constant() else f" now, {g // (batching.micro_batch_size * dp)} at the full batch {g}"
    counts = r.plan.counts(r.consumed_train)
    counts = f"{counts[0]}" if not r.plan.uneven else f"{','.join(map(str, counts))} (DP ranks' shares)" + (
        f" of {','.join(map(str, r.plan.micros))} samples" if r.plan.micros else "")
    cp = ps.get_context_parallel_world_size()
    print_rank_last(f"megalite: TP={ps.get_tensor_model_parallel_world_size()} {f'CP={cp} ' if cp > 1 else ''}"
                    f"PP={ps.get_pipeline_model_parallel_world_size()} DP={dp} | parameters on this rank: "
                    f"{n_params:,} | micro-batches per iteration: {counts}{ramp}")
    if r.semi is not None:
        print_rank_last(f"megalite: {r.semi.describe()}")


def build_model(mcfg, model_provider, args, plan=None):
    """This rank's model chunks (v of them with interleaving), each wrapped for DP (plan: the
    IterationPlan, whose shares set how the DP reduction weighs; default equal shares)."""
    grid = ps.current_grid()
    v = grid.vpp or 1
    chunks = []
    from megalite.distributed.grad_compression import build_compressor
    compression, ddp = GradCompressionConfig.of(args), ddp_config(args)
    compressor = build_compressor(compression.grad_compression, compression.grad_compression_ratio,
                                  compression.grad_compression_start_iter, compression.seed)
    for j in range(v):
        # ZeRO-3: parameters built on the meta device; each rank makes only its shards (O(shard))
        with ps.meta_init() if ddp.use_distributed_optimizer and ddp.zero_stage == 3 else contextlib.nullcontext():
            m = provide(model_provider, mcfg, grid.first_stage() and j == 0, grid.last_stage() and j == v - 1, grid, j)
        chunks.append(DistributedDataParallel(m, ddp, grid=grid,
                                              grad_divisor=plan.grad_divisor if plan else None,
                                              reduce_once=reduces_once(BatchingConfig.of(args), plan),
                                              compressor=compressor))
    return chunks


def provide(model_provider, config, pre, post, grid, vp_stage):
    """model_provider(config, pre, post, grid=, vp_stage=) as Megatron's builders take them; a provider of
    (config, pre, post) alone builds chunk vp_stage from the grid's virtual rank, set while it runs."""
    params = inspect.signature(model_provider).parameters
    anything = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kw = {k: v for k, v in (("grid", grid), ("vp_stage", vp_stage)) if k in params or anything}
    if "vp_stage" in kw:
        return model_provider(config, pre, post, **kw)
    grid.virtual_rank = vp_stage
    try:
        return model_provider(config, pre, post, **kw)
    finally:
        grid.virtual_rank = 0


def setup(args, model_provider, plan=None, sizing=None, record=None):
    """The model chunks, optimizer and LR schedule. sizing: (training dataset, forward_step_func), for
    --pipeline-model-parallel-layout auto (megalite/pipeline/auto_layout.py: the model rebuilt at the
    measured cut) and --data-parallel-micro-batch-sizes / --optimizer-offload-fraction auto
    (megalite/training/memory_budget.py: the plan's sizes chosen, the optimizer rebuilt with the chosen
    offload), before training."""
    # --data-parallel-precisions: this replica's dtype builds its model and optimizer
    rank_args = with_rank_precision(args, ps.get_data_parallel_rank_across_replicas())
    tcfg, mixed, layout = training_config(rank_args), MixedGpuConfig.of(args), AutoLayoutConfig.of(args)
    if mixed.optimizer_offload_fraction == "auto":
        tcfg = dataclasses.replace(tcfg, optimizer_offload_fraction=0.0)  # measured without offload first
    mcfg = model_config(rank_args)
    mcfg.check_parallel(ps.get_tensor_model_parallel_world_size())
    chunks = build_model(mcfg, model_provider, args, plan)
    decide_kernels(KernelConfig.of(args), mcfg, ps.current_grid())  # before anything runs the model (below)
    zero = ddp_config(args).use_distributed_optimizer
    optimizer = build_optimizer(zero, chunks, tcfg)
    from megalite.pipeline import auto_layout
    if layout.pipeline_model_parallel_layout == "auto" and sizing is not None:
        stages, counts = auto_layout.measure_and_choose(layout, plan, mcfg, chunks, optimizer, *sizing)
        auto_layout.report(stages, counts)
        rebuilt = tuple(counts) != mcfg.pipeline_layout
        if record is not None:
            record.layout, record.rebuilt = (stages, counts), rebuilt
        if rebuilt:  # rebuilt at the cut (initialisation is layout-independent)
            del chunks, optimizer
            auto_layout.free_memory()  # (DDP's gradient hooks hold reference cycles: the old model goes now)
            mcfg.pipeline_layout = tuple(counts)  # (the model's; the flags stay what the user gave)
            chunks = build_model(mcfg, model_provider, args, plan)
            optimizer = build_optimizer(zero, chunks, tcfg)
    elif layout.pipeline_model_parallel_layout == "auto":
        print_rank_last("megalite: --pipeline-model-parallel-layout auto: no training to profile (--skip-train or no "
                        f"training data): the near-even split '{auto_layout.layout_string(mcfg.pipeline_layout)}' "
                        "stays")
    if sizing is not None and "auto" in (mixed.data_parallel_micro_batch_sizes, mixed.optimizer_offload_fraction):
        fraction, profile, budget = fit_to_budget(mixed, plan, mcfg, chunks, optimizer, *sizing)
        if record is not None:
            record.memory = (profile, budget, list(plan.micros) if plan.micros else plan.micros, fraction)
        if fraction:
            tcfg = dataclasses.replace(tcfg, optimizer_offload_fraction=fraction)
            optimizer.release_model_params()
            optimizer = build_optimizer(zero, chunks, tcfg)
        report_fit(mixed, plan, fraction, profile, budget, ps.grid_of(chunks))
    return mcfg, tcfg, chunks, optimizer, build_scheduler(optimizer, tcfg)


def build_optimizer(distributed, chunks, tcfg):
    """ZeRO's DistributedOptimizer (distributed: --use-distributed-optimizer), else the replicated one."""
    return (DistributedOptimizer if distributed else MixedPrecisionOptimizer)(chunks, tcfg)


def build_scheduler(optimizer, tcfg):
    """Megatron's schedule in samples; --skip-train without a length takes the checkpoint's."""
    if tcfg.train_iters is None and tcfg.train_samples is None:
        warmup, decay, use_checkpoint, wsd, wd = 0, 1, True, 1, None
    else:
        (warmup, decay), use_checkpoint = schedule_steps(tcfg), tcfg.use_checkpoint_opt_param_scheduler
        wsd, wd = wsd_steps(tcfg), weight_decay_schedule(tcfg)
    return LRScheduler(optimizer, tcfg.lr, tcfg.min_lr, warmup, decay, tcfg.lr_decay_style, tcfg.lr_warmup_init,
                       use_checkpoint, tcfg.override_opt_param_scheduler, legacy_step=tcfg.global_batch_size,
                       decoupled=(tcfg.decoupled_lr, tcfg.decoupled_min_lr), wsd=(wsd, tcfg.lr_wsd_decay_style),
                       weight_decay=wd)


def load_root(cfg):
    """What this run loads (cfg: its CheckpointConfig): --load, or --save when it already holds a checkpoint (a
    restarted job resumes by itself: torchrun --max-restarts); None for neither. Checks --save early."""
    if cfg.save:
        check_save_dir(cfg.save)
        if not cfg.load and read_tracker(cfg.save) is not None:
            return cfg.save
    return cfg.load


def checkpoint_setup(chunks, optimizer, scheduler, mcfg, cfg, root, io):
    """Load `root` (load_root's) over io (the run's CheckpointIO) as cfg (the CheckpointConfig) says. Returns
    (iteration, consumed train, consumed valid) or None."""
    if not root:
        return None
    megatron = is_megatron_checkpoint(root)  # a Megatron-LM torch_dist directory: converted per node, then loaded
    if megatron:
        from megalite.checkpoint import from_megatron
        from megalite.cli.megatron_args import model_config_of
        path = from_megatron.convert_for_load(root, model_config_of, io.group(), "cpu",
                                              lambda m: print(m, flush=True), not (cfg.no_load_optim or cfg.finetune))
    try:
        loaded = load_checkpoint(chunks, optimizer, scheduler, mcfg, cfg,
                                 path if megatron else root, io=io)
    except CheckpointException as e:  # DCP wraps every rank's error; ours is one line
        raise unwrap_checkpoint_error(e) from None
    finally:
        if megatron:
            from_megatron.remove_converted(root, io.group())
    if megatron and loaded is not None and not (cfg.no_load_rng or cfg.finetune):
        from_megatron.restore_rng(root, chunks, lambda m: print(m, flush=True))
    if loaded is None and cfg.exit_on_missing_checkpoint:
        raise CheckpointError(f"--load {root} holds no checkpoint and --exit-on-missing-checkpoint is set")
    if loaded is not None:
        print_rank_last(f"megalite: loaded checkpoint from {root} at iteration {loaded[0]}")
    return loaded


def align_main_weights(precisions, optimizer):
    """--data-parallel-precisions (`precisions`, per DP replica): every replica's fp32 main weights become those of the
    first replica of the widest dtype (a bf16 replica's own copy starts from its bf16-rounded weights, an fp32 one's
    from the exact ones; a checkpoint without optimizer state gives each its own rounding), and each model computes
    with them rounded to its dtype. Collective over DP; after loading, before training."""
    if not precisions:
        return
    import torch
    import torch.distributed as dist
    from megalite.checkpoint.state import model_from_main_params
    src = min(range(len(precisions)), key=lambda r: ("fp32", "fp16", "bf16").index(precisions[r]))
    with torch.no_grad():
        for m in optimizer.main_params:
            dist.broadcast(m, group=ps.get_data_parallel_group(), group_src=src)
    model_from_main_params(optimizer)
