"""The validated flags (a RunConfig, megalite/config/run.py) to the configuration dataclasses: ModelConfig's fields
(and the ExecutionConfig's it inherits) come from the flags their declarations name (config/fields.py: Field), the
derived ones are here; used by the command line's checks (megalite/cli/validate.py), training's setup and the
planner alike, so none of them imports the command line."""

import argparse

from megalite.config.ddp import DistributedDataParallelConfig
from megalite.config.model import FLAG_FIELDS, ModelConfig
from megalite.config.training import OPTIMIZER_FIELDS, TrainingConfig


def model_config(args, vocab_size=None):
    """The ModelConfig of parsed arguments (its vocabulary given: the tokenizer's, or the checkpoint's; default
    --vocab-size's, as the data decided): every field from the flag its declaration names (config.Field), the rest
    derived here."""
    bert = args.model_type == "bert"
    derived = dict(
        vocab_size=args.vocab_size if vocab_size is None else vocab_size, add_bias_linear=not args.disable_bias_linear,
        params_dtype=training_config(args).params_dtype, fused_kernels=not args.no_fused_kernels,
        pipeline_layout=getattr(args, "pipeline_layout", None),  # (set by validation: the layers per stage)
        cp_comm_type=list(args.cp_comm_type) if args.context_parallel_size > 1 else None,
        gelu="exact" if bert and not args.openai_gelu else "tanh", num_tokentypes=2 if bert else 0,
        bert_binary_head=bert and args.bert_binary_head)
    return ModelConfig(**{field: getattr(args, dest) for field, dest in FLAG_FIELDS.items()}, **derived)


def training_config(args):
    """The TrainingConfig of parsed arguments."""
    return TrainingConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=args.train_iters, lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
        lr_warmup_iters=args.lr_warmup_iters, lr_decay_iters=args.lr_decay_iters, weight_decay=args.weight_decay,
        train_samples=args.train_samples, lr_warmup_fraction=args.lr_warmup_fraction,
        lr_warmup_samples=args.lr_warmup_samples, lr_decay_samples=args.lr_decay_samples,
        lr_warmup_init=args.lr_warmup_init, rampup_batch_size=args.rampup_batch_size,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
        apply_wd_to_qk_layernorm=args.apply_wd_to_qk_layernorm, lr_wsd_decay_style=args.lr_wsd_decay_style,
        lr_wsd_decay_iters=args.lr_wsd_decay_iters, lr_wsd_decay_samples=args.lr_wsd_decay_samples,
        start_weight_decay=args.start_weight_decay, end_weight_decay=args.end_weight_decay,
        weight_decay_incr_style=args.weight_decay_incr_style,
        clip_grad=args.clip_grad, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        optimizer=args.optimizer, **{k: getattr(args, k) for k in OPTIMIZER_FIELDS},
        bf16=args.bf16, fp16=args.fp16,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis, log_interval=args.log_interval, eval_interval=args.eval_interval,
        eval_iters=args.eval_iters, seed=args.seed, fused_kernels=not args.no_fused_kernels,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad, optimizer_cpu_offload=args.optimizer_cpu_offload,
        optimizer_offload_fraction=args.optimizer_offload_fraction,
        overlap_cpu_optimizer_d2h_h2d=args.overlap_cpu_optimizer_d2h_h2d,
        loss_scaling=("fp16" in args.data_parallel_precisions) if getattr(args, "data_parallel_precisions", None)
        else None)


def ddp_config(args):
    """The data-parallel wrapper's section (config/ddp.py)."""
    return DistributedDataParallelConfig(
        bucket_size=args.ddp_bucket_size, overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=bool(args.use_distributed_optimizer), zero_stage=args.zero_stage or 1,
        overlap_param_gather=args.overlap_param_gather, hierarchical=args.hierarchical_grad_reduce,
        reshard_after_forward=args.torch_fsdp2_reshard_after_forward, grad_reduce_in_bf16=args.grad_reduce_in_bf16)


def with_rank_precision(args, dp_rank):
    """A copy of args whose --bf16 / --fp16 are DP replica dp_rank's (--data-parallel-precisions), for
    building that rank's model and optimizer configs; args itself when there is no list."""
    if not args.data_parallel_precisions:
        return args
    mine = args.data_parallel_precisions[dp_rank]
    if hasattr(args, "replace"):  # the frozen run configuration
        return args.replace(bf16=mine == "bf16", fp16=mine == "fp16")
    return argparse.Namespace(**{**vars(args), "bf16": mine == "bf16", "fp16": mine == "fp16"})
