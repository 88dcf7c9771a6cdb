"""Optimizer pieces: loss scaler, skipped fp16 steps, weight-decay groups, LR schedule,
gradient clipping, and the DP buckets starting during backward."""

import math

import pytest
import torch

from dist_util import run_on_ranks
from megalite import parallel_state as ps
from megalite.config import TrainingConfig
from megalite.distributed import DistributedDataParallel
from megalite.distributed import DistributedDataParallelConfig as DDPConfig
from megalite.models import GPTModel
from megalite.optimizer import LRScheduler, MixedPrecisionOptimizer
from megalite.optimizer.loss_scaler import DynamicLossScaler
from megalite.tensor_parallel import model_parallel_manual_seed
from model_util import batch, tiny_config


def test_dynamic_loss_scaler_hysteresis_and_growth():
    s = DynamicLossScaler(initial_scale=1024, min_scale=1, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 1024  # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale == 512
    for _ in range(3):
        s.update(False)
    assert s.scale == 1024


def _model_and_opt(cfg_kw, tcfg):
    model = DistributedDataParallel(GPTModel(tiny_config("gpt2", **cfg_kw)), DDPConfig(bucket_size=1000))
    return model, MixedPrecisionOptimizer([model], tcfg)


def test_fp16_skips_step_with_inf_and_recovers(grid):
    tcfg = TrainingConfig(fp16=True, initial_loss_scale=2.0 ** 16, hysteresis=1, lr=1e-2, global_batch_size=2)
    model, opt = _model_and_opt({"params_dtype": torch.float16}, tcfg)
    cfg = model.module.config
    ids, labels = batch(cfg)
    before = [p.detach().clone() for p in model.parameters()]
    model.zero_grad_buffer()
    opt.scale_loss(model(ids, labels=labels).float().mean()).backward()
    model.finish_grad_sync()
    next(model.parameters()).main_grad.view(-1)[0] = float("inf")  # injected overflow
    stepped, norm = opt.step()
    assert not stepped and norm is None
    assert opt.loss_scale == 2.0 ** 15
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "a skipped step changed weights"
    model.zero_grad_buffer()
    opt.scale_loss(model(ids, labels=labels).float().mean()).backward()
    model.finish_grad_sync()
    stepped, norm = opt.step()
    assert stepped and math.isfinite(norm)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_weight_decay_groups(grid):
    model, opt = _model_and_opt({}, TrainingConfig(weight_decay=0.1, global_batch_size=2))
    named = dict(model.module.named_parameters())
    decay = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in named.items():
        expect_decay = p.ndim >= 2
        assert (id(p) in decay) == expect_decay, name
    assert any("layernorm" in n for n in named) and any(n.endswith("bias") for n in named)


def test_lr_schedule_warmup_then_cosine():
    class _Opt:
        param_groups = [{"lr": 0.0}]
    s = LRScheduler(_Opt, max_lr=1.0, min_lr=0.1, warmup_iters=4, decay_iters=14, decay_style="cosine")
    assert s.get_lr(1) == 0.25 and s.get_lr(4) == 1.0
    assert s.get_lr(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s.get_lr(14) == pytest.approx(0.1) and s.get_lr(20) == 0.1
    lin = LRScheduler(_Opt, 1.0, 0.0, 0, 10, "linear")
    assert lin.get_lr(5) == pytest.approx(0.5)
    assert LRScheduler(_Opt, 1.0, 0.0, 2, 10, "constant").get_lr(7) == 1.0
    # The first iteration trains with zero completed steps: LR 0 during warmup, as Megatron.
    assert _Opt.param_groups[0]["lr"] == 0.0


def test_clip_scales_to_max_norm(grid):
    model, opt = _model_and_opt({}, TrainingConfig(clip_grad=1e-3, lr=0.0, global_batch_size=2))
    ids, labels = batch(model.module.config)
    model.zero_grad_buffer()
    model(ids, labels=labels).mean().backward()
    model.finish_grad_sync()
    stepped, norm = opt.step()
    after = math.sqrt(sum(p.main_grad.double().pow(2).sum().item() for p in model.parameters()))
    assert norm > 1e-3 and after == pytest.approx(1e-3, rel=1e-5)


def _buckets_started_in_backward():
    ps.initialize_model_parallel(1, 1)  # DP = 2
    model_parallel_manual_seed(0)
    model = DistributedDataParallel(GPTModel(tiny_config("gpt2")), DDPConfig(bucket_size=2000))
    ids, labels = batch(model.module.config, seed=ps.get_data_parallel_rank())
    with model.no_sync():
        model(ids, labels=labels).mean().backward()
    started_in_accumulation = sum(b.handle is not None for b in model.buckets)
    model(ids, labels=labels).mean().backward()
    started = sum(b.handle is not None for b in model.buckets)
    model.finish_grad_sync()
    return len(model.buckets), started_in_accumulation, started


def test_dp_buckets_start_during_backward():
    for n, during_accum, started in run_on_ranks(_buckets_started_in_backward, 2):
        assert n > 3
        assert during_accum == 0, "no reduction may start on non-final micro-batches"
        assert started == n, f"only {started}/{n} buckets started before finish_grad_sync"


def _steps(fused_backend, n):
    import kernels
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    try:
        model, opt = _model_and_opt({}, TrainingConfig(lr=1e-2, weight_decay=0.1, global_batch_size=2))
        ids, labels = batch(model.module.config)
        for _ in range(n):
            model.zero_grad_buffer()
            model(ids, labels=labels).mean().backward()
            model.finish_grad_sync()
            with kernels.use_backend(fused_backend):  # only the optimizer step differs
                opt.step()
        return [p.detach().clone() for p in model.parameters()], opt.optimizer.state_dict()
    finally:
        ps.destroy_model_parallel()


def test_fused_adamw_path_matches_torch_adamw():
    """The optimizer's Triton AdamW path (run here by the interpreter) equals torch.optim.AdamW
    and keeps its state layout."""
    # One step compares the update itself; over several steps Adam amplifies last-bit
    # differences in near-zero gradients, which would test that amplification instead.
    ref, ref_state = _steps("auto", 1)  # CPU: torch.optim.AdamW
    fused, fused_state = _steps("triton", 1)
    for a, b in zip(fused, ref):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5
    assert any(not torch.equal(a, b) for a, b in zip(fused, _model_weights_at_init()))
    assert fused_state["state"].keys() == ref_state["state"].keys()
    for k, st in ref_state["state"].items():
        assert set(st) == set(fused_state["state"][k]) and float(fused_state["state"][k]["step"]) == 1.0


def _model_weights_at_init():
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    try:
        return [p.detach().clone() for p in GPTModel(tiny_config("gpt2")).parameters()]
    finally:
        ps.destroy_model_parallel()


def _one_step_decoupled(distributed, lr, decoupled_lr):
    """Named weights after one AdamW step of a tiny untied GPT (DP=1) at --lr / --decoupled-lr."""
    from megalite.optimizer import DistributedOptimizer
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    try:
        tcfg = TrainingConfig(lr=lr, decoupled_lr=decoupled_lr, weight_decay=0.1, global_batch_size=2,
                              lr_decay_style="constant")
        model = DistributedDataParallel(GPTModel(tiny_config("gpt2", untie_embeddings_and_output_weights=True)),
                                        DDPConfig(bucket_size=1000, use_distributed_optimizer=distributed))
        opt = (DistributedOptimizer if distributed else MixedPrecisionOptimizer)([model], tcfg)
        LRScheduler(opt, lr, 0.0, 0, 10, "constant", decoupled=(decoupled_lr, None))
        ids, labels = batch(model.module.config)
        model.zero_grad_buffer()
        model(ids, labels=labels).mean().backward()
        model.finish_grad_sync()
        opt.step()
        return {n: p.detach().clone() for n, p in model.module.named_parameters()}
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "zero"])
def test_decoupled_lr_steps_embedding_and_output_at_their_own_lr(distributed):
    """--decoupled-lr D with --lr L: the word embeddings and the output layer take exactly the
    step of a run at --lr D (same first gradient, same elementwise AdamW), every other weight
    exactly that of a run at --lr L; position embeddings are not among the decoupled."""
    both = _one_step_decoupled(distributed, 1e-3, 5e-2)
    at_l, at_d = _one_step_decoupled(distributed, 1e-3, None), _one_step_decoupled(distributed, 5e-2, None)
    decoupled = {"embedding.word_embeddings.weight", "output_layer.weight"}
    assert decoupled <= set(both) and "embedding.position_embeddings.weight" in both
    for name, w in both.items():
        ref, other = (at_d, at_l) if name in decoupled else (at_l, at_d)
        assert torch.equal(w, ref[name]), name
        assert not torch.equal(w, other[name]), name  # the two LRs really differ on this weight


def test_apply_wd_to_qk_layernorm_decays_those_norms_only():
    """--apply-wd-to-qk-layernorm (Megatron's qwen3_next rule): after one step the q/k norms' weights are the plain
    run's less lr x weight decay x their start (AdamW's decoupled decay); every other parameter equals the plain
    run's bit for bit (the same gradients, the same groups)."""
    from parity import LLAMA, layout, train
    model = LLAMA + ("--qk-layernorm", "--train-iters", "1", "--weight-decay", "0.1")
    plain = train(layout("plain", model=model))["params"]
    decayed = train(layout("qk_decayed", model=model, flags=("--apply-wd-to-qk-layernorm",)))["params"]
    qk = [n for n in plain if "q_layernorm" in n or "k_layernorm" in n]
    assert len(qk) == 2 * 4, qk  # (4 layers, a q and a k norm each)
    for name, p in plain.items():
        if name in qk:  # (norm weights start at 1; lr 1e-2 x wd 0.1 = 1e-3, far above fp32 rounding of ~1e-7)
            torch.testing.assert_close(decayed[name], p - 1e-2 * 0.1 * torch.ones_like(p), rtol=0, atol=1e-6)
        else:
            assert torch.equal(decayed[name], p), name


@pytest.mark.parametrize("zero", [(), ("--use-distributed-optimizer",)], ids=["replicated", "zero1"])
def test_the_weight_decay_increment_reaches_the_decayed_groups_only(zero):
    """--weight-decay-incr-style linear over 4 iterations of 8 samples: after them the decayed groups hold
    --end-weight-decay and the norms' and biases' groups 0 (the increment itself: megatron-core's get_wd in
    tests/test_lr_schedule_megatron.py)."""
    import pretrain_gpt
    from megalite.cli.parser import parse_args
    from megalite.training import pretrain
    from parity import BASE, learnable_datasets
    args = parse_args(list(BASE) + ["--train-iters", "4", "--weight-decay-incr-style", "linear",
                                    "--start-weight-decay", "0.0", "--end-weight-decay", "0.1"] + list(zero),
                      world_size=1)
    try:
        _, _, opt = pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args,
                             return_state=True)
        groups = opt.param_groups
    finally:
        ps.destroy_model_parallel()
    assert sorted({(g["decay"], g["weight_decay"]) for g in groups}) == [(False, 0.0), (True, 0.1)], groups
