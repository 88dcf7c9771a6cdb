"""Megatron-LM-compatible command line -> args namespace -> config dataclasses.

The model's flags are registered by megalite/cli/features/model.py, the rest here. Flags megalite
implements keep Megatron's names, defaults and meanings (flags Megatron requires, megalite
requires too). Everything else a command passes is sorted by
megatron_compat: accepted with a notice (implementation choices), or reported, all in one
message (renamed, not implemented, unrecognized). Validation (megalite/cli/validate.py) runs
on every rank from the environment alone (WORLD_SIZE), before any process group exists, so
a bad command fails fast everywhere instead of hanging.
"""

import argparse
import copy
import os

from megalite.config import ConfigError, fail
from megalite.config.run import freeze
from megalite.config.from_flags import model_config, training_config  # noqa: F401 (imported from here too)
from megalite.cli.compat import print_notices, sort_unknown
from megalite.cli.features.lr_schedule import add_lr_schedule_flags
from megalite.cli.features.model import ROPE_SCALING_DEFAULTS, add_model_flags, fill_rope_scaling
from megalite.cli.features.profiling import add_profiling_flags
from megalite.cli.features.mixed_gpu import add_mixed_gpu_flags
from megalite.cli.features.semi_sync import add_semi_sync_flags
from megalite.cli.features.ft import add_ft_flags
from megalite.cli.features.fp8 import add_fp8_flags
from megalite.cli.features.optimizer import add_optimizer_flags
from megalite.cli.features.pipeline_schedule import add_pipeline_schedule_flags

TOKENIZER_CHOICES = ["GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                     "HuggingFaceTokenizer", "NullTokenizer", "BertWordPieceLowerCase", "BertWordPieceCase"]


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (a bad value, a missing value) as one ConfigError line."""

    def error(self, message):
        raise ConfigError(f"{message} (see --help)")


def build_parser():
    p = _Parser(description="megalite pretraining (Megatron-LM flags)", allow_abbrev=False)
    a = p.add_argument
    add_model_flags(a)  # the model's own flags (megalite/cli/features/model.py)
    _parallel_flags(a)
    add_pipeline_schedule_flags(a)  # the pipeline's schedule (megalite/cli/features/pipeline_schedule.py)
    add_semi_sync_flags(a)  # semi-synchronous replicas (megalite/cli/features/semi_sync.py)
    add_ft_flags(a)  # fault-tolerant replicas on torchft (megalite/cli/features/ft.py)
    add_fp8_flags(a)  # FP8 GEMMs (megalite/cli/features/fp8.py)
    add_profiling_flags(a)  # --profile (megalite/cli/features/profiling.py)
    add_mixed_gpu_flags(a)  # per-replica micro-batches, optimizer offload (megalite/cli/features/mixed_gpu.py)
    _training_flags(a)
    _logging_flags(a)
    _data_flags(a)
    _operations_flags(a)
    _checkpoint_flags(a)
    return p


def _parallel_flags(a):
    """Parallelism: TP, PP (virtual, uneven, layouts), SP, CP, DP and its reductions, ZeRO / FSDP, shares."""
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--pipeline-model-parallel-size", type=int, default=1)
    a("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    a("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
      help="interleaved pipelining with this many model chunks per stage")
    a("--account-for-embedding-in-pipeline-split", action="store_true",
      help="count the embedding as a layer when splitting (the first stage builds one layer fewer)")
    a("--account-for-loss-in-pipeline-split", action="store_true",
      help="count the loss as a layer when splitting (the last stage builds one layer fewer)")
    a("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
      help="interleaved: contiguous micro-batches per virtual stage (default PP; larger allows micro-batch "
           "counts that are not multiples of PP)")
    a("--decoder-first-pipeline-num-layers", type=int, default=None)
    a("--decoder-last-pipeline-num-layers", type=int, default=None)
    a("--pipeline-model-parallel-layout", default=None,
      help='layers per (virtual) stage, Megatron\'s format: e.g. "Ettt|tL" (E embedding, t layer, L loss, '
           '"|" between stages, "(...)*n" repeats); stages = PP x virtual stages')
    a("--sequence-parallel", action="store_true")
    a("--use-tp-pp-dp-mapping", action="store_true",
      help="rank order TP, CP, PP, DP (pipeline neighbours adjacent) instead of TP, CP, DP, PP")
    a("--context-parallel-size", type=int, default=1,
      help="split every sequence over N ranks (2N chunks, rank r keeps chunks r and 2N-1-r)")
    a("--cp-comm-type", nargs="+", default=["p2p"],
      help="context-parallel attention: p2p (ring), a2a (Ulysses all-to-all), allgather or a2a+p2p "
           "(with --hierarchical-context-parallel-sizes); one, or one per layer")
    a("--hierarchical-context-parallel-sizes", nargs="+", default=None,
      help="a2a+p2p: two sizes A B (A x B = CP): all-to-all within groups of A consecutive CP ranks, ring "
           "across the B groups")
    a("--distributed-backend", default=None, choices=["nccl", "gloo"],
      help="default: nccl with CUDA, gloo without (Megatron's default nccl needs GPUs)")
    a("--overlap-grad-reduce", dest="overlap_grad_reduce", action="store_true", default=True,
      help="overlap the DP gradient reduction with the backward (megalite's default: same maths, faster)")
    a("--no-overlap-grad-reduce", dest="overlap_grad_reduce", action="store_false")
    a("--ddp-bucket-size", type=int, default=None, help="elements per DP bucket (default max(40M, 1M x DP))")
    a("--use-distributed-optimizer", action="store_true", help="ZeRO: shard main params and Adam states over DP")
    a("--zero-stage", type=int, default=None, choices=[1, 2, 3],
      help="with --use-distributed-optimizer: 1 (default, as Megatron), 2 (gradients sharded too) or 3 "
           "(parameters too, gathered layer by layer with prefetch: FSDP)")
    a("--use-megatron-fsdp", action="store_true",
      help="Megatron's FSDP: --data-parallel-sharding-strategy picks plain DP / ZeRO-1 / 2 / 3")
    a("--data-parallel-sharding-strategy", default="optim_grads_params",
      choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
      help="with --use-megatron-fsdp: no_shard (plain DP), optim (ZeRO-1), optim_grads (ZeRO-2) or "
           "optim_grads_params (ZeRO-3, the default)")
    a("--use-torch-fsdp2", action="store_true", help="accepted as ZeRO-3 (megalite's own sharded buckets)")
    a("--torch-fsdp2-no-reshard-after-forward", dest="torch_fsdp2_reshard_after_forward", action="store_false",
      help="ZeRO-3: keep each unit's gathered weights from its forward to its backward (fewer gathers, more memory)")
    a("--overlap-param-gather", action="store_true", help="overlap the parameter all-gather with the next forward")
    a("--hierarchical-grad-reduce", action="store_true",
      help="DP all-reduce in three steps: reduce-scatter within each node (torchrun's LOCAL_WORLD_SIZE ranks), "
           "all-reduce the shards across nodes, all-gather within the node (1/k of the bytes cross nodes)")
    a("--grad-reduce-in-bf16", action="store_true",
      help="Megatron's: the DP reduction (all-reduce, ZeRO's reduce-scatter) sends the gradients in bf16, half the "
           "bytes; megalite still accumulates them in fp32 (each bucket rounded to bf16 once, as it is sent)")
    a("--grad-compression", default="none", choices=["none", "powersgd", "topk"],
      help="compress the DP all-reduce for slow links, with error feedback (lossy: not the single-process update)")
    a("--grad-compression-ratio", type=float, default=0.1,
      help="fraction of the gradient's elements sent (topk: values kept; powersgd: sets the rank)")
    a("--grad-compression-start-iter", type=int, default=0, help="exact all-reduces before this iteration")
    a("--data-parallel-shares", default=None,
      help="S0,S1,...: DP rank r takes S_r / sum(S) of every global batch (e.g. a faster GPU more), gradients "
           "weighted exactly; auto: measured over the first iterations and balanced")
    a("--data-parallel-shares-profile-iters", type=int, default=3,
      help="with --data-parallel-shares auto: iterations timed (at equal shares) before balancing")


def _training_flags(a):
    """Training and the LR schedule (Megatron's defaults: no warmup, linear decay to 0)."""
    a("--micro-batch-size", type=int, default=None)
    a("--global-batch-size", type=int, default=None)
    a("--rampup-batch-size", nargs=3, type=int, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
      help="grow the global batch from START by INCREMENT over SAMPLES samples")
    a("--step-batch-size-schedule", default=None, help='"THRESHOLD:BS ..." global batch BS from THRESHOLD tokens on')
    a("--train-iters", type=int, default=None)
    a("--train-samples", type=int, default=None, help="sample-based training (instead of --train-iters)")
    a("--lr", type=float, default=None)
    a("--min-lr", type=float, default=0.0)
    add_lr_schedule_flags(a)
    a("--decoupled-lr", type=float, default=None,
      help="a separate peak LR for the input embedding and the output layer (same schedule)")
    a("--decoupled-min-lr", type=float, default=None, help="their minimum LR (default --min-lr)")
    a("--apply-wd-to-qk-layernorm", action="store_true",
      help="weight decay on the q/k layernorms' parameters too (Megatron's Qwen3-Next rule; other norms and biases "
           "stay undecayed)")
    a("--lr-warmup-iters", type=int, default=0)
    a("--lr-warmup-fraction", type=float, default=None, help="warmup as a fraction of the decay iterations/samples")
    a("--lr-warmup-samples", type=int, default=0)
    a("--lr-warmup-init", type=float, default=0.0, help="the LR warmup starts from")
    a("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    a("--lr-decay-samples", type=int, default=None, help="default --train-samples")
    a("--use-checkpoint-opt_param-scheduler", action="store_true",
      help="take the LR schedule (lr, min lr, warmup, decay) from the checkpoint, ignoring the flags")
    a("--override-opt_param-scheduler", action="store_true",
      help="take the LR schedule from the flags even where the checkpoint's differs")
    a("--weight-decay", type=float, default=0.01)
    a("--clip-grad", type=float, default=1.0)
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.999)
    a("--adam-eps", type=float, default=1e-8)
    add_optimizer_flags(a)  # --optimizer sgd|muon|lion and their flags (megalite/cli/features/optimizer.py)
    a("--bf16", action="store_true")
    a("--fp16", action="store_true")
    a("--loss-scale", type=float, default=None, help="constant fp16 loss scale (default: dynamic)")
    a("--initial-loss-scale", type=float, default=2.0 ** 32)
    a("--min-loss-scale", type=float, default=1.0)
    a("--loss-scale-window", type=int, default=1000)
    a("--hysteresis", type=int, default=2)
    a("--calculate-per-token-loss", action="store_true",
      help="average the loss over the global batch's unmasked tokens instead of per micro-batch")
    a("--seed", type=int, default=1234)
    a("--manual-gc", action="store_true", help="disable the automatic garbage collector; collect at fixed steps")
    a("--manual-gc-interval", type=int, default=0, help="with --manual-gc: collect every N iterations (0: never)")
    a("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
      help="with --manual-gc: no collection around evaluations")


def _logging_flags(a):
    """Logging and evaluation."""
    a("--log-interval", type=int, default=100)
    a("--eval-interval", type=int, default=None, help="validate every N iterations (default: only at the end)")
    a("--eval-iters", type=int, default=100)
    a("--eval-global-batch-size", type=int, default=None, help="samples per evaluation iteration (default "
      "--global-batch-size)")
    a("--eval-micro-batch-size", type=int, default=None, help="evaluation micro-batch (default --micro-batch-size)")
    a("--tensorboard-dir", default=None)
    a("--log-json", default=None, help="append one JSON object per logged iteration / evaluation to this file")
    a("--wandb-project", default=None, help="log the TensorBoard scalars to this Weights & Biases project too "
      "(needs the wandb package)")
    a("--wandb-exp-name", default=None, help="the W&B run's name (required with --wandb-project)")
    a("--wandb-entity", default=None, help="the W&B team or user")
    a("--wandb-save-dir", default=None, help="W&B's local files (default: <--save>/wandb)")
    a("--log-params-norm", action="store_true", help="log the norm of all parameters")
    a("--log-num-zeros-in-grad", action="store_true", help="log the number of zero gradient elements")
    a("--log-validation-ppl-to-tensorboard", action="store_true")
    a("--log-memory-to-tensorboard", action="store_true", help="peak device memory (CUDA) or peak RSS (CPU)")
    a("--log-timers-to-tensorboard", action="store_true", help="forward-backward and optimizer times")
    a("--skip-train", action="store_true", help="no training: evaluate (validation and test) and exit")


def _data_flags(a):
    """Data: paths, splits, FIM, masks, tokenizers."""
    a("--data-path", nargs="*", default=None)
    a("--split", default=None, help="train,valid,test weights (commas or slashes; default 969,30,1)")
    for name in ("train", "valid", "test"):  # (Megatron's per-split blends: instead of --data-path and --split)
        a(f"--{name}-data-path", nargs="*", default=None, help=f"the {name} split's prefix or blend, all of it")
    a("--data-cache-path", default=None)
    a("--mock-data", action="store_true")
    a("--fim-data", action="store_true", help="fill-in-the-middle samples (PSM/SPM), as Megatron's FIM dataset")
    a("--fim-rate", type=float, default=0.5, help="probability that a document segment becomes a FIM sample")
    a("--fim-spm-rate", type=float, default=0.5, help="probability that a FIM sample is SPM rather than PSM")
    a("--fim-split-sample", default=None, help="a token at which segments are cut into fragments, each FIM'd alone")
    a("--fim-fragment-rate", type=float, default=None, help="with --fim-split-sample: FIM rate per fragment")
    a("--fim-no-prefix", default=None, help="fragments whose text starts with this are left alone")
    for name, default in (("prefix", "<fim_prefix>"), ("middle", "<fim_middle>"), ("suffix", "<fim_suffix>"),
                          ("pad", "<fim_pad>"), ("eod", "<|endoftext|>")):
        a(f"--fim-{name}-token", default=default, help=f"the FIM {name} token (a vocabulary entry)")
    a("--num-workers", type=int, default=2, help="data loader worker processes (0: load in the training process)")
    a("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    a("--reset-position-ids", action="store_true", help="position ids restart after each end-of-document token")
    a("--reset-attention-mask", action="store_true", help="tokens attend only within their own document")
    a("--tokenizer-type", default=None, choices=TOKENIZER_CHOICES,
      help="default with --data-path: GPT2BPETokenizer (as Megatron)")
    a("--tokenizer-model", default=None)
    a("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json; BertWordPiece*: vocab.txt")
    a("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    a("--vocab-size", type=int, default=None)


def _operations_flags(a):
    """Operations: timeouts, NaN checks, Megatron's re-run state machine, exit signals."""
    a("--distributed-timeout-minutes", type=float, default=10,
      help="a collective waiting longer than this on a dead or hung peer fails (every group)")
    a("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_true", default=True,
      help="stop before the optimizer step on a NaN/Inf loss or gradient (default on)")
    a("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_false")
    # Megatron's re-run state machine (megalite/rerun.py); megalite's default is Megatron's "disabled"
    a("--rerun-mode", default="disabled", choices=["disabled", "validate_results", "report_stats"],
      help="validate_results: re-run an iteration whose loss fails validation (exit 16/17 as Megatron); "
           "report_stats: run every iteration twice and log the differences")
    a("--error-injection-rate", type=int, default=0, help="validate_results: inject a fault at 1 in N validations")
    a("--error-injection-type", default="transient_error",
      choices=["correct_result", "transient_error", "persistent_error"])
    a("--check-for-spiky-loss", action="store_true",
      help="validate each loss against 10x the largest of the first 100 (non-fatal)")
    a("--exit-signal-handler", action="store_true",
      help="on SIGTERM: save (with --save) at the next iteration boundary on every rank and exit 0")
    a("--exit-duration-in-mins", type=float, default=None, help="save (with --save) and exit after this long")


def _checkpoint_flags(a):
    """Checkpoints (megalite/checkpoint/manager.py), exit interval, replica checks."""
    a("--save", default=None, help="directory to save checkpoints in")
    a("--load", default=None, help="directory to resume from (no checkpoint there: train from scratch)")
    a("--save-interval", type=int, default=None, help="save every N iterations (and at the end)")
    a("--save-retain-interval", type=int, default=None,
      help="keep only checkpoints at multiples of N (and the newest); others are deleted at the next save")
    a("--finetune", action="store_true", help="load weights only: iteration 0, fresh optimizer and RNG")
    a("--no-load-optim", action="store_true", help="do not load optimizer and LR-scheduler state")
    a("--no-load-rng", action="store_true", help="do not load RNG states")
    a("--no-save-optim", action="store_true", help="do not save optimizer state")
    a("--no-save-rng", action="store_true", help="do not save RNG states")
    a("--exit-on-missing-checkpoint", action="store_true", help="with --load: exit if it holds no checkpoint")
    a("--use-checkpoint-args", action="store_true",
      help="take the model flags (sizes, positions, norms, ...) from --load's newest checkpoint")
    a("--verify-integrity", action="store_true",
      help="record each checkpoint file's SHA-256 at save; check them at load before reading a tensor (every "
           "save records each file's size and xxh3 checksum anyway, and every load checks them)")
    a("--no-checkpoint-fallback", action="store_true",
      help="a --load checkpoint whose files do not verify stops the run, instead of loading the newest earlier "
           "one that does")
    a("--exit-interval", type=int, default=None, help="stop after an iteration divisible by N (saving first)")
    a("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
      help="every N iterations, stop if the data-parallel replicas' weights differ in any bit")
    a("--test-mode", action="store_true", help="Megatron's real-time checks: every iteration, the replicas' "
      "weights compared bit for bit over DP, and the weights every TP rank holds whole over TP")
    a("--async-save", action="store_true", help="write checkpoints in the background; the next save waits")



def parse_args(argv=None, world_size=None, defaults=None):
    """Parse and validate; on a user error print one line and exit non-zero. defaults: an
    entry point's own (Megatron's args_defaults), e.g. pretrain_bert's {"model_type": "bert"}."""
    try:
        return _parse(argv, world_size, defaults)
    except ConfigError as e:
        fail(str(e))


class ModelFlags:
    """One model's flags `argv` parsed once (with a parser of its own), each layout's own flags (none of them in
    argv) then parsed over a copy of that: the same arguments as parsing argv + layout, a fifth of a planner
    search's time less (cli/plan.py keeps one per model command line)."""

    def __init__(self, argv, defaults=None):
        self.parser = build_parser()
        self.parser.set_defaults(**{"model_type": "gpt", **(defaults or {})})
        self.base, self.unknown = self.parser.parse_known_args(argv)

    def at(self, layout, world_size):
        copied = argparse.Namespace(**{k: copy.deepcopy(v) if isinstance(v, (list, dict, set)) else v
                                       for k, v in vars(self.base).items()})  # validation may change what it holds
        args, more = self.parser.parse_known_args(list(layout), namespace=copied)
        return _finish(args, self.unknown + more, self.parser, world_size)


def check_args(argv, world_size, defaults=None, layout=()):
    """parse_args that raises the ConfigError instead of exiting; layout: more flags, parsed over argv's."""
    if not layout:
        return _parse(argv, world_size, defaults)
    return ModelFlags(argv, defaults).at(layout, world_size)


def _parse(argv, world_size, defaults=None, parser=None):
    parser = parser or build_parser()
    parser.set_defaults(**{"model_type": "gpt", **(defaults or {})})
    args, unknown = parser.parse_known_args(argv)
    return _finish(args, unknown, parser, world_size)


def _finish(args, unknown, parser, world_size):
    """Unknown flags sorted (Megatron's that change nothing: a notice; the rest: refused), the world size, the
    checkpoint's flags where asked, validation."""
    known = [s for act in parser._actions for s in act.option_strings]
    notices, problems = sort_unknown(unknown, known)
    if problems:
        raise ConfigError("Megatron flags megalite cannot honour (fix all, then relaunch): " + " | ".join(problems))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.world_size = world_size
    fill_rope_scaling(args)
    if args.use_checkpoint_args:  # as Megatron: the checkpoint's model flags first, then validation
        _take_checkpoint_args(args, parser)
    from megalite.cli.validate import validate_args  # it maps args through this module's configs
    validate_args(args)
    print_notices(notices)
    return freeze(args)  # nothing below the command line changes a flag (megalite/config/run.py)


def _take_checkpoint_args(args, parser):
    from megalite.checkpoint.storage import CheckpointError
    from megalite.cli.checkpoint_args import use_checkpoint_args  # imported only with the flag (torch's DCP)
    try:
        path, replaced = use_checkpoint_args(args, {a.dest: ROPE_SCALING_DEFAULTS.get(a.dest, a.default)
                                                    for a in parser._actions})
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    print_notices([f"--use-checkpoint-args: model flags from {path}" + (
        f" (replacing the command line's {', '.join(replaced)})" if replaced else "") if path else
        f"--use-checkpoint-args: no checkpoint in --load {args.load}; the command line's model flags stand"])
