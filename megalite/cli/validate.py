"""Validation of the parsed command line: Megatron's checks and derived values, each error
one line naming the values and what to change (all missing required flags in one line)."""

import os
import re

from megalite.config.from_flags import model_config, training_config
from megalite.config.batching import BatchingConfig
from megalite.config import ConfigError
from megalite.cli.compat import print_notices
from megalite.cli.features.mup import validate_mup
from megalite.cli.features.mixed_gpu import check_uneven_composes, is_auto, validate_mixed_gpus, validate_precisions
from megalite.cli.features.semi_sync import validate_semi_sync
from megalite.cli.features.ft import validate_ft
from megalite.cli.features.fp8 import validate_fp8
from megalite.cli.features.lr_schedule import validate_lr_schedule
from megalite.cli.features.pipeline_schedule import V_SCHEDULES, v_split, validate_pipeline_schedule
from megalite.cli.features.optimizer import validate_optimizer
from megalite.cli.features.profiling import validate_profiling
from megalite.cli.validate_features import validate_data_parallel_reduction, validate_features, validate_split_paths

# Flags Megatron has no default for: a launch script always passes them.
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "lr")


def validate_args(args):
    """Megatron's checks and derived values, in their order (later checks read what earlier ones derived)."""
    _validate_required_and_sizes(args)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _validate_shares(args)
    validate_mixed_gpus(args)
    validate_semi_sync(args)
    _validate_pipeline(args)
    _validate_context_parallel(args)
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # as Megatron: nothing to split
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive; pick one")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ConfigError(f"--decoupled-min-lr {args.decoupled_min_lr} needs --decoupled-lr (the embedding and "
                          "output layer's peak LR)")
    validate_lr_schedule(args)
    validate_features(args)
    validate_precisions(args)
    validate_mup(args)
    validate_optimizer(args)
    validate_profiling(args)
    validate_data_parallel_reduction(args)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    _validate_recompute(args)
    validate_ft(args)
    validate_fp8(args)
    if args.skip_train and args.eval_iters <= 0:
        raise ConfigError("--skip-train evaluates only: it needs --eval-iters > 0")
    if args.recompute_activations:
        args.recompute_granularity = "selective"  # Megatron's alias
    validate_pipeline_schedule(args)
    if args.ddp_bucket_size is None:
        args.ddp_bucket_size = max(40_000_000, 1_000_000 * args.data_parallel_size)  # Megatron's default
    if args.distributed_backend == "nccl":
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("--distributed-backend nccl needs CUDA GPUs and none is visible; use "
                              "--distributed-backend gloo (or leave it out)")
    _validate_schedule(args)
    _validate_data(args)
    if args.use_flash_attn and os.environ.get("RANK", "0") == "0":
        import torch
        if not torch.cuda.is_available():
            print("megalite: --use-flash-attn: no CUDA device here, attention runs the torch path (SDPA)", flush=True)
    _validate_checkpoint_args(args)
    _validate_bert(args)
    if not args.group_query_attention:
        args.num_query_groups = None
    if args.mock_data and args.vocab_size is None and args.tokenizer_type is None:
        args.vocab_size = 1024
    _validate_micro_batches(args, pp)
    _validate_eval_batch(args)
    # Shape checks live in ModelConfig; the vocabulary (maybe unknown until the tokenizer
    # loads) does not enter them.
    model_config(args, args.vocab_size or 1).check_parallel(tp)


def _validate_required_and_sizes(args):
    """The flags Megatron requires (all missing ones in one line), sizes and counts in range, the data-parallel size
    derived from the world size."""
    missing = [f"--{f.replace('_', '-')}" for f in REQUIRED if getattr(args, f) is None]
    if args.train_iters is None and args.train_samples is None and not args.skip_train:
        missing.append("--train-iters (or --train-samples)")
    if missing:
        raise ConfigError(f"missing required flag{'s' * (len(missing) > 1)} {', '.join(missing)} "
                          "(Megatron has no defaults for these)")
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if tp < 1 or pp < 1 or cp < 1:
        raise ConfigError(f"parallel sizes must be >= 1 (TP={tp}, PP={pp}, CP={cp})")
    if args.eval_interval == 0:
        args.eval_interval = None  # megalite's older spelling of "no periodic evaluation"
    if args.wandb_project and not args.wandb_exp_name:
        raise ConfigError("--wandb-project needs --wandb-exp-name (the W&B run's name), as in Megatron")
    for flag, minimum in (("micro_batch_size", 1), ("train_iters", 1), ("train_samples", 1), ("log_interval", 1),
                          ("num_layers", 1), ("seq_length", 1), ("eval_interval", 1), ("eval_iters", 0),
                          ("num_workers", 0), ("manual_gc_interval", 0)):
        if getattr(args, flag) is not None and getattr(args, flag) < minimum:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= {minimum}")
    if args.world_size % (tp * cp * pp):
        raise ConfigError(f"world size {args.world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                          f"--context-parallel-size {cp} x --pipeline-model-parallel-size {pp} = {tp * cp * pp}; "
                          "change --nproc-per-node or the sizes")
    args.data_parallel_size = args.world_size // (tp * cp * pp)


def _validate_recompute(args):
    """--recompute-method / --recompute-num-layers: with full recomputation only; without a granularity ignored
    aloud, as Megatron."""
    if (args.recompute_method is not None or args.recompute_num_layers is not None) and \
            args.recompute_granularity != "full":
        if args.recompute_granularity is not None:
            raise ConfigError("--recompute-method / --recompute-num-layers need --recompute-granularity full")
        # Megatron ignores them without a granularity (its scripts pass --recompute-num-layers 1): so do we, aloud
        print_notices(["--recompute-method / --recompute-num-layers without --recompute-granularity: "
                       "no activation recomputation (as Megatron)"])
        args.recompute_method = args.recompute_num_layers = None


def _validate_micro_batches(args, pp):
    """Every reachable global batch against uneven shares / sizes, or the micro-batch count against interleaving."""
    from megalite.batching.iteration_plan import batch_schedule, interleaving
    from megalite.batching.microbatches import interleaving_problem
    if args.data_parallel_shares is not None or args.data_parallel_micro_batch_sizes is not None:
        # every reachable global batch against the shares / sizes (and interleaving), per rank
        check_uneven_composes(args, batch_schedule(BatchingConfig.of(args)))
    else:
        num_micro = training_config(args).num_microbatches(args.data_parallel_size)  # the full batch's count
        interleaved = interleaving(BatchingConfig.of(args))
        if interleaved and (why := interleaving_problem(num_micro, pp, interleaved)):
            raise ConfigError(f"{why}; change --global-batch-size")


def _validate_shares(args):
    """--data-parallel-shares: one positive integer per DP rank, or auto (the batches are checked
    against the shares once the batch schedule is known)."""
    from megalite.batching.iteration_plan import parse_shares
    args.data_parallel_shares = parse_shares(args.data_parallel_shares, args.data_parallel_size)
    if args.data_parallel_shares == "auto":
        if args.rampup_batch_size is not None or getattr(args, "step_batch_size_schedule", None):
            raise ConfigError("--data-parallel-shares auto balances one global batch size; it does not compose with "
                              "--rampup-batch-size / --step-batch-size-schedule (give the shares instead)")
        m, dp = args.micro_batch_size, args.data_parallel_size
        g = args.global_batch_size or (m or 1) * dp
        if m and g % (m * dp):
            raise ConfigError(f"--data-parallel-shares auto profiles at equal shares first: --global-batch-size {g} "
                              f"must be divisible by --micro-batch-size {m} x data-parallel size {dp} = {m * dp}")
        if args.microbatch_group_size_per_virtual_pipeline_stage is not None:
            raise ConfigError("--data-parallel-shares auto balances in units of PP micro-batches; give the shares "
                              "instead of auto with --microbatch-group-size-per-virtual-pipeline-stage")
        if args.data_parallel_shares_profile_iters < 1:
            raise ConfigError(f"--data-parallel-shares-profile-iters {args.data_parallel_shares_profile_iters} must be "
                              ">= 1")


def _validate_eval_batch(args):
    """Megatron's evaluation batch: --eval-global-batch-size / --eval-micro-batch-size, defaulting
    to the training ones, in whole micro-batches on every DP rank."""
    if args.eval_global_batch_size is None:
        args.eval_global_batch_size = args.global_batch_size
    # per-replica micro-batch sizes hold for evaluation too, unless it has a size of its own
    # (sizes chosen by memory: evaluation runs --eval-micro-batch-size, default --micro-batch-size)
    args.eval_micro_batch_sizes = args.data_parallel_micro_batch_sizes \
        if args.eval_micro_batch_size is None and args.data_parallel_micro_batch_sizes != "auto" else None
    if args.eval_micro_batch_size is None:
        args.eval_micro_batch_size = args.micro_batch_size
    g, m, dp = args.eval_global_batch_size, args.eval_micro_batch_size, args.data_parallel_size
    shares = args.data_parallel_shares if isinstance(args.data_parallel_shares, list) else None
    if (shares or args.eval_micro_batch_sizes) and g >= 1 and m >= 1:
        from megalite.batching.iteration_plan import IterationPlan, evaluation_interleaving
        from megalite.batching.microbatches import BatchSchedule
        plan = IterationPlan(BatchSchedule(g, m, dp), shares, micros=args.eval_micro_batch_sizes)
        plan.check(0, args.pipeline_model_parallel_size, evaluation_interleaving(BatchingConfig.of(args)),
                   what="--eval-global-batch-size")
        return
    if g < 1 or m < 1 or g % (m * dp):
        raise ConfigError(f"--eval-global-batch-size {g} must be a positive multiple of --eval-micro-batch-size {m} x "
                          f"data-parallel size {dp} = {m * dp}")
    from megalite.batching.iteration_plan import evaluation_interleaving
    from megalite.batching.microbatches import interleaving_problem
    interleaved = evaluation_interleaving(BatchingConfig.of(args))
    if interleaved and (why := interleaving_problem(g // (m * dp), args.pipeline_model_parallel_size, interleaved)):
        raise ConfigError(f"evaluation: {why}; change --eval-global-batch-size")


def _validate_checkpoint_args(args):
    if args.distributed_timeout_minutes <= 0:
        raise ConfigError(f"--distributed-timeout-minutes {args.distributed_timeout_minutes} must be > 0")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        raise ConfigError(f"--exit-duration-in-mins {args.exit_duration_in_mins} must be > 0")
    for flag in ("save_interval", "exit_interval", "check_weight_hash_across_dp_replicas_interval"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1")
    if args.save_retain_interval is not None and (not args.save_interval or args.save_retain_interval < 1 or
                                                  args.save_retain_interval % args.save_interval):
        raise ConfigError(f"--save-retain-interval {args.save_retain_interval} must be a positive multiple of "
                          f"--save-interval ({args.save_interval}), as Megatron")
    for flag in ("save_interval", "async_save", "no_save_optim", "no_save_rng"):
        if getattr(args, flag) and not args.save:
            raise ConfigError(f"--{flag.replace('_', '-')} needs --save DIR")
    for flag in ("finetune", "no_load_optim", "no_load_rng", "exit_on_missing_checkpoint"):
        if getattr(args, flag) and not args.load:
            raise ConfigError(f"--{flag.replace('_', '-')} needs --load DIR")


def _validate_bert(args):
    bert = args.model_type == "bert"
    if args.layernorm_position is None:
        args.layernorm_position = "post" if bert else "pre"
    if not bert:
        return
    flags = [f for f in ("calculate_per_token_loss", "eod_mask_loss", "reset_position_ids", "reset_attention_mask",
                         "mtp_num_layers") if getattr(args, f)]
    if flags:
        raise ConfigError(f"{', '.join('--' + f.replace('_', '-') for f in flags)}: GPT flags; pretrain_bert.py "
                          "masks its own tokens (remove them)")
    from megalite.models.bert import check_bert_config  # (imported here: only a BERT run needs the model code)
    check_bert_config(args)
    if not 0.0 < args.mask_prob < 1.0 or not 0.0 <= args.short_seq_prob <= 1.0:
        raise ConfigError(f"--mask-prob {args.mask_prob} must be in (0, 1) and --short-seq-prob "
                          f"{args.short_seq_prob} in [0, 1]")
    if args.seq_length < 8:
        raise ConfigError(f"--seq-length {args.seq_length}: a BERT sample [CLS] A [SEP] B [SEP] needs at least 8")


def _validate_pipeline(args):
    from megalite.transformer.pipeline_layers import stage_layer_counts
    pp, L = args.pipeline_model_parallel_size, args.num_layers
    args.virtual_pipeline_model_parallel_size = None
    uneven = args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None
    args.pipeline_layout = None
    vstages, per_vstage = args.num_virtual_stages_per_pipeline_rank, args.num_layers_per_virtual_pipeline_stage
    account = args.account_for_embedding_in_pipeline_split or args.account_for_loss_in_pipeline_split
    if vstages is not None and per_vstage is not None:
        raise ConfigError("--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage are "
                          "exclusive; pick one")
    if args.pipeline_model_parallel_layout is None and (vstages is not None or account):
        from megalite.transformer.pipeline_layers import split_layers
        extra = int(args.account_for_embedding_in_pipeline_split) + int(args.account_for_loss_in_pipeline_split)
        v = vstages or (1 if per_vstage is None else max(1, (L + extra) // pp // per_vstage))
        if vstages is not None and (vstages < 1 or vstages > 1 and pp == 1):
            raise ConfigError(f"--num-virtual-stages-per-pipeline-rank {vstages} must be >= 1, and > 1 only with "
                              "--pipeline-model-parallel-size > 1")
        if per_vstage is not None and (L + extra) % (pp * per_vstage):
            raise ConfigError(f"--num-layers {L} (+ {extra} accounted) is not divisible by --pipeline-model-parallel-"
                              f"size {pp} x --num-layers-per-virtual-pipeline-stage {per_vstage}")
        args.pipeline_layout = tuple(split_layers(L, pp, v, args.decoder_first_pipeline_num_layers,
                                                  args.decoder_last_pipeline_num_layers,
                                                  args.account_for_embedding_in_pipeline_split,
                                                  args.account_for_loss_in_pipeline_split))
        args.virtual_pipeline_model_parallel_size = v if v > 1 else None
        return
    if is_auto(args.pipeline_model_parallel_layout):  # (checked in mixed_gpu_flags) profiled, then re-cut
        from megalite.pipeline.auto_layout import initial_counts
        args.pipeline_model_parallel_layout = "auto"
        args.pipeline_layout = tuple(initial_counts(L, pp))
        return
    if args.pipeline_model_parallel_layout is not None:
        from megalite.transformer.pipeline_layers import parse_pipeline_layout
        if uneven or per_vstage is not None or vstages is not None or account:
            raise ConfigError("--pipeline-model-parallel-layout sets every stage's layers: leave out "
                              "--decoder-first/last-pipeline-num-layers, --num-layers-per-virtual-pipeline-stage, "
                              "--num-virtual-stages-per-pipeline-rank and --account-for-embedding/loss-in-pipeline-"
                              "split")
        args.pipeline_layout = tuple(parse_pipeline_layout(args.pipeline_model_parallel_layout, pp, L,
                                                                args.mtp_num_layers))
        v = len(args.pipeline_layout) // pp
        args.virtual_pipeline_model_parallel_size = v if v > 1 else None
        return
    if args.num_layers_per_virtual_pipeline_stage is not None:
        n = args.num_layers_per_virtual_pipeline_stage
        if pp == 1:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        if uneven:
            raise ConfigError("interleaving (--num-layers-per-virtual-pipeline-stage) cannot be combined with an "
                              "uneven split (--decoder-first/last-pipeline-num-layers)")
        if n < 1 or L % (pp * n):
            raise ConfigError(f"--num-layers {L} is not divisible by --pipeline-model-parallel-size {pp} x "
                              f"--num-layers-per-virtual-pipeline-stage {n} = {pp * n}")
        args.virtual_pipeline_model_parallel_size = L // (pp * n)
        if args.virtual_pipeline_model_parallel_size == 1:
            args.virtual_pipeline_model_parallel_size = None  # one chunk per stage: plain 1F1B
        return
    if args.pipeline_schedule in V_SCHEDULES:
        return v_split(args)
    stage_layer_counts(L, pp, args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)




def _validate_context_parallel(args):
    """Megatron's rules for --context-parallel-size / --cp-comm-type, and what megalite's CP
    does not compose with yet, one line each."""
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    kinds = args.cp_comm_type
    if len(kinds) not in (1, args.num_layers):
        raise ConfigError(f"--cp-comm-type takes one type or one per layer ({args.num_layers}), got {len(kinds)}")
    for kind in kinds:
        if kind not in ("p2p", "a2a", "allgather", "a2a+p2p"):
            raise ConfigError(f"--cp-comm-type {kind!r} is not one of p2p, a2a, allgather, a2a+p2p")
    sizes = args.hierarchical_context_parallel_sizes
    if sizes is not None:  # "2 2", or one token "2 2" / "[2, 2]" as Megatron's test launcher writes it
        text = " ".join(sizes)
        if not re.fullmatch(r"[\[\s]*\d+(?:[\s,]+\d+)*[\]\s]*", text):
            raise ConfigError(f"--hierarchical-context-parallel-sizes {text}: need integers, e.g. 2 2")
        sizes = args.hierarchical_context_parallel_sizes = [int(x) for x in re.findall(r"\d+", text)]
    if ("a2a+p2p" in kinds) != (sizes is not None) and cp > 1:
        raise ConfigError("--cp-comm-type a2a+p2p and --hierarchical-context-parallel-sizes go together (as Megatron)")
    if sizes is not None and (len(sizes) != 2 or min(sizes) < 1 or sizes[0] * sizes[1] != cp):
        raise ConfigError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: need two sizes A B "
                          f"with A x B = --context-parallel-size {cp} (all-to-all within A, ring across B)")
    if cp == 1:
        args.hierarchical_context_parallel_sizes = None
        return
    s = args.seq_length
    if s % (2 * cp):
        raise ConfigError(f"--seq-length {s} must be a multiple of 2 x --context-parallel-size {cp} = {2 * cp} "
                          "(each CP rank keeps two of 2 x CP equal chunks)")
    if args.sequence_parallel and tp > 1 and (s // cp) % tp:
        raise ConfigError(f"--sequence-parallel with --context-parallel-size {cp} needs --seq-length {s} / {cp} "
                          f"divisible by --tensor-model-parallel-size {tp}")
    for kind, a2a in (("a2a", cp), ("a2a+p2p", (sizes or [1])[0])):
        if kind not in kinds:
            continue
        heads, groups = args.num_attention_heads, args.num_query_groups if args.group_query_attention else \
            args.num_attention_heads
        if (heads // tp) % a2a or (groups // tp) % a2a:
            raise ConfigError(f"--cp-comm-type {kind} splits each TP rank's heads over {a2a} CP ranks: {heads} heads "
                              f"and {groups} query groups / TP {tp} must be divisible by {a2a}")
    if args.apply_query_key_layer_scaling:
        raise ConfigError(f"--context-parallel-size {cp} does not compose with --apply-query-key-layer-scaling in "
                          "megalite yet")


def _validate_schedule(args):
    """Megatron's rules for iteration- vs sample-based training and the LR schedule."""
    if args.train_iters is not None and args.train_samples is not None:
        raise ConfigError("--train-iters and --train-samples are exclusive; pick one")
    if args.train_samples is not None:
        if args.lr_decay_iters is not None or args.lr_warmup_iters:
            raise ConfigError("sample-based training (--train-samples) takes --lr-decay-samples and "
                              "--lr-warmup-samples (or --lr-warmup-fraction), not --lr-decay-iters / --lr-warmup-iters")
        if args.lr_warmup_fraction is not None and args.lr_warmup_samples:
            raise ConfigError("--lr-warmup-fraction and --lr-warmup-samples are exclusive; pick one")
    else:
        if args.lr_decay_samples is not None or args.lr_warmup_samples:
            raise ConfigError("--lr-decay-samples / --lr-warmup-samples need --train-samples (sample-based "
                              "training); with --train-iters use --lr-decay-iters / --lr-warmup-iters")
        if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
            raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters are exclusive; pick one")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction <= 1.0:
        raise ConfigError(f"--lr-warmup-fraction {args.lr_warmup_fraction} must be in [0, 1]")
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    if args.use_checkpoint_opt_param_scheduler and args.override_opt_param_scheduler:
        raise ConfigError("--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler are exclusive")
    if args.rampup_batch_size is not None:
        start, incr, samples = args.rampup_batch_size
        if start < 1 or incr < 1 or samples < 0:
            raise ConfigError(f"--rampup-batch-size {start} {incr} {samples}: need start >= 1, increment >= 1 "
                              "and samples >= 0")
    if args.train_samples is not None or args.rampup_batch_size is not None or \
            getattr(args, "step_batch_size_schedule", None):
        from megalite.cli.batch_flags import derive_train_iters
        derive_train_iters(args)  # sets args.train_iters from the samples and the batch schedule


def _validate_data(args):
    validate_split_paths(args)  # (before --split's default)
    if (args.data_path or args.train_data_path) and args.tokenizer_type is None:
        args.tokenizer_type = "GPT2BPETokenizer"  # Megatron's default (with --vocab-file / --merge-file)
    if args.split is None:
        args.split = "969,30,1"  # Megatron's legacy default
    args.split = normalize_split(args.split)
    if args.mock_data and args.data_path:
        raise ConfigError("--mock-data and --data-path are exclusive; pick one")


def normalize_split(split):
    """Megatron's --split: weights separated by commas or slashes, optionally quoted (launch
    scripts pass "'99,1,0'"), padded to three; returns "a,b,c"."""
    text = split.strip().strip("'\"").replace(" ", "")
    parts = text.replace("/", ",").split(",") if text else []
    try:
        weights = [float(x) for x in parts]
    except ValueError:
        raise ConfigError(f"--split {split!r}: need up to three numbers separated by commas or slashes, "
                          "e.g. 969,30,1") from None
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--split {split!r}: need one to three non-negative weights with a positive sum")
    weights += [0.0] * (3 - len(weights))
    return ",".join(f"{w:g}" for w in weights)
