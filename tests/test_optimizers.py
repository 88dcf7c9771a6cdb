"""--optimizer sgd / lion / muon on one process: against torch.optim's own SGD and Muon (+ AdamW for
the rest), Lion and Newton-Schulz against their definitions in float64, QKV split, the flags' errors."""

import pytest
import torch

import megalite.optimizer.newton_schulz as ns_mod
from megalite import parallel_state as ps
from megalite.config import ConfigError, TrainingConfig
from megalite.distributed import DistributedDataParallel
from megalite.distributed import DistributedDataParallelConfig as DDPConfig
from megalite.models import GPTModel
from megalite.optimizer import MixedPrecisionOptimizer
from megalite.optimizer.muon import MuonMatrices, is_muon_matrix
from megalite.optimizer.optimizer import no_weight_decay
from megalite.tensor_parallel import model_parallel_manual_seed
from model_util import batch, tiny_config

STEPS = 4


def _ns64(x, coeffs, steps, repeat_last=False):
    """Newton-Schulz by its definition, in float64: X / ||X||_F, then X <- aX + (bA + cA^2)X, A = X X^T,
    over the smaller side."""
    x = x.double()
    tall = x.shape[0] > x.shape[1]
    X = x.T if tall else x
    X = X / X.norm()
    for i in range(steps):
        a, b, c = coeffs[min(i, len(coeffs) - 1)] if repeat_last else coeffs[i % len(coeffs)]
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


@pytest.mark.parametrize("kind", ["simple", "quintic", "polar_express"])
@pytest.mark.parametrize("shape", [(37, 100), (100, 37)])
def test_newton_schulz_matches_float64(kind, shape):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g)
    ref = _ns64(x, ns_mod.COEFFICIENTS[kind], 5, kind in ns_mod.REPEAT_LAST)
    got = ns_mod.newton_schulz(x, 5, kind, "high")
    assert got.dtype == torch.float32 and got.shape == x.shape
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert err <= 1e-5, err  # fp32: a few hundred roundings of 2^-24, far below
    # bf16 (Megatron's default "medium"): each step rounds its two products to 8 bits (2^-8 each); errors
    # add through the (contracting) iteration: at most steps x 2 x 2^-8
    low = ns_mod.newton_schulz(x, 5, kind, "medium")
    err = ((low.double() - ref).norm() / ref.norm()).item()
    assert err <= 5 * 2 * 2 ** -8, err
    # and it orthogonalises: the singular values move towards 1 (the quick sets overshoot, within (0.3, 1.3))
    s = torch.linalg.svdvals(got.double())
    assert s.min() > 0.3 and s.max() < 1.3, s


def _pair(flavour, tcfg, torch_optimizers, steps=STEPS, **cfg):
    """Weights after `steps` steps of megalite's optimizer and of torch's (built from the torch model's
    named parameters), both from the same initial weights on the same (memorisable) batch."""
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    try:
        config = tiny_config(flavour, **cfg)
        model = DistributedDataParallel(GPTModel(config), DDPConfig(bucket_size=1000))
        opt = MixedPrecisionOptimizer([model], tcfg)
        model_parallel_manual_seed(0)
        twin = GPTModel(config)
        twin.load_state_dict(model.module.state_dict())
        torch_opts = torch_optimizers(list(twin.named_parameters()))
        ids, labels = batch(config)
        losses = []
        for _ in range(steps):
            model.zero_grad_buffer()
            loss = model(ids, labels=labels).mean()
            loss.backward()
            model.finish_grad_sync()
            opt.step()
            losses.append(loss.item())
            for o in torch_opts:
                o.zero_grad()
            twin(ids, labels=labels).mean().backward()
            for o in torch_opts:
                o.step()
        assert losses[-1] < losses[0] - 0.1, losses  # it learns
        return dict(model.module.named_parameters()), dict(twin.named_parameters())
    finally:
        ps.destroy_model_parallel()


def _assert_close(ours, theirs, tol=1e-5):
    for n, p in theirs.items():
        err = ((ours[n] - p).abs().max() / p.abs().max()).item()
        assert err <= tol, f"{n}: relative error {err:.2e}"


def _decay_groups(named, wd):
    return [{"params": [p for n, p in named if not no_weight_decay(n, p)], "weight_decay": wd},
            {"params": [p for n, p in named if no_weight_decay(n, p)], "weight_decay": 0.0}]


def test_sgd_matches_torch_sgd():
    tcfg = TrainingConfig(optimizer="sgd", lr=0.5, sgd_momentum=0.9, weight_decay=0.1, clip_grad=0.0,
                          global_batch_size=2)
    ours, theirs = _pair("gpt2", tcfg, lambda named: [torch.optim.SGD(_decay_groups(named, 0.1), lr=0.5,
                                                                        momentum=0.9)])
    _assert_close(ours, theirs)


def test_muon_matches_torch_muon_and_adamw():
    """torch.optim.Muon on the hidden matrices, torch.optim.AdamW on the rest. The conventions meet
    with --muon-scale-mode shape_scaling (torch's adjust_lr_fn "original"), --muon-nesterov, --muon-momentum
    0.95, --muon-coefficient-type simple (torch's coefficients), --muon-no-split-qkv (torch sees the fused
    weight) and Newton-Schulz in fp32 on both sides: megalite's --muon-fp32-matmul-prec high, and torch's
    iteration with its bfloat16 cast left out (the rest of torch's Muon runs as shipped)."""
    tcfg = TrainingConfig(optimizer="muon", lr=2e-2, weight_decay=0.1, clip_grad=0.0, global_batch_size=2,
                          adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-3, muon_momentum=0.95, muon_nesterov=True,
                          muon_scale_mode="shape_scaling", muon_coefficient_type="simple", muon_split_qkv=False,
                          muon_fp32_matmul_prec="high")

    def torch_side(named):
        hidden = [(n, p) for n, p in named if is_muon_matrix(p)]
        rest = [(n, p) for n, p in named if not is_muon_matrix(p)]
        assert len(hidden) == 8 and rest  # qkv, proj, fc1, fc2 of two layers
        return [torch.optim.Muon([p for _, p in hidden], lr=2e-2, weight_decay=0.1, momentum=0.95, nesterov=True,
                                 adjust_lr_fn="original"),
                torch.optim.AdamW(_decay_groups(rest, 0.1), lr=2e-2, betas=(0.9, 0.95), eps=1e-3)]

    def fp32_iteration(grad, coefficients, steps, eps):  # torch's _zeropower_via_newtonschulz without .bfloat16()
        a, b, c = coefficients
        x = grad.T if grad.size(0) > grad.size(1) else grad
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if grad.size(0) > grad.size(1) else x
    import torch.optim._muon as torch_muon
    original = torch_muon._zeropower_via_newtonschulz
    torch_muon._zeropower_via_newtonschulz = fp32_iteration
    try:
        ours, theirs = _pair("llama", tcfg, torch_side)
    finally:
        torch_muon._zeropower_via_newtonschulz = original
    _assert_close(ours, theirs)


def test_lion_matches_its_definition():
    """Lion (Megatron's emerging_optimizers rule) against its published update in float64."""
    tcfg = TrainingConfig(optimizer="lion", lr=1e-3, weight_decay=0.1, clip_grad=0.0, global_batch_size=2,
                          lion_beta1=0.9, lion_beta2=0.99)

    margins = []

    class Lion64(torch.optim.Optimizer):
        def __init__(self, groups):
            super().__init__(groups, {"lr": 1e-3})

        @torch.no_grad()
        def step(self):
            for g in self.param_groups:
                for p in g["params"]:
                    m = self.state[p].setdefault("m", torch.zeros_like(p, dtype=torch.float64))
                    w, grad = p.double(), p.grad.double()
                    interp = 0.9 * m + 0.1 * grad
                    # how far each sign is from flipping, relative to its terms (fp32 rounds at 2^-24 of them)
                    terms = (0.9 * m).abs() + (0.1 * grad).abs()  # (both 0: sign 0 on either side)
                    margins.append((interp.abs() / terms)[terms > 0].min().item())
                    w = w * (1 - g["lr"] * g["weight_decay"]) - g["lr"] * torch.sign(interp)
                    m.mul_(0.99).add_(0.01 * grad)
                    p.copy_(w)
    # llama: no biases (gpt2's key bias has a gradient of pure rounding noise, whose sign is arbitrary)
    ours, theirs = _pair("llama", tcfg, lambda named: [Lion64(_decay_groups(named, 0.1))])
    assert min(margins) > 1e-5, min(margins)  # no sign decided by rounding: the comparison below is exact
    _assert_close(ours, theirs)


def test_qkv_is_three_matrices_unless_asked_otherwise(grid):
    """Muon orthogonalises the fused QKV weight as q (all heads' rows), k and v apart; one matrix with
    --muon-no-split-qkv."""
    model = GPTModel(tiny_config("llama"))
    qkv = model.decoder.layers["0"].self_attention.linear_qkv.weight
    g = torch.Generator().manual_seed(1)
    m = torch.randn(qkv.shape, generator=g)
    groups, per_group, h = 4, (8 // 4 + 2), m.shape[1]
    d = m.shape[0] // (groups * per_group)
    rows = m.view(groups, per_group, d, h)
    q, k, v = (rows[:, :2].reshape(-1, h), rows[:, 2].reshape(-1, h), rows[:, 3].reshape(-1, h))
    c = TrainingConfig(optimizer="muon", muon_fp32_matmul_prec="high", muon_scale_mode="spectral")
    got = MuonMatrices([], c).orthogonalise(qkv, m).view(groups, per_group, d, h)
    for part, want in ((got[:, :2].reshape(-1, h), q), (got[:, 2].reshape(-1, h), k), (got[:, 3].reshape(-1, h), v)):
        ref = _ns64(want, ns_mod.COEFFICIENTS["quintic"], 5) * max(want.shape) ** 0.5
        assert ((part.double() - ref).norm() / ref.norm()).item() <= 1e-5
    whole = MuonMatrices([], TrainingConfig(optimizer="muon", muon_fp32_matmul_prec="high",
                                            muon_split_qkv=False)).orthogonalise(qkv, m)
    ref = _ns64(m, ns_mod.COEFFICIENTS["quintic"], 5) * max(m.shape) ** 0.5
    assert ((whole.double() - ref).norm() / ref.norm()).item() <= 1e-5


def test_muon_takes_hidden_matrices_only(grid):
    model = GPTModel(tiny_config("llama", num_moe_experts=2, moe_router_topk=1))
    taken = {n for n, p in model.named_parameters() if is_muon_matrix(p)}
    assert taken and all(n.endswith(".weight") for n in taken)
    assert not any("embedding" in n or "output_layer" in n or "router" in n or "norm" in n for n in taken), taken
    assert any("experts" in n for n in taken)


@pytest.mark.parametrize("argv, message", [
    (["--muon-momentum", "0.95"], "--muon-momentum needs --optimizer muon"),
    (["--optimizer", "muon", "--muon-scale-mode", "rms"], "--muon-scale-mode rms does not exist"),
    (["--optimizer", "muon", "--muon-coefficient-type", "cubic9"], "--muon-coefficient-type cubic9 does not exist"),
    (["--optimizer", "muon", "--muon-tp-mode", "sharded"], "--muon-tp-mode sharded does not exist"),
    (["--optimizer", "soap"], "--optimizer soap is not implemented"),
    (["--optimizer", "sgd", "--lion-beta1", "0.9"], "--lion-beta1 needs --optimizer lion"),
    (["--optimizer", "muon", "--fp16"], "--optimizer muon with --fp16"),
    (["--sgd-momentum", "0.5"], "--sgd-momentum needs --optimizer sgd"),
    (["--qk-clip-threshold", "50"], "--qk-clip-threshold need --qk-clip"),
    (["--qk-clip", "--disable-bias-linear", "--qk-clip-alpha", "1.5"], "--qk-clip-alpha 1.5 must be in (0, 1)"),
    (["--qk-clip"], "--qk-clip with a QKV bias"),
    (["--qk-clip", "--disable-bias-linear", "--qk-layernorm"], "--qk-clip with --qk-layernorm"),
])
def test_bad_optimizer_flags_fail_in_one_line(argv, message):
    from megalite.cli.parser import check_args
    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
            "--micro-batch-size 1 --global-batch-size 2 --train-iters 1 --lr 1e-3 --vocab-size 64").split()
    with pytest.raises(ConfigError) as e:
        check_args(base + argv, 1)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_max_logits_match_their_definition():
    """The largest causal q.k / sqrt(d) per query head (GQA: each key serves heads / groups queries)."""
    from megalite.transformer.max_logit import max_logits
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 37, 6, 8, generator=g), torch.randn(2, 37, 3, 8, generator=g)
    want = torch.full((6,), float("-inf"), dtype=torch.float64)
    for h in range(6):
        s = q[:, :, h].double() @ k[:, :, h // 2].double().transpose(1, 2) / 8 ** 0.5  # [b, s, t]
        s = s.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf"))
        want[h] = s.max()
    got = max_logits(q, k)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() <= 1e-6


def test_qk_clip_brings_the_largest_logit_to_the_threshold(grid):
    """After a step with --qk-clip, a query group whose largest logit passed the threshold sees exactly the
    threshold on the same input (q x eta^alpha, k x eta^(1-alpha)); the other groups are untouched."""
    from megalite.optimizer.qk_clip import clip_qk
    config = tiny_config("llama", num_layers=1, qk_clip=True)
    model = DistributedDataParallel(GPTModel(config), DDPConfig(bucket_size=1000))
    opt = MixedPrecisionOptimizer([model], TrainingConfig(global_batch_size=2))
    attn = model.module.decoder.layers["0"].self_attention
    ids, labels = batch(config)
    model.train()
    model(ids, labels=labels)
    before = attn.max_logits.view(attn.groups_local, -1).amax(1)
    threshold = float(before.sort().values[1])  # between the groups: some clipped, some not
    assert (before > threshold).any() and (before <= threshold).any(), before
    top = clip_qk([model], opt, threshold, 0.3)
    assert top == before.max().item() and attn.max_logits is None
    model(ids, labels=labels)
    after = attn.max_logits.view(attn.groups_local, -1).amax(1)
    for b, a in zip(before.tolist(), after.tolist()):
        if b > threshold:
            assert abs(a - threshold) <= 1e-5 * threshold, (before, after, threshold)
        else:
            assert a == b, (before, after)
