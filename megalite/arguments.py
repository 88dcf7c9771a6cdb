"""Megatron-LM-compatible command line -> args namespace -> config dataclasses.

Flags megalite implements keep Megatron's names and meanings. A Megatron flag megalite
does not implement yet is an error that says so; an unknown flag is an error too.
Validation runs on every rank from the environment alone (WORLD_SIZE), before any
process group exists, so a bad command fails fast everywhere instead of hanging.
"""

import argparse
import os


from megalite.config import ConfigError, ModelConfig, TrainingConfig, fail

# Megatron flags that megalite recognises but does not implement (yet).
NOT_IMPLEMENTED = {
    "--context-parallel-size", "--expert-model-parallel-size", "--num-experts",
    "--fp8-format", "--use-cpu-initialization", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--apply-query-key-layer-scaling", "--use-checkpoint-args",
    "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
    "--lr-warmup-fraction", "--train-samples", "--rampup-batch-size", "--tokenizer-model-type",
    "--merge-file", "--qk-layernorm",
    "--apply-residual-connection-post-layernorm", "--squared-relu", "--use-rotary-position-embeddings",
    "--rotary-percent", "--onnx-safe", "--defer-embedding-wgrad-compute",
    "--tp-comm-overlap", "--num-workers", "--dataloader-type", "--wandb-project",
}


# Megatron's dist-checkpoint tuning switches: they pick how Megatron's writer works, not
# what is saved; megalite's writer is always fully parallel with a persistent thread.
CKPT_TUNING_FLAGS = ("--use-persistent-ckpt-worker", "--no-ckpt-fully-parallel-save", "--ckpt-fully-parallel-load",
                     "--use-dist-ckpt", "--auto-detect-ckpt-format", "--ckpt-assume-constant-structure")


def build_parser():
    p = argparse.ArgumentParser(description="megalite pretraining (Megatron-LM flags)", allow_abbrev=False)
    a = p.add_argument
    # model
    a("--num-layers", type=int, default=4)
    a("--hidden-size", type=int, default=256)
    a("--ffn-hidden-size", type=int, default=None)
    a("--num-attention-heads", type=int, default=4)
    a("--kv-channels", type=int, default=None)
    a("--group-query-attention", action="store_true")
    a("--num-query-groups", type=int, default=1)
    a("--seq-length", type=int, default=128)
    a("--max-position-embeddings", type=int, default=None)
    a("--position-embedding-type", default="learned_absolute", choices=["learned_absolute", "rope"])
    a("--rotary-base", type=float, default=10000.0)
    a("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    a("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float, default=1e-5)
    a("--swiglu", action="store_true")
    a("--untie-embeddings-and-output-weights", action="store_true")
    a("--disable-bias-linear", action="store_true")
    a("--hidden-dropout", type=float, default=0.1)
    a("--attention-dropout", type=float, default=0.1)
    a("--init-method-std", type=float, default=0.02)
    a("--make-vocab-size-divisible-by", type=int, default=128)
    a("--recompute-granularity", default=None, choices=["full", "selective"])
    a("--recompute-method", default=None, choices=["uniform", "block"])
    a("--recompute-num-layers", type=int, default=None)
    a("--no-fused-kernels", action="store_true", help="use plain torch ops instead of Triton kernels on CUDA")
    a("--transformer-impl", default="local", choices=["local"])
    a("--use-mcore-models", action="store_true", help="accepted for compatibility: megalite has one model code")
    a("--attention-softmax-in-fp32", action="store_true", help="accepted: softmax always accumulates in fp32")
    # BERT (pretrain_bert.py)
    a("--bert-binary-head", dest="bert_binary_head", action="store_true", default=True,
      help="BERT: pooler + sentence-order head (default, as Megatron)")
    a("--bert-no-binary-head", dest="bert_binary_head", action="store_false", help="BERT: MLM only")
    a("--mask-prob", type=float, default=0.15, help="BERT: fraction of tokens chosen for MLM")
    a("--short-seq-prob", type=float, default=0.1, help="BERT: probability of a shorter target sample length")
    a("--layernorm-position", default=None, choices=["pre", "post"],
      help="post: norm(x + f(x)) (original BERT; pretrain_bert's default); pre: x + f(norm(x)) (GPT's default)")
    a("--openai-gelu", action="store_true", help="BERT: tanh-approximated GeLU (GPT always uses it) instead of erf")
    # parallelism
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--pipeline-model-parallel-size", type=int, default=1)
    a("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    a("--decoder-first-pipeline-num-layers", type=int, default=None)
    a("--decoder-last-pipeline-num-layers", type=int, default=None)
    a("--sequence-parallel", action="store_true")
    a("--distributed-backend", default=None, choices=["nccl", "gloo"])
    a("--overlap-grad-reduce", dest="overlap_grad_reduce", action="store_true", default=True)
    a("--no-overlap-grad-reduce", dest="overlap_grad_reduce", action="store_false")
    a("--ddp-bucket-size", type=int, default=40_000_000)
    a("--use-distributed-optimizer", action="store_true", help="ZeRO: shard main params and Adam states over DP")
    a("--zero-stage", type=int, default=None, choices=[1, 2],
      help="with --use-distributed-optimizer: 1 (default, as Megatron) or 2 (gradients sharded too)")
    a("--overlap-param-gather", action="store_true", help="overlap the parameter all-gather with the next forward")
    # training
    a("--micro-batch-size", type=int, default=4)
    a("--global-batch-size", type=int, default=None)
    a("--train-iters", type=int, default=200)
    a("--lr", type=float, default=1e-3)
    a("--min-lr", type=float, default=1e-4)
    a("--lr-decay-style", default="cosine", choices=["constant", "linear", "cosine"])
    a("--lr-warmup-iters", type=int, default=10)
    a("--lr-decay-iters", type=int, default=None)
    a("--weight-decay", type=float, default=0.01)
    a("--clip-grad", type=float, default=1.0)
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.999)
    a("--adam-eps", type=float, default=1e-8)
    a("--bf16", action="store_true")
    a("--fp16", action="store_true")
    a("--loss-scale", type=float, default=None, help="constant fp16 loss scale (default: dynamic)")
    a("--initial-loss-scale", type=float, default=2.0 ** 32)
    a("--min-loss-scale", type=float, default=1.0)
    a("--loss-scale-window", type=int, default=1000)
    a("--hysteresis", type=int, default=2)
    a("--seed", type=int, default=1234)
    # logging / evaluation
    a("--log-interval", type=int, default=10)
    a("--eval-interval", type=int, default=100)
    a("--eval-iters", type=int, default=5)
    a("--tensorboard-dir", default=None)
    a("--log-json", default=None, help="append one JSON object per logged iteration / evaluation to this file")
    a("--log-throughput", action="store_true", help="accepted: the log line always shows TFLOP/s per GPU")
    a("--log-params-norm", action="store_true", help="log the norm of all parameters")
    a("--log-num-zeros-in-grad", action="store_true", help="log the number of zero gradient elements")
    a("--log-validation-ppl-to-tensorboard", action="store_true")
    a("--log-memory-to-tensorboard", action="store_true", help="peak device memory (CUDA) or peak RSS (CPU)")
    a("--log-timers-to-tensorboard", action="store_true", help="forward-backward and optimizer times")
    a("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
      help="accepted: megalite has one level of timers (--log-timers-to-tensorboard)")
    a("--skip-train", action="store_true", help="no training: evaluate (validation and test) and exit")
    # data
    a("--data-path", nargs="*", default=None)
    a("--split", default="969,30,1")
    a("--data-cache-path", default=None)
    a("--mock-data", action="store_true")
    a("--tokenizer-type", default=None,
      choices=["SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer", "BertWordPieceLowerCase",
               "BertWordPieceCase"])
    a("--tokenizer-model", default=None)
    a("--vocab-file", default=None, help="BertWordPieceLowerCase/Case: the WordPiece vocab.txt")
    a("--vocab-size", type=int, default=None)
    # operations (megalite/training.py)
    a("--distributed-timeout-minutes", type=float, default=10,
      help="a collective waiting longer than this on a dead or hung peer fails (every group)")
    a("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_true", default=True,
      help="stop before the optimizer step on a NaN/Inf loss or gradient (default on)")
    a("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_false")
    a("--exit-signal-handler", action="store_true",
      help="on SIGTERM: save (with --save) at the next iteration boundary on every rank and exit 0")
    a("--exit-duration-in-mins", type=float, default=None, help="save (with --save) and exit after this long")
    # checkpoints (megalite/checkpointing.py)
    a("--save", default=None, help="directory to save checkpoints in")
    a("--load", default=None, help="directory to resume from (no checkpoint there: train from scratch)")
    a("--save-interval", type=int, default=None, help="save every N iterations (and at the end)")
    a("--finetune", action="store_true", help="load weights only: iteration 0, fresh optimizer and RNG")
    a("--no-load-optim", action="store_true", help="do not load optimizer and LR-scheduler state")
    a("--no-load-rng", action="store_true", help="do not load RNG states")
    a("--no-save-optim", action="store_true", help="do not save optimizer state")
    a("--no-save-rng", action="store_true", help="do not save RNG states")
    a("--exit-on-missing-checkpoint", action="store_true", help="with --load: exit if it holds no checkpoint")
    a("--ckpt-format", default="torch_dist", help="torch_dist (the only format megalite writes)")
    a("--exit-interval", type=int, default=None, help="stop after an iteration divisible by N (saving first)")
    a("--async-save", action="store_true", help="write checkpoints in the background; the next save waits")
    for flag in CKPT_TUNING_FLAGS:
        a(flag, action="store_true", help="accepted for Megatron scripts: tunes Megatron's checkpoint writer")
    a("--dist-ckpt-strictness", default="assume_ok_unexpected",
      help="accepted for Megatron scripts: megalite always loads strictly (every tensor must match)")
    return p


def parse_args(argv=None, world_size=None, defaults=None):
    """Parse and validate; on a user error print one line and exit non-zero. defaults: an
    entry point's own (Megatron's args_defaults), e.g. pretrain_bert's {"model_type": "bert"}."""
    try:
        return _parse(argv, world_size, defaults)
    except ConfigError as e:
        fail(str(e))


def _parse(argv, world_size, defaults=None):
    parser = build_parser()
    parser.set_defaults(**{"model_type": "gpt", **(defaults or {})})
    args, unknown = parser.parse_known_args(argv)
    for tok in unknown:
        if tok.startswith("--"):
            flag = tok.split("=", 1)[0]
            if flag in NOT_IMPLEMENTED:
                raise ConfigError(f"Megatron flag {flag} is not implemented in megalite yet; remove it")
            raise ConfigError(f"unrecognized argument {flag} (see --help)")
        raise ConfigError(f"unexpected argument {tok!r} (see --help)")
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.world_size = world_size
    validate_args(args)
    return args


def validate_args(args):
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ConfigError(f"parallel sizes must be >= 1 (TP={tp}, PP={pp})")
    for flag, minimum in (("micro_batch_size", 1), ("train_iters", 1), ("log_interval", 1), ("num_layers", 1),
                          ("seq_length", 1), ("eval_interval", 0), ("eval_iters", 0)):
        if getattr(args, flag) < minimum:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= {minimum}")
    if args.world_size % (tp * pp):
        raise ConfigError(f"world size {args.world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                          f"--pipeline-model-parallel-size {pp} = {tp * pp}; change --nproc-per-node or the sizes")
    args.data_parallel_size = args.world_size // (tp * pp)
    _validate_pipeline(args)
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # as Megatron: nothing to split
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive; pick one")
    if (args.zero_stage is not None or args.overlap_param_gather) and not args.use_distributed_optimizer:
        raise ConfigError("--zero-stage and --overlap-param-gather need --use-distributed-optimizer")
    if args.use_distributed_optimizer and args.zero_stage is None:
        args.zero_stage = 1
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if (args.recompute_method is not None or args.recompute_num_layers is not None) and \
            args.recompute_granularity != "full":
        raise ConfigError("--recompute-method / --recompute-num-layers need --recompute-granularity full")
    if args.skip_train and not (args.eval_interval > 0 and args.eval_iters > 0):
        raise ConfigError("--skip-train evaluates only: it needs --eval-iters > 0 and --eval-interval > 0")
    _validate_checkpoint_args(args)
    _validate_bert(args)
    if args.mock_data and args.data_path:
        raise ConfigError("--mock-data and --data-path are exclusive; pick one")
    if not args.group_query_attention:
        args.num_query_groups = None
    if args.mock_data and args.vocab_size is None and args.tokenizer_type is None:
        args.vocab_size = 1024
    num_micro = training_config(args).num_microbatches(args.data_parallel_size)
    if args.virtual_pipeline_model_parallel_size is not None and num_micro % pp:
        raise ConfigError(f"interleaved pipelining needs the number of micro-batches ({num_micro}) to be a multiple "
                          f"of --pipeline-model-parallel-size {pp}; change --global-batch-size")
    # Shape checks live in ModelConfig; the vocabulary (maybe unknown until the tokenizer
    # loads) does not enter them.
    model_config(args, args.vocab_size or 1).check_parallel(tp)


def _validate_checkpoint_args(args):
    if args.ckpt_format != "torch_dist":
        raise ConfigError(f"--ckpt-format {args.ckpt_format} is not supported: megalite reads and writes torch_dist "
                          "checkpoints only; remove the flag (convert others with tools/convert_checkpoint.py)")
    if args.distributed_timeout_minutes <= 0:
        raise ConfigError(f"--distributed-timeout-minutes {args.distributed_timeout_minutes} must be > 0")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        raise ConfigError(f"--exit-duration-in-mins {args.exit_duration_in_mins} must be > 0")
    for flag in ("save_interval", "exit_interval"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1")
    for flag in ("save_interval", "async_save", "no_save_optim", "no_save_rng"):
        if getattr(args, flag) and not args.save:
            raise ConfigError(f"--{flag.replace('_', '-')} needs --save DIR")
    for flag in ("finetune", "no_load_optim", "no_load_rng", "exit_on_missing_checkpoint"):
        if getattr(args, flag) and not args.load:
            raise ConfigError(f"--{flag.replace('_', '-')} needs --load DIR")
    given = [f for f in CKPT_TUNING_FLAGS if getattr(args, f[2:].replace("-", "_"))]
    if given and os.environ.get("RANK", "0") == "0":
        print(f"megalite: {' '.join(given)} accepted; megalite's checkpoint writer is always fully parallel",
              flush=True)


def _validate_bert(args):
    bert = args.model_type == "bert"
    if args.layernorm_position is None:
        args.layernorm_position = "post" if bert else "pre"
    if not bert:
        return
    if args.untie_embeddings_and_output_weights:
        raise ConfigError("BERT ties its MLM output layer to the word embeddings; remove "
                          "--untie-embeddings-and-output-weights")
    if args.position_embedding_type != "learned_absolute":
        raise ConfigError(f"BERT uses learned absolute positions; remove --position-embedding-type "
                          f"{args.position_embedding_type}")
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
    stage_layer_counts(L, pp, args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)


def model_config(args, vocab_size):
    return ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
        seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings, vocab_size=vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, swiglu=args.swiglu,
        add_bias_linear=not args.disable_bias_linear, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        sequence_parallel=args.sequence_parallel, recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        params_dtype=training_config(args).params_dtype, fused_kernels=not args.no_fused_kernels, seed=args.seed,
        **_bert_fields(args))


def _bert_fields(args):
    bert = args.model_type == "bert"
    return dict(model_type=args.model_type, layernorm_position=args.layernorm_position,
                gelu="exact" if bert and not args.openai_gelu else "tanh", num_tokentypes=2 if bert else 0,
                bert_binary_head=bert and args.bert_binary_head)


def training_config(args):
    return TrainingConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=args.train_iters, lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
        lr_warmup_iters=args.lr_warmup_iters, lr_decay_iters=args.lr_decay_iters, weight_decay=args.weight_decay,
        clip_grad=args.clip_grad, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        bf16=args.bf16, fp16=args.fp16,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis, log_interval=args.log_interval, eval_interval=args.eval_interval,
        eval_iters=args.eval_iters, seed=args.seed, fused_kernels=not args.no_fused_kernels,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad)
