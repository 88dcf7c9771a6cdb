"""The training hot path without host synchronisation (tests/support/sync_count.py counts them):
grad norm, clipping, fp16 unscale + finite check and fused AdamW stay on the device, in
foreach / fused passes; the forward TP all-reduce of a fresh GEMM output reuses its storage.
"""
import pytest
import torch

import kernels
from dist_util import run_on_ranks
from megalite import parallel_state as ps
from megalite.optimizer.clip_grads import clip_grads, get_grad_norm, grad_norm_tensor
from megalite.optimizer.loss_scaler import unscale_and_find_inf_
from megalite.tensor_parallel import RowParallelLinear, reduce_from_tensor_model_parallel_region
from sync_count import SyncCounter


@pytest.fixture
def tp1():
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()


def _params_and_grads():
    shapes = [(37, 100), (1000,), (3, 5, 7), (64, 64)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p in params:
        p.tensor_model_parallel = True
    return params, [torch.randn(s) * 3 for s in shapes]


def test_counter_sees_syncs():
    t = torch.ones(3)
    with SyncCounter() as sc:
        t.sum().item()
        if t.all():
            float(t[0])
    assert [n for n, _ in sc.calls] == ["item", "__bool__", "__float__"], sc.calls


@pytest.mark.parametrize("max_norm", [1.0, 1e6])
def test_grad_norm_and_clip_without_host_sync(tp1, max_norm):
    params, grads = _params_and_grads()
    ref = [g.double() for g in grads]
    want = torch.sqrt(sum((r ** 2).sum() for r in ref))
    with SyncCounter() as sc:
        norm = grad_norm_tensor(params, grads)
        clip_grads(grads, max_norm, norm)
    assert sc.count == 0, sc.calls
    # fp32 against float64: the squares of <= 4096 elements summed pairwise (<= 13 levels) and over
    # 4 tensors err by <= ~17u (u = 6e-8) of the sum, half that after the sqrt: 5e-7 <= 1e-6. Clipped
    # grads add one rounding of g * coef (rtol 1e-6 below).
    assert norm.shape == (1,) and abs(norm.item() - want.item()) <= 1e-6 * want.item()
    coef = min(1.0, max_norm / (want.item() + 1e-6))
    for g, r in zip(grads, ref):
        assert torch.allclose(g.double(), r * coef, rtol=1e-6, atol=0)
    assert abs(get_grad_norm(params, grads) - want.item() * coef) <= 1e-5 * want.item()


def test_fp16_unscale_and_finite_check_without_host_sync():
    grads = [torch.randn(37, 11, dtype=torch.float16), torch.randn(1000), torch.randn(5, dtype=torch.bfloat16)]
    ref = [g.double() for g in grads]
    with SyncCounter() as sc:
        found = unscale_and_find_inf_(grads, 1 / 1024)
    assert sc.count == 0, sc.calls
    assert found.item() == 0.0
    for g, r in zip(grads, ref):
        assert torch.equal(g.double(), (r / 1024).to(g.dtype).double())
    grads[1][999] = float("inf")
    assert unscale_and_find_inf_(grads, 1.0).item() == 1.0
    grads[1][999] = 0.0
    grads[2][0] = float("nan")
    assert unscale_and_find_inf_(grads, 1.0).item() == 1.0


def test_fused_adamw_over_a_flat_buffer_without_host_sync():
    n = 10_007
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g = torch.randn(n)
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    with SyncCounter() as sc:
        for step in (1, 2):
            kernels.adamw_step(p, g, m, v, step=step, lr=1e-2, weight_decay=0.1)
    assert sc.count == 0, sc.calls
    for _ in range(2):
        ref.grad = g.clone()
        opt.step()
    # the same elementwise Adam in another operation order: a few roundings of an update of size
    # ~lr = 1e-2 (each <= 1e-2 u = 6e-10) plus one of p per step: 2 steps stay within 2-3 ulp of p
    # (rtol 1e-6 is ~8 ulp; atol 1e-7 covers p near 0)
    assert torch.allclose(p, ref.detach(), rtol=1e-6, atol=1e-7)


def _row_parallel_in_place():
    ps.initialize_model_parallel(2, 1)
    torch.manual_seed(0)
    layer = RowParallelLinear(16, 8, bias=False, init_seed=3)
    x = torch.randn(5, 2, 8, requires_grad=True)
    seen = {}
    real_linear = torch.nn.functional.linear

    def linear(*a, **k):
        y = real_linear(*a, **k)
        seen["gemm"] = y.data_ptr()
        return y
    torch.nn.functional.linear = linear
    try:
        y = layer(x)
    finally:
        torch.nn.functional.linear = real_linear
    y.sum().backward()
    # against the copying all-reduce on the same inputs
    x2 = x.detach().clone().requires_grad_()
    y2 = reduce_from_tensor_model_parallel_region(real_linear(x2, layer.weight.detach()))
    y2.sum().backward()
    return {"same_storage": seen["gemm"] == y.data_ptr(), "equal": torch.equal(y, y2),
            "grad_equal": torch.equal(x.grad, x2.grad)}


def test_forward_tp_all_reduce_reuses_the_gemm_output():
    for rank, r in enumerate(run_on_ranks(_row_parallel_in_place, 2)):
        assert r == {"same_storage": True, "equal": True, "grad_equal": True}, (rank, r)


TRAIN = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
         "--global-batch-size 4 --train-iters 4 --log-interval 100 --vocab-size 250 --make-vocab-size-divisible-by 8 "
         "--lr 1e-3 --eval-interval 0 --eval-iters 0 --num-workers 0 --mock-data --clip-grad 1.0").split()


def _syncs_per_iteration(argv):
    """Synchronising calls of each training iteration (train step + the loop's own work)."""
    import pretrain_gpt
    from megalite import training
    from megalite.cli.parser import parse_args
    from megalite.training import step

    counter = SyncCounter()
    real_step = step.train_step

    def marked_step(*a, **k):
        counter.calls.append(("<iteration>", ""))
        return real_step(*a, **k)
    step.train_step = marked_step
    try:
        with counter:
            training.pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                              pretrain_gpt.forward_step, parse_args(argv, world_size=1))
    finally:
        step.train_step = real_step
        ps.destroy_model_parallel()
    per_iter, cur = [], None
    for name, where in counter.calls:
        if name == "<iteration>":
            cur = []
            per_iter.append(cur)
        elif cur is not None:
            cur.append(f"{name}@{where}")
    return per_iter


@pytest.mark.parametrize("dtype", [[], ["--fp16"]], ids=["fp32", "fp16"])
def test_training_iteration_syncs_at_most_once_outside_logging(dtype):
    per_iter = _syncs_per_iteration(TRAIN + dtype)
    assert len(per_iter) == 4
    non_logging = per_iter[:-1]  # --log-interval 100: only the last iteration logs
    worst = max(non_logging, key=len)
    assert len(worst) <= 1, f"{len(worst)} synchronising calls in a non-logging iteration: {worst}"
