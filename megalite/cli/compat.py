"""What megalite does with a Megatron-LM flag it does not implement itself.

Four answers, all collected over the whole command before anything is reported, so a user
learns every problem of a launch script in one message instead of one per launch:
- NOTICE: the flag only picks an implementation or tunes speed (Transformer Engine, fusions,
  memory housekeeping); accepted, with one line on rank 0 saying what megalite does instead.
- RENAMED: Megatron itself renamed or removed it; the message names the new spelling.
- not implemented: a real Megatron flag (megatron_flags.json lists all of them) whose maths
  megalite does not have (fp8, MoE, FSDP, ...); named as such, with what to do.
- unrecognized: not a Megatron flag either (a typo): the closest megalite flag is suggested.
"""

import difflib
import json
import os

_FLAGS_FILE = os.path.join(os.path.dirname(__file__), "megatron_flags.json")

# Flags (switches or flags with a value) accepted with a notice: they do not change the maths.
NOTICE = {
    "--no-gradient-accumulation-fusion": "gradients always accumulate into fp32 main-grad buffers",
    "--gradient-accumulation-fusion": "gradients always accumulate into fp32 main-grad buffers",
    "--no-masked-softmax-fusion": "the softmax kernel is chosen per device (--no-fused-kernels for plain torch)",
    "--masked-softmax-fusion": "the softmax kernel is chosen per device",
    "--no-bias-gelu-fusion": "bias+GeLU is fused on CUDA unless --no-fused-kernels",
    "--bias-gelu-fusion": "bias+GeLU is fused on CUDA unless --no-fused-kernels",
    "--no-bias-swiglu-fusion": "SwiGLU is fused on CUDA unless --no-fused-kernels",
    "--no-bias-dropout-fusion": "bias+dropout+add fusion is left to torch",
    "--no-rope-fusion": "rotary embeddings use megalite's kernel on CUDA unless --no-fused-kernels",
    "--no-persist-layer-norm": "megalite's layer norm kernel has no persistent variant",
    "--cross-entropy-loss-fusion": "the vocab-parallel cross entropy is fused on CUDA unless --no-fused-kernels",
    "--no-create-attention-mask-in-dataloader": "causal masks are built inside attention, never in the loader",
    "--no-mmap-bin-files": ".bin files are always memory-mapped (pages are read on demand)",
    "--empty-unused-memory-level": "the caching allocator is left alone",
    "--logging-level": "megalite prints rank-0 progress lines only",
    "--attention-backend": "attention runs megalite's Triton flash attention on CUDA (unless --no-fused-kernels), "
                           "SDPA/torch otherwise",
    "--transformer-impl": "megalite has one transformer implementation (no Transformer Engine)",
    "--use-mcore-models": "megalite has one model code",
    "--use-legacy-models": "megalite has one model code",
    "--attention-softmax-in-fp32": "softmax always accumulates in fp32",
    "--accumulate-allreduce-grads-in-fp32": "gradients are accumulated and reduced in fp32",
    "--log-throughput": "the log line always shows TFLOP/s per GPU",
    "--use-persistent-ckpt-worker": "megalite's checkpoint writer is always fully parallel",
    "--no-ckpt-fully-parallel-save": "megalite's checkpoint writer is always fully parallel",
    "--ckpt-fully-parallel-load": "every rank reads only its own shards",
    "--ckpt-fully-parallel-save": "megalite's checkpoint writer is always fully parallel",
    "--use-dist-ckpt": "torch_dist is megalite's only format",
    "--auto-detect-ckpt-format": "torch_dist is megalite's only format",
    "--ckpt-assume-constant-structure": "plans are rebuilt per save",
    "--dist-ckpt-optim-fully-reshardable": "optimizer state is always saved fully reshardable",
    "--dist-ckpt-strictness": "loads are always strict (every tensor must match)",
    "--async-tensor-model-parallel-allreduce": "the TP all-reduce order is fixed by the layers",
    "--no-async-tensor-model-parallel-allreduce": "the TP all-reduce order is fixed by the layers",
    "--tp-comm-overlap": "TP communication is not overlapped with GEMMs (speed only)",
    "--DDP-impl": "megalite's data-parallel wrapper is Megatron's local DDP with overlapped buckets",
    "--data-impl": "the .bin/.idx format is always the mmap one",
    "--use-cpu-initialization": "initialisation is topology independent; each rank makes only its shard",
    "--no-async-save-check": "async saves are checked at the next save",
    "--dsa-kernel-backend": "DSA runs megalite's unfused (torch) indexer and masked attention",
    "--no-dsa-indexer-rotate-activation": "megalite never applies the indexer's Hadamard rotation (orthogonal on "
                                          "both q and k: index scores unchanged)",
    "--disable-dsa-indexer-rotate-activation": "megalite never applies the indexer's Hadamard rotation (orthogonal "
                                               "on both q and k: index scores unchanged)",
    "--timing-log-level": "megalite has one level of timers (--log-timers-to-tensorboard)",
    "--tiktoken-pattern": "only Megatron's TikTokenizer reads it, and megalite's tokenizers do not",
    "--ckpt-format": "megalite writes one layout (Megatron's directory names; sharded safetensors + JSON "
                     "through torch.distributed.checkpoint); Megatron's own checkpoint files are not read",
    "--async-strategy": "async saves use megalite's own background writer",
    "--async-ckpt-use-cpu-shm": "async saves use megalite's own background writer",
    "--ddp-average-in-collective": "the DP mean is the same either way: megalite scales by 1/DP around a sum "
                                   "(gloo has no AVG); only rounding differs",
    "--defer-embedding-wgrad-compute": "embedding weight-gradient GEMMs are not deferred (speed only)",
    "--wgrad-deferral-limit": "embedding weight-gradient GEMMs are not deferred (speed only)",
    "--overlap-p2p-communication-warmup-flush": "pipeline send/recv overlap is fixed by megalite's schedules "
                                                "(speed only)",
    "--microbatch-group-size-per-virtual-pipeline-stage": "the interleaved schedule groups --pipeline-model-"
                                                          "parallel-size micro-batches per virtual stage; the "
                                                          "order changes no value",
    "--num-distributed-optimizer-instances": "the distributed optimizer shards over the whole DP group (one "
                                             "instance): the same update, a different communication pattern",
    "--disable-gloo-process-groups": "megalite keeps one gloo group, for its checkpoint writer's CPU "
                                     "collectives (off the training stream)",
    "--overlap-param-gather-with-optimizer-step": "the ZeRO parameter all-gather overlaps the next forward "
                                                  "(--overlap-param-gather), not the optimizer step (speed only)",
    "--cross-entropy-fusion-impl": "the vocab-parallel cross entropy is fused on CUDA unless --no-fused-kernels",
    "--spec": "megalite has one transformer layer implementation (Megatron's local spec)",
    "--mla-down-proj-fusion": "MLA's q/kv down projections run as two GEMMs (speed only)",
    "--init-model-with-meta-device": "each rank builds only its TP shard of the weights (topology-independent "
                                     "init); with ZeRO-3 it keeps only its DP shard of that after start-up",
    "--fsdp-double-buffer": "ZeRO-3 gathers into one buffer per layer unit (memory layout only)",
    "--megatron-fsdp-max-pool-double-buffer": "ZeRO-3 gathers into one buffer per layer unit (memory layout only)",
    "--fsdp-db-use-persist-buf-on-alloc-fail": "ZeRO-3 gathers into one buffer per layer unit (memory layout only)",
    "--fsdp-manual-registration": "NCCL user-buffer registration is not used (speed only)",
    "--megatron-fsdp-enable-fine-grained-param-gather": "ZeRO-3 gathers one layer unit at a time, with prefetch",
    "--megatron-fsdp-version": "megalite has one FSDP implementation (ZeRO-3 in its distributed optimizer)",
    "--disable-strict-fsdp-dtensor-load": "megalite's checkpoint loads are always strict",
    "--no-strict-fsdp-dtensor-load": "megalite's checkpoint loads are always strict",
    "--moe-permute-fusion": "the MoE token permutation runs as megalite's gather/scatter (the same tokens to the "
                            "same experts; speed only)",
    "--moe-router-fusion": "the router's scores and top-k run unfused (the same choices; speed only)",
    "--cuda-graph-impl": "CUDA graphs are not captured: every step launches its kernels (speed only)",
    "--cuda-graph-modules": "CUDA graphs are not captured: every step launches its kernels (speed only)",
    "--cuda-graph-scope": "CUDA graphs are not captured: every step launches its kernels (speed only)",
    "--cuda-graph-warmup-steps": "CUDA graphs are not captured: every step launches its kernels (speed only)",
    "--enable-cuda-graph": "CUDA graphs are not captured: every step launches its kernels (speed only)",
    "--te-rng-tracker": "megalite's own RNG tracker (Megatron's streams: one shared, one per TP rank; no "
                        "Transformer Engine)",
}

# Value-carrying flags whose *value* decides: accepted at these values, not implemented otherwise.
NEUTRAL_VALUES = {
    "--encoder-tensor-model-parallel-size": ("0", "encoder-decoder models are not implemented in megalite"),
    "--virtual-pipeline-model-parallel-size": (None, None),  # handled as a real flag in arguments.py
    "--data-impl": ("mmap", "megalite reads only the mmap .bin/.idx format"),
    "--transformer-impl": ("local transformer_engine inference_optimized", None),
    "--attention-backend": ("auto flash fused unfused local", None),
    "--DDP-impl": ("local torch", None),
    "--dataloader-type": ("single", "only the 'single' (sequential) data loader is implemented"),
    "--ckpt-format": ("torch_dist torch fsdp_dtensor", "megalite writes one checkpoint layout (torch_dist-like)"),
    "--async-strategy": ("nvrx mcore", None),
    "--spec": ("local", "custom layer specs are not implemented in megalite (Megatron's local spec is)"),
    "--megatron-fsdp-version": (None, None),
    "--megatron-fsdp-main-params-dtype": ("fp32", "main parameters are always fp32"),
    "--megatron-fsdp-main-grads-dtype": ("auto fp32", "gradients are always accumulated in fp32"),
    "--megatron-fsdp-grad-comm-dtype": ("auto fp32", "gradients are always reduced in fp32"),
    "--outer-dp-sharding-strategy": ("no_shard", "hybrid sharding (HSDP: replicas of a sharded group) is not "
                                                 "implemented in megalite"),
}

# Megatron's own renames and removals: old spelling -> what to write now.
RENAMED = {
    "--batch-size": "--micro-batch-size",
    "--warmup": "--lr-warmup-fraction",
    "--model-parallel-size": "--tensor-model-parallel-size",
    "--checkpoint-activations": "--recompute-activations (or --recompute-granularity full)",
    "--checkpoint-num-layers": "--recompute-num-layers",
    "--activations-checkpoint-method": "--recompute-granularity full --recompute-method (uniform or block)",
    "--activations-checkpoint-num-layers": "--recompute-num-layers",
    "--distribute-checkpointed-activations": "--distribute-saved-activations (not implemented; remove it)",
    "--use-rotary-position-embeddings": "--position-embedding-type rope",
    "--use-checkpoint-lr-scheduler": "--use-checkpoint-opt_param-scheduler",
    "--override-lr-scheduler": "--override-opt_param-scheduler",
    "--fp16-lm-cross-entropy": "(removed in Megatron) remove it",
    "--num-layers-per-virtual-pipeline-stage-old": "--num-layers-per-virtual-pipeline-stage",
    "--tensorboard-log-interval": "(removed: TensorBoard logs every --log-interval) remove it",
}

# Why a Megatron flag is not implemented, by keyword: the first match names the feature.
_WHY = (
    (("fp4",), "FP4 training (Transformer Engine's NVFP4) is not implemented in megalite"),
    (("fp8", "quantiz", "kitchen"), "this FP8 option (Transformer Engine's) is not implemented in megalite (it has "
                                    "--fp8-format with the tensorwise and delayed recipes)"),
    (("moe", "expert", "router"), "this Mixture of Experts option is not implemented in megalite yet (it has "
                                  "--num-experts with top-k softmax/sigmoid routing, aux/seq-aux/z losses, expert "
                                  "parallelism with allgather/alltoall dispatch)"),
    (("profile", "nsys", "memory-snapshot", "record-memory"), "profiling flags are not implemented in megalite; "
                                                              "run under torch.profiler or nsys yourself"),
    (("cuda-graph", "enable-cuda-graph"), "CUDA graphs are not implemented in megalite"),
    (("mtp",), "this multi-token prediction option is not implemented in megalite (it has --mtp-num-layers and "
                "--mtp-loss-scaling-factor, the MTP layers in the last pipeline stage)"),
    (("cache-mla-latents",), "caching MLA latents is for Megatron's dynamic inference engine, not in megalite"),
    (("yarn-",), "YaRN for standard attention (--position-embedding-type yarn) is not implemented in megalite "
                 "(multi-latent attention's is: --rope-type, --rotary-scaling-factor, --mscale, --mscale-all-dim)"),
    (("hybrid", "mamba"), "hybrid/Mamba models are not implemented in megalite"),
    (("rl-", "grpo", "inference", "vision", "biencoder", "distill", "sft", "retro"),
     "this Megatron workload is not implemented in megalite"),
)


def megatron_flags():
    """{flag: [nargs, group, default]} for every flag of Megatron-LM's parser (see the file's _source)."""
    if not hasattr(megatron_flags, "_cache"):
        with open(_FLAGS_FILE) as f:
            megatron_flags._cache = json.load(f)["flags"]
    return megatron_flags._cache


def _why_not(flag):
    low = flag.lower()
    for words, why in _WHY:
        if any(w in low for w in words):
            return why
    return "not implemented in megalite"


def _nargs(flag):
    info = megatron_flags().get(flag)
    if flag in RENAMED and info is None:
        return 0 if flag in ("--checkpoint-activations", "--distribute-checkpointed-activations",
                             "--use-rotary-position-embeddings",
                             "--use-checkpoint-lr-scheduler", "--override-lr-scheduler",
                             "--fp16-lm-cross-entropy") else 1
    if info is None:
        return None
    return info[0]


def sort_unknown(tokens, known_flags):
    """Split argparse's leftover tokens into (notices, problems). notices: lines to print on
    rank 0; problems: one entry per reason, naming every flag it applies to and what to do."""
    notices, problems, i = [], {}, 0

    def problem(shown, why):
        problems.setdefault(why, []).append(shown)

    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if not tok.startswith("--"):
            problem(repr(tok), "unexpected value (the flag before it takes none)")
            continue
        flag, eq, inline = tok.partition("=")
        n = _nargs(flag)
        values = [inline] if eq else []
        if not eq and n != 0:
            # A flag's values run until the next --flag (nargs 1 takes exactly one; an
            # unknown flag takes what follows it, so its value is not reported on its own).
            while i < len(tokens) and not tokens[i].startswith("--") and (n != 1 or not values):
                values.append(tokens[i])
                i += 1
        shown = " ".join([flag] + values)
        if flag in RENAMED:
            problem(flag, f"renamed in Megatron-LM: use {RENAMED[flag]}")
        elif flag in NEUTRAL_VALUES:
            ok, why = NEUTRAL_VALUES[flag]
            if ok is None or (values and all(v in ok.split() for v in values)):
                notices.append(f"{shown} accepted" + (f": {NOTICE[flag]}" if flag in NOTICE else ""))
            else:
                problem(shown, f"{why or 'not implemented in megalite'}; remove it")
        elif flag in NOTICE:
            notices.append(f"{shown} accepted: {NOTICE[flag]}")
        elif flag in megatron_flags():
            problem(flag, f"{_why_not(flag)}; remove it")
        else:
            near = difflib.get_close_matches(flag, known_flags, n=1, cutoff=0.75)
            problem(flag, f"unrecognized (did you mean {near[0]}?)" if near else
                    "unrecognized: neither a megalite nor a Megatron-LM flag (see --help)")
    return notices, [f"{', '.join(flags)}: {why.replace('remove it', 'remove them') if len(flags) > 1 else why}"
                     for why, flags in problems.items()]


def print_notices(notices):
    if notices and os.environ.get("RANK", "0") == "0":
        for line in notices:
            print(f"megalite: {line}", flush=True)
