"""Parsed command-line arguments to the configuration dataclasses (config.py): the one mapping from flag
names to config fields, imported by the parser (arguments.py) and the checks (validation.py) alike."""

from megalite.config import ModelConfig, TrainingConfig
from megalite.mup import MUP_FLAGS
from megalite.optimizer_flags import OPTIMIZER_FIELDS


def model_config(args, vocab_size):
    """The ModelConfig of parsed arguments (its vocabulary given: the tokenizer's, or the checkpoint's)."""
    return ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
        seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings, vocab_size=vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, swiglu=args.swiglu,
        squared_relu=args.squared_relu,
        add_bias_linear=not args.disable_bias_linear, add_qkv_bias=args.add_qkv_bias,
        qk_clip=args.qk_clip, log_max_attention_logit=args.log_max_attention_logit,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        sequence_parallel=args.sequence_parallel, recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        pipeline_layout=getattr(args, "pipeline_layout", None),
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_virtual_pipeline_stage,
        params_dtype=training_config(args).params_dtype, fused_kernels=not args.no_fused_kernels, seed=args.seed,
        rotary_percent=args.rotary_percent, apply_layernorm_1p=args.apply_layernorm_1p, qk_layernorm=args.qk_layernorm,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling, rotary_interleaved=args.rotary_interleaved,
        use_flash_attn=args.use_flash_attn, deterministic=args.deterministic_mode,
        cp_comm_type=list(args.cp_comm_type) if args.context_parallel_size > 1 else None,
        reset_attention_mask=args.reset_attention_mask, calculate_per_token_loss=args.calculate_per_token_loss,
        num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_layer_freq=args.moe_layer_freq,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type, moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff, moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor, moe_router_dtype=args.moe_router_dtype,
        mtp_num_layers=args.mtp_num_layers, mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        moe_router_num_groups=args.moe_router_num_groups, moe_router_group_topk=args.moe_router_group_topk,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor, moe_token_drop_policy=args.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate, moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate, moe_per_layer_logging=args.moe_per_layer_logging,
        moe_grouped_gemm=args.moe_grouped_gemm, multi_latent_attention=args.multi_latent_attention,
        q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim, rope_type=args.rope_type,
        rotary_scaling_factor=args.rotary_scaling_factor, mscale=args.mscale, mscale_all_dim=args.mscale_all_dim,
        use_mup=args.use_mup,
        **{k: getattr(args, k) for k in vars(args) if k.startswith("dsa_indexer_")},
        experimental_attention_variant=args.experimental_attention_variant,
        **{dest: getattr(args, dest) for dest in MUP_FLAGS}, **_bert_fields(args))


def _bert_fields(args):
    bert = args.model_type == "bert"
    return dict(model_type=args.model_type, layernorm_position=args.layernorm_position,
                gelu="exact" if bert and not args.openai_gelu else "tanh", num_tokentypes=2 if bert else 0,
                bert_binary_head=bert and args.bert_binary_head)


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
