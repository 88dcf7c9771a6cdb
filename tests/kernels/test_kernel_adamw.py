import pytest
import torch

import kernels

from kernel_testutil import TOL32, backend, cuda_relerr_ok, relerr  # noqa: F401

HP = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


def _run(n, steps, dtype_model, grad_scale=1.0):
    """Our adamw_step on flat buffers vs torch.optim.AdamW in float64, step for step."""
    p0 = torch.randn(n) * 0.1
    ours = p0.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    ref = p0.double().clone().requires_grad_()
    opt = torch.optim.AdamW([ref], foreach=False, **HP)
    for step in range(1, steps + 1):
        g = torch.randn(n) * (0.1 + step)
        model = torch.full((n,), float("nan"), dtype=dtype_model)  # poisoned: every element must be written
        kernels.adamw_step(ours, g / grad_scale, m, v, step=step, lr=HP["lr"], beta1=HP["betas"][0],
                           beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"],
                           grad_scale=grad_scale, model_params=model)
        ref.grad = g.double()
        opt.step()
        st = opt.state[ref]
        for got, want, what in ((ours, ref.detach(), "params"), (m, st["exp_avg"], "exp_avg"),
                                (v, st["exp_avg_sq"], "exp_avg_sq")):
            e = relerr(got, want)
            assert e <= TOL32, f"step {step} {what}: rel err {e:.3g}"
        assert torch.equal(model, ours.to(dtype_model)), "model copy must be the cast of the new params"
    return ours


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float16])
def test_adamw_matches_torch(backend, model_dtype):
    _run(37 * 1000 + 3, 3, model_dtype)


def test_adamw_grad_scale(backend):
    _run(1000, 2, torch.float32, grad_scale=1.0 / 1024)


def test_adamw_fallback_bitwise_torch():
    """On CPU the fallback is torch.optim.AdamW's own arithmetic: bitwise the same results."""
    n = 1003
    p = torch.randn(n)
    ref = p.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], foreach=False, **HP)
    m, v = torch.zeros(n), torch.zeros(n)
    with kernels.use_backend("torch"):
        for step in range(1, 4):
            g = torch.randn(n)
            kernels.adamw_step(p, g, m, v, step=step, lr=HP["lr"], beta1=HP["betas"][0], beta2=HP["betas"][1],
                               eps=HP["eps"], weight_decay=HP["weight_decay"])
            ref.grad = g
            opt.step()
            assert torch.equal(p, ref.detach())


@pytest.mark.cuda
def test_adamw_cuda():
    torch.manual_seed(0)
    n = 50_000_017
    p = torch.randn(n, device="cuda")
    ref = p.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], fused=False, foreach=False, **HP)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    model = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    for step in range(1, 4):
        g = torch.randn(n, device="cuda")
        kernels.adamw_step(p, g.bfloat16(), m, v, step=step, lr=HP["lr"], beta1=HP["betas"][0],
                           beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"], model_params=model)
        ref.grad = g.bfloat16().float()
        opt.step()
        cuda_relerr_ok(p, ref.detach(), 1e-5)
        assert torch.equal(model, p.bfloat16())
