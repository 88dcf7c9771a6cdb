"""Genuine Megatron-LM `torch_dist` checkpoints for the tests, made by megatron-core itself on CPU ranks.

save_all(specs) builds megatron-core's GPTModel (the local layer spec, CPU initialisation) on the gloo ranks of a
test world (tests/support/dist_util.run_on_ranks) at each spec's TP x PP and saves it as Megatron-LM's
save_checkpoint lays a `--save` directory out: latest_checkpointed_iteration.txt, iter_NNNNNNN/ with DCP's .metadata
and __R_I.distcp files, metadata.json and common.pt holding the iteration, checkpoint_version 3.0, Megatron's
argparse namespace (with an enum member, as Megatron's has) and the LR schedule's state. logits_all(specs, tokens)
loads each checkpoint back with megatron-core's dist_checkpointing at TP1 x PP1 and returns its GPTModel's logits:
what Megatron itself computes from that directory. megatron-core's async writer wants psutil and CUDA calls (and
tied embeddings across stages a .cuda()); on CPU those are made harmless here (no effect on what is written)."""

import argparse
import os

# Two architectures of Megatron's flags: Llama's (rope, RMSNorm, SwiGLU, GQA, untied, no biases) and GPT-2's
# (learned positions, LayerNorm, tanh-GeLU with biases, tied embeddings).
KINDS = {
    "llama": dict(num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                  group_query_attention=True, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                  untie_embeddings_and_output_weights=True, add_bias_linear=False),
    "gpt2": dict(num_layers=4, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=4,
                 group_query_attention=False, position_embedding_type="learned_absolute", normalization="LayerNorm",
                 swiglu=False, untie_embeddings_and_output_weights=False, add_bias_linear=True),
}
# and an MoE one: Llama's attention, every other layer 4 SwiGLU experts (top 2, Megatron's softmax after the top-k)
# beside a dense layer, saved with its experts over 2 expert-parallel ranks where the world has them
MOE = dict(KINDS["llama"], num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_layer_freq=[0, 1, 0, 1],
           moe_grouped_gemm=False, moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather")
KINDS["moe"] = MOE
# and an MLA one (DeepSeek's attention: low-rank query and key-value latents, each normed; yarn rotary on a decoupled
# key of 8 channels shared by the heads, 8 + 8 query-key channels, 12 value channels a head)
MLA = dict(KINDS["llama"], num_query_groups=4, group_query_attention=False, multi_latent_attention=True,
           q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=12, qk_layernorm=True,
           rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0)
KINDS["mla"] = MLA
MLA_ONLY = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
            "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim")
MOE_ONLY = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_grouped_gemm",
            "moe_aux_loss_coeff", "moe_token_dispatcher_type")
VOCAB, SEQ = 128, 16


def megatron_args(kind, tp, pp, iteration, consumed, ep=1):
    """Megatron-LM's namespace as its checkpoints carry it (the fields a model and a run are built from)."""
    import torch
    from megatron.core.transformer.enums import AttnBackend
    k = KINDS[kind]
    return argparse.Namespace(
        **k, kv_channels=k["hidden_size"] // k["num_attention_heads"], seq_length=SEQ, max_position_embeddings=SEQ,
        **({} if "num_experts" in k else {"num_experts": None}),
        **({} if "multi_latent_attention" in k else {"qk_layernorm": False}),
        rotary_base=10000, rotary_percent=1.0, norm_epsilon=1e-5, add_qkv_bias=False,
        apply_layernorm_1p=False, vocab_size=None, padded_vocab_size=VOCAB, make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, micro_batch_size=1, global_batch_size=8,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=1 if "num_experts" in k else None,
        consumed_train_samples=consumed, consumed_valid_samples=0, train_iters=100, lr=1e-3, min_lr=1e-4,
        params_dtype=torch.float32, fp16=False, bf16=False, bias_gelu_fusion=True, ckpt_format="torch_dist",
        attention_backend=AttnBackend.auto, iteration=iteration, seed=1234, tokenizer_type="NullTokenizer")


def _cpu_only():
    import torch
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self  # (tied embeddings across stages: their first all-reduce)
    import megatron.core.transformer.moe.moe_utils as moe_utils
    moe_utils.te_general_gemm = None  # (the router's GEMM: named only where Transformer Engine is installed)
    import megatron.core.transformer.multi_latent_attention as mla
    if not isinstance(mla.TELinear, type):  # (without Transformer Engine, megatron's TE wrappers are stand-ins)
        mla.HAVE_TE = False
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fa
    fa._process_memory = lambda: 0  # (it needs psutil; only logged)


def build(kind, pre=True, post=True, tp=1, pp=1, ep=1):
    import functools

    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    k = KINDS[kind]
    moe = {} if "num_experts" not in k else dict(
        num_moe_experts=k["num_experts"], moe_router_topk=k["moe_router_topk"], moe_layer_freq=k["moe_layer_freq"],
        moe_ffn_hidden_size=k["moe_ffn_hidden_size"], moe_grouped_gemm=False, moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather", expert_model_parallel_size=ep)
    mla = {} if "multi_latent_attention" not in k else {f: k[f] for f in MLA_ONLY if f != "multi_latent_attention"}
    if mla:  # (its local attention's output width is kv_channels heads: MLA's value heads)
        mla["kv_channels"] = k["v_head_dim"]
    cfg = (MLATransformerConfig if mla else TransformerConfig)(
        **moe, **mla, qk_layernorm=k.get("qk_layernorm", False), num_layers=k["num_layers"],
        hidden_size=k["hidden_size"], ffn_hidden_size=k["ffn_hidden_size"],
        num_attention_heads=k["num_attention_heads"], num_query_groups=k["num_query_groups"],
        normalization=k["normalization"], add_bias_linear=k["add_bias_linear"], gated_linear_unit=k["swiglu"],
        # (tanh GeLU, as Megatron-LM's default bias-GeLU fusion computes it; written out: megatron-core's fused
        # bias-GeLU gave NaN on CPU under AVX2 kernels)
        activation_func=F.silu if k["swiglu"] else functools.partial(F.gelu, approximate="tanh"),
        bias_activation_fusion=False,
        use_cpu_initialization=True, pipeline_dtype=torch.float32, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5,
        init_method_std=0.05)
    spec = get_gpt_layer_local_spec(num_experts=k.get("num_experts"), moe_grouped_gemm=False,
                                    normalization=k["normalization"], qk_layernorm=k.get("qk_layernorm", False),
                                    multi_latent_attention=bool(mla))
    if mla:
        spec.submodules.self_attention.submodules.core_attention = _mla_core_attention()
    if moe:  # (every other layer: megatron-core's block spec of dense and MoE layers)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=k["normalization"])
    return GPTModel(cfg, spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ, pre_process=pre, post_process=post,
                    position_embedding_type=k["position_embedding_type"],
                    share_embeddings_and_output_weights=not k["untie_embeddings_and_output_weights"])


def _mla_core_attention():
    """megatron-core's local DotProductAttention for MLA, which only Transformer Engine's attention serves in
    megatron-core 0.16: MLA names its query-key and value widths (k_channels, v_channels), which the local one
    takes from the query and value tensors themselves (softmax(QK^T x MLA's scale) V, the same arithmetic)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLACoreAttention(DotProductAttention):
        def __init__(self, *a, k_channels=None, v_channels=None, **k):
            super().__init__(*a, **k)
    return MLACoreAttention


def _stepped(model, tp_rank):
    """megatron-core's DDP (small buckets, so a stage's parameters span several) and distributed optimizer (Adam)
    around `model`, one step on seeded gradients (the tied embedding's two copies the same ones): the optimizer."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    _train_on_cpu()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=3000), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True,
                                                       adam_eps=1e-3, clip_grad=0.0), [ddp])
    for n, p in model.named_parameters():
        seed = 7 if n in ("embedding.word_embeddings.weight", "output_layer.weight") else sum(map(ord, n))
        # (a parameter every TP rank holds whole gets the same gradient on each, as Megatron's would)
        g = torch.Generator().manual_seed(seed * 10 + (tp_rank if getattr(p, "tensor_model_parallel", False) else 0))
        p.main_grad.copy_(torch.randn(p.shape, generator=g) * 0.01)
    optimizer.step()
    return optimizer


def _save(root, kind, tp, pp, iteration, consumed, optim=None):
    """optim: {optimizer layout: directory}: the model stepped once by megatron-core's distributed optimizer and
    saved once per layout with its state (fully_reshardable, dp_reshardable)."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mps
    rank = dist.get_rank()
    ep = 2 if "num_experts" in KINDS[kind] and dist.get_world_size() // (tp * pp) % 2 == 0 else 1
    mps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    try:
        # (CPU initialisation: torch's generator; each expert-parallel rank its own experts, so none repeats)
        torch.manual_seed(1234 + mps.get_pipeline_model_parallel_rank() + 100 * mps.get_expert_model_parallel_rank())
        model = build(kind, mps.is_pipeline_first_stage(), mps.is_pipeline_last_stage(), tp, pp, ep)
        if kind in ("gpt2", "mla"):  # biases and norms away from their 0 / 1 initial values: a misplaced one shows
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n.endswith("bias") or "norm" in n:
                        p.add_(torch.randn_like(p) * 0.1)
                    if kind == "mla":
                        continue
                    # the tied word embedding: both stages' copies set from one seed (megatron-core sums the first
                    # stage's with the last stage's uninitialised copy on CPU, which is not always zero)
                    if n in ("embedding.word_embeddings.weight", "output_layer.weight"):
                        full = torch.randn(VOCAB, p.shape[1], generator=torch.Generator().manual_seed(7)) * 0.05
                        rows = VOCAB // tp
                        p.copy_(full[mps.get_tensor_model_parallel_rank() * rows:][:rows])
        optimizer = _stepped(model, mps.get_tensor_model_parallel_rank()) if optim else None
        for layout, where in (optim or {None: root}).items():
            path = os.path.join(where, f"iter_{iteration:07d}")
            model_sd = model.sharded_state_dict()
            state = {"args": megatron_args(kind, tp, pp, iteration, consumed, ep), "checkpoint_version": 3.0,
                     "iteration": iteration, "model": model_sd,
                     "opt_param_scheduler": {"max_lr": 1e-3, "min_lr": 1e-4, "num_steps": consumed, "warmup_steps": 0,
                                             "decay_steps": 800, "decay_style": "cosine"}}
            state["rng_state"] = _rng_state(where, tp, pp)
            if optimizer is not None:
                state["optimizer"] = optimizer.sharded_state_dict(model_sd,
                                                                  metadata={"distrib_optim_sharding_type": layout})
            if rank == 0:
                os.makedirs(path, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(state, path)
            dist.barrier()
            if rank == 0:
                with open(os.path.join(where, "latest_checkpointed_iteration.txt"), "w") as f:
                    f.write(str(iteration))
    finally:
        mps.destroy_model_parallel()


def _rng_state(root, tp, pp):
    """Megatron-LM's `rng_state` item as its get_rng_state makes it (a ShardedObject over (PP, TP), data-parallel
    rank 0's streams in a list; CUDA's generator states stood in by 16-byte Philox-sized tensors on CPU), with
    streams distinct per rank; what each (pp, tp) saved is also written to root/rng_expected_pp<p>_tp<t>.pt."""
    import random

    import numpy as np
    import torch
    from megatron.core import parallel_state as mps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    p, t, d = (mps.get_pipeline_model_parallel_rank(), mps.get_tensor_model_parallel_rank(),
               mps.get_data_parallel_rank())
    code = 10 * p + t
    random.seed(100 + code)
    np.random.seed(200 + code)
    torch.manual_seed(300 + code)
    for _ in range(code + 1):  # (a stream part-way: a position and, for Python's, a cached gaussian)
        random.gauss(0, 1), np.random.randn(3), torch.rand(3)
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.arange(16, dtype=torch.uint8) + code,
             "rng_tracker_states": {"model-parallel-rng": torch.arange(16, dtype=torch.uint8) * 2 + code}}
    if d == 0:
        os.makedirs(root, exist_ok=True)
        torch.save({"python": state["random_rng_state"], "numpy": state["np_rng_state"],
                    "torch": state["torch_rng_state"]}, os.path.join(root, f"rng_expected_pp{p}_tp{t}.pt"))
    return ShardedObject("rng_state", [state], (pp, tp), (p, t), replica_id=d)


def save_all(specs, iteration=5, consumed=40):
    """On the ranks of a world (tests/support/dist_util.run_on_ranks, gloo): each (root, kind, tp, pp) saved by
    megatron-core as a Megatron-LM --save directory (tp x pp of the world's ranks hold the model; the rest are
    data-parallel copies, as in a Megatron job). A spec's optional fifth item: {optimizer layout: directory} (the
    model stepped once by megatron-core's distributed optimizer, saved with its state in each layout)."""
    _cpu_only()
    for root, kind, tp, pp, *optim in specs:
        _save(root, kind, tp, pp, iteration, consumed, *optim)


def logits_all(specs, tokens):
    """On one rank: for each (root, kind), megatron-core's own GPTModel at TP1 x PP1 loaded from `root` by its
    dist_checkpointing, and its logits of `tokens` (what Megatron itself computes from that directory)."""
    import contextlib

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    _cpu_only()
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # (no dropout: no CUDA RNG needed)
    out = []
    for root, kind in specs:
        mps.initialize_model_parallel(1, 1)
        try:
            model = build(kind)
            it = open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip()
            sd = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                         os.path.join(root, f"iter_{int(it):07d}"))
            model.load_state_dict(sd["model"], strict=False)
            model.eval()
            s = tokens.shape[1]
            pos = torch.arange(s).unsqueeze(0).expand_as(tokens)
            causal = torch.triu(torch.ones(s, s), diagonal=1).bool()[None, None]  # (True: masked out, Megatron's)
            with torch.no_grad():
                out.append(model(tokens, pos, causal).clone())
        finally:
            mps.destroy_model_parallel()
    return out


def loaded_all(specs):
    """On the ranks of a world: for each (root, kind, tp, pp), megatron-core's GPTModel at that layout loaded from
    `root` by its dist_checkpointing; this rank's parameters ({name: tensor})."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mps
    _cpu_only()
    out = []
    for root, kind, tp, pp in specs:
        mps.initialize_model_parallel(tp, pp)
        try:
            model = build(kind, mps.is_pipeline_first_stage(), mps.is_pipeline_last_stage(), tp, pp)
            it = open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip()
            sd = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                         os.path.join(root, f"iter_{int(it):07d}"))
            model.load_state_dict(sd["model"], strict=False)
            out.append({n: p.detach().clone() for n, p in model.named_parameters()})
            dist.barrier()
        finally:
            mps.destroy_model_parallel()
    return out


def _train_on_cpu():
    """megatron-core's distributed optimizer hard-codes CUDA tensors and type names; on a CPU rank those become
    CPU ones (the arithmetic is torch's either way)."""
    import functools

    import torch
    if getattr(torch, "_megalite_cpu_training", False):  # (once per process)
        return
    torch._megalite_cpu_training = True
    _cpu_only()

    def cpu(fn):
        @functools.wraps(fn)
        def f(*a, **k):
            if "cuda" in str(k.get("device", "")):
                k["device"] = "cpu"
            return fn(*a, **k)
        return f
    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like", "ones_like"):
        setattr(torch, name, cpu(getattr(torch, name)))
    torch.cuda.current_stream = lambda *a, **k: None
    typ = torch.Tensor.type

    def cuda_type(self, *a, **k):
        t = typ(self, *a, **k)
        return t.replace("torch.", "torch.cuda.", 1) if not a and not k and isinstance(t, str) else t
    torch.Tensor.type = cuda_type


def train_save_continue(roots, kind, batches, before, opt, args, tp=1):
    """On one rank: megatron-core's GPTModel of `kind` with its DDP and distributed optimizer (Adam: opt's lr,
    weight_decay, betas, eps, clip_grad) and its LR scheduler (constant LR; it sets the weight decay) trains on
    batches[:before] (each [b, s + 1] token rows, the loss the mean over their tokens), is saved as Megatron-LM
    saves (its optimizer state in the fully_reshardable layout of --dist-ckpt-optim-fully-reshardable, or
    another: see roots; the LR schedule, the iteration) under `root`, then trains on the rest; returns the
    losses of those later steps. roots: {optimizer layout: directory}, each layout saved under its own
    (fully_reshardable; dp_reshardable, Megatron-LM's default); args: the namespace to record. On the ranks of the
    world at TP `tp` (data-parallel over the rest: each DP rank trains its contiguous part of every batch, the
    losses returned are the batch's mean)."""
    import contextlib

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    _train_on_cpu()
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    import torch.distributed as dist
    mps.initialize_model_parallel(tp, 1)
    dp, dp_rank = mps.get_data_parallel_world_size(), mps.get_data_parallel_rank()
    try:
        torch.manual_seed(1234)
        model = build(kind, tp=tp)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                                  overlap_grad_reduce=False), model)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", use_distributed_optimizer=True, **opt),
                                           [ddp])
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        samples = len(batches) * batches[0].shape[0]  # (Megatron-LM's schedule: constant LR; it also sets the
        scheduler = OptimizerParamScheduler(  # groups' weight decay, wd x wd_mult, at every step)
            optimizer, init_lr=0.0, max_lr=opt["lr"], min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=samples,
            lr_decay_style="constant", start_wd=opt["weight_decay"], end_wd=opt["weight_decay"], wd_incr_steps=samples,
            wd_incr_style="constant")
        losses = []
        for step, text in enumerate(batches, 1):
            text = text.chunk(dp)[dp_rank]
            tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
            s = tokens.shape[1]
            pos = torch.arange(s).unsqueeze(0).expand_as(tokens)
            causal = torch.triu(torch.ones(s, s), diagonal=1).bool()[None, None]
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            loss = ddp(tokens, pos, causal, labels=labels).float().mean()
            loss.backward()
            ddp.finish_grad_sync()
            optimizer.step()
            scheduler.step(increment=tokens.shape[0] * dp)
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=mps.get_data_parallel_group())
            losses.append(mean.item() / dp)
            if step == before:
                for layout, root in roots.items():
                    path = os.path.join(root, f"iter_{step:07d}")
                    os.makedirs(path, exist_ok=True)
                    model_sd = model.sharded_state_dict()  # (Megatron-LM saves its unwrapped model)
                    state = {"args": args, "checkpoint_version": 3.0, "iteration": step, "model": model_sd,
                             "optimizer": optimizer.sharded_state_dict(
                                 model_sd, metadata={"distrib_optim_sharding_type": layout}),
                             "opt_param_scheduler": scheduler.state_dict()}
                    dist_checkpointing.save(state, path)
                    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                        f.write(str(step))
        return losses[before:]
    finally:
        mps.destroy_model_parallel()
