"""Checks of the optional training features, each error one line: ZeRO-3 / Megatron's FSDP flags,
fill-in-the-middle data, Mixture of Experts (validation.py calls them in this order)."""

import torch

from megalite.config import ConfigError
from megalite.cli.compat import print_notices
from megalite.cli.features.model import validate_window


def validate_features(args):
    if not args.add_position_embedding and args.position_embedding_type != "rope":  # as Megatron
        raise ConfigError("--no-position-embedding is deprecated: use --position-embedding-type (it is accepted "
                          "only with rope)")
    if args.geglu:  # (Gemma's GeGLU: the gated MLP's shape, another activation)
        if args.squared_relu:
            raise ConfigError("--geglu and --squared-relu are exclusive; pick one activation")
        args.swiglu = True
    validate_window(args)
    _validate_fsdp(args)
    _validate_fim(args)
    _validate_moe(args)
    _validate_mtp(args)


def validate_split_paths(args):
    """Megatron's --train/--valid/--test-data-path: each split its own data, instead of --data-path cut by --split."""
    given = [f"--{n}-data-path" for n in ("train", "valid", "test") if getattr(args, f"{n}_data_path")]
    if not given:
        return
    for other, on in (("--data-path", args.data_path), ("--mock-data", args.mock_data), ("--split", args.split)):
        if on:
            raise ConfigError(f"{given[0]} gives each split its own data; {other} does too: drop one")
    if not args.train_data_path and (args.train_iters or args.train_samples) and not args.skip_train:
        raise ConfigError(f"{given[0]} without --train-data-path: the train split has no data")
    if args.model_type == "bert":
        raise ConfigError(f"{given[0]} is not built yet for BERT in megalite: use --data-path and --split")


def _validate_mtp(args):
    """Multi-token prediction (--mtp-num-layers), each problem one line."""
    d = args.mtp_num_layers
    if d is None:
        return
    cp = args.context_parallel_size
    chunk = args.seq_length // (2 * cp) if cp > 1 else args.seq_length
    for cond, msg in (
            (d < 1, f"--mtp-num-layers {d} must be >= 1 (leave it out for no multi-token prediction)"),
            (chunk < d, f"--mtp-num-layers {d} moves tokens up to {d} places, more than a sequence chunk of {chunk} "
                        f"tokens (--seq-length {args.seq_length}{f' / 2 x CP {cp}' if cp > 1 else ''})"),
            (args.pipeline_model_parallel_size > 1 and args.position_embedding_type == "learned_absolute",
             "multi-token prediction on the last pipeline stage with learned absolute positions would need a second "
             "shared position table: use --position-embedding-type rope, or no pipeline parallelism")):
        if cond:
            raise ConfigError(msg)


def _group_routing_problems(args, experts, k):
    """--moe-router-num-groups G / --moe-router-group-topk K (both or neither, as Megatron's asserts)."""
    g, gk = args.moe_router_num_groups, args.moe_router_group_topk
    if g is None and gk is None:
        return []
    return [(g is None or gk is None, "--moe-router-num-groups and --moe-router-group-topk go together"),
            (g is not None and (g < 1 or experts % g), f"--moe-router-num-groups {g} must divide --num-experts "
                                                       f"{experts}"),
            (g is not None and gk is not None and not 1 <= gk <= g,
             f"--moe-router-group-topk {gk} must be between 1 and --moe-router-num-groups {g}"),
            (gk is not None and g and k < gk, f"--moe-router-topk {k} must be >= --moe-router-group-topk {gk} (a "
                                              "group's score sums its top topk / group-topk experts)"),
            (gk is not None and g and not experts % g and k > gk * (experts // g),
             f"--moe-router-topk {k} exceeds the {gk} x {experts // (g or 1)} experts of the chosen groups"),
            (args.moe_router_load_balancing_type == "sinkhorn", "group-limited routing with sinkhorn balancing is "
                                                                "not Megatron's; pick one")]


def _validate_moe(args):
    """Megatron's MoE checks, and what megalite's MoE does not do yet, each in one line."""
    e = args.num_experts
    if e is None:
        if args.expert_model_parallel_size != 1:
            raise ConfigError(f"--expert-model-parallel-size {args.expert_model_parallel_size} needs a Mixture of "
                              "Experts model (--num-experts)")
        if args.expert_tensor_parallel_size is not None:  # as Megatron: it sizes the experts' TP only
            print_notices([f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size} accepted: it has no "
                           "effect on a model without --num-experts"])
        return
    k, freq = args.moe_router_topk, args.moe_layer_freq
    etp = args.tensor_model_parallel_size if args.expert_tensor_parallel_size is None else \
        args.expert_tensor_parallel_size
    for cond, msg in (
            (e < 1, f"--num-experts {e} must be >= 1"),
            (not 1 <= k <= e, f"--moe-router-topk {k} must be between 1 and --num-experts {e}"),
            (not args.disable_bias_linear, "MoE layers have no linear biases: add --disable-bias-linear (as Megatron)"),
            (k == 1 and args.moe_router_score_function == "softmax" and not args.moe_router_pre_softmax and
             args.moe_router_load_balancing_type != "sinkhorn",
             "--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax (a softmax over one expert is 1: "
             "the router would never learn)"),
            (isinstance(freq, list) and len(freq) != args.num_layers,
             f"--moe-layer-freq has {len(freq) if isinstance(freq, list) else 0} entries for --num-layers "
             f"{args.num_layers}"),
            (args.moe_router_load_balancing_type == "sinkhorn" and args.moe_aux_loss_coeff > 0,
             "--moe-router-load-balancing-type sinkhorn has no auxiliary loss: set --moe-aux-loss-coeff 0 "
             "(as Megatron)"),
            (args.moe_router_load_balancing_type == "sinkhorn" and args.moe_router_enable_expert_bias,
             "--moe-router-enable-expert-bias does not apply to sinkhorn routing; pick one balancing"),
            (args.moe_token_dispatcher_type == "flex",
             "--moe-token-dispatcher-type flex (DeepEP) is not implemented in megalite; use allgather or alltoall"),
            (args.tensor_model_parallel_size > 1 and not args.sequence_parallel,
             "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (as Megatron)"),
            (args.expert_tensor_parallel_size not in (None, 1, args.tensor_model_parallel_size),
             f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size}: megalite shards experts over 1 rank "
             f"or over the tensor-parallel group ({args.tensor_model_parallel_size})"),
            (args.expert_model_parallel_size < 1 or e % args.expert_model_parallel_size,
             f"--num-experts {e} must be divisible by --expert-model-parallel-size {args.expert_model_parallel_size}"),
            ((args.world_size // args.pipeline_model_parallel_size) % (args.expert_model_parallel_size * etp),
             f"--expert-model-parallel-size {args.expert_model_parallel_size} x expert-tensor-parallel size {etp} must "
             f"divide the {args.world_size // args.pipeline_model_parallel_size} ranks of a pipeline stage (Megatron's "
             "expert grid)"),
            (args.fp16 and args.expert_model_parallel_size > 1, "--fp16 with --expert-model-parallel-size > 1 is not "
                                                                "supported (as Megatron); use --bf16"),
            (args.expert_model_parallel_size > 1 and args.data_parallel_shares == "auto",
             "--data-parallel-shares auto with --expert-model-parallel-size > 1: ranks that run different "
             "micro-batch counts would dispatch tokens a different number of times; give the shares"),
            (args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid",
             "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as Megatron)"),
            (args.moe_aux_loss_coeff < 0 or (args.moe_z_loss_coeff or 0) < 0, "--moe-aux-loss-coeff and "
                                                                               "--moe-z-loss-coeff must be >= 0"),
            (args.moe_expert_capacity_factor is not None and args.moe_expert_capacity_factor <= 0,
             f"--moe-expert-capacity-factor {args.moe_expert_capacity_factor} must be > 0"),
            (args.moe_pad_expert_input_to_capacity and args.moe_expert_capacity_factor is None,
             "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (as Megatron)"),
            (args.moe_shared_expert_gate and not args.moe_shared_expert_intermediate_size,
             "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"),
            *_group_routing_problems(args, e, k)):
        if cond:
            raise ConfigError(msg)
    notices = []
    if args.moe_shared_expert_overlap:
        notices.append("--moe-shared-expert-overlap accepted: the shared expert runs in line (speed only)")
    if args.moe_grouped_gemm and not torch.cuda.is_available():
        notices.append("--moe-grouped-gemm: on CPU the experts run one after the other (the Triton grouped GEMM "
                       "runs on CUDA)")
    print_notices(notices)


def _validate_fim(args):
    if not args.fim_data:
        return
    if args.mock_data:
        raise ConfigError("--fim-data rearranges real text; it does not compose with --mock-data (as Megatron)")
    rates = [("--fim-rate", args.fim_rate), ("--fim-spm-rate", args.fim_spm_rate),
             ("--fim-fragment-rate", args.fim_fragment_rate)]
    bad = [f"{flag} {v}" for flag, v in rates if v is not None and not 0 <= v <= 1]
    if bad:
        raise ConfigError(f"{', '.join(bad)}: a rate is a probability in [0, 1]")
    if args.fim_split_sample is not None and args.fim_fragment_rate is None:
        raise ConfigError(f"--fim-split-sample {args.fim_split_sample!r} needs --fim-fragment-rate (the FIM rate of "
                          "each fragment)")


FSDP_STAGES = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


def _validate_fsdp(args):
    """Megatron's FSDP flags onto the ZeRO stages (--use-distributed-optimizer --zero-stage)."""
    if args.use_megatron_fsdp and args.use_torch_fsdp2:
        raise ConfigError("--use-megatron-fsdp and --use-torch-fsdp2 are exclusive; pick one")
    if args.data_parallel_sharding_strategy != "optim_grads_params" and not args.use_megatron_fsdp:
        raise ConfigError(f"--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy} needs "
                          "--use-megatron-fsdp (or use --use-distributed-optimizer --zero-stage N)")
    if args.use_megatron_fsdp or args.use_torch_fsdp2:
        flag = "--use-megatron-fsdp" if args.use_megatron_fsdp else "--use-torch-fsdp2"
        if args.zero_stage is not None:
            raise ConfigError(f"--zero-stage {args.zero_stage} with {flag}: the sharding strategy sets the stage; "
                              "drop --zero-stage")
        stage = FSDP_STAGES[args.data_parallel_sharding_strategy] if args.use_megatron_fsdp else 3
        args.use_distributed_optimizer, args.zero_stage = stage > 0, stage or None
        if args.use_torch_fsdp2:
            print_notices(["--use-torch-fsdp2 accepted: megalite's ZeRO-3 (its own sharded buckets, unit by unit "
                           "with prefetch; composes with pipeline parallelism)"])
    if args.zero_stage == 3 and args.data_parallel_shares == "auto":
        raise ConfigError("--data-parallel-shares auto with ZeRO-3: ranks that run different micro-batch counts "
                          "would issue different numbers of parameter all-gathers; use --zero-stage 2 or give shares "
                          "that keep the counts equal")
    if not args.torch_fsdp2_reshard_after_forward and args.zero_stage != 3:
        raise ConfigError("--torch-fsdp2-no-reshard-after-forward needs ZeRO-3 (--use-torch-fsdp2, "
                          "--use-megatron-fsdp or --use-distributed-optimizer --zero-stage 3)")


def validate_data_parallel_reduction(args):
    """ZeRO's flags, the hierarchical and compressed DP reductions and what they do not compose with."""
    if (args.zero_stage is not None or args.overlap_param_gather) and not args.use_distributed_optimizer:
        raise ConfigError("--zero-stage and --overlap-param-gather need --use-distributed-optimizer")
    if args.hierarchical_grad_reduce and args.use_distributed_optimizer:
        raise ConfigError("--hierarchical-grad-reduce splits the plain data-parallel all-reduce; the distributed "
                          "optimizer's reduce-scatter is flat: drop one of --hierarchical-grad-reduce and "
                          "--use-distributed-optimizer")
    if args.grad_reduce_in_bf16 and (args.hierarchical_grad_reduce or args.grad_compression != "none"):
        other = "--hierarchical-grad-reduce" if args.hierarchical_grad_reduce else "--grad-compression"
        raise ConfigError(f"--grad-reduce-in-bf16 with {other} is not built yet in megalite: drop one")
    if args.grad_compression != "none":
        if args.use_distributed_optimizer or args.hierarchical_grad_reduce:
            raise ConfigError(f"--grad-compression {args.grad_compression} compresses the plain data-parallel "
                              "all-reduce; it does not compose with --use-distributed-optimizer (reduce-scatter) or "
                              "--hierarchical-grad-reduce: drop one")
        if args.fp16:  # an overflow left in a rank's error buffer would outlive the skipped step
            raise ConfigError(f"--grad-compression {args.grad_compression} does not compose with --fp16's loss scaling "
                              "(an unsent overflow would stay in the error feedback); use --bf16")
        if not 0 < args.grad_compression_ratio <= 1 or args.grad_compression_start_iter < 0:
            raise ConfigError(f"--grad-compression-ratio {args.grad_compression_ratio} must be in (0, 1] and "
                              f"--grad-compression-start-iter {args.grad_compression_start_iter} >= 0")
    if args.use_distributed_optimizer and args.zero_stage is None:
        args.zero_stage = 1
