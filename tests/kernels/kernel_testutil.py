"""Shared checks for kernel tests: float64 references, NaN-poisoned outputs, every gradient."""
import pytest
import torch

import kernels
from kernels import _dispatch

TOL32 = 1e-5  # DESIGN.md principle 2: fp32 vs float64 reference


def relerr(out, ref):
    """max |out - ref| / max |ref| (guarded against an all-zero reference)."""
    ref = ref.double()
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


@pytest.fixture(params=["triton", "torch"])
def backend(request):
    """Run a test on the Triton kernels (interpreter on CPU) and on the torch fallback."""
    _dispatch.POISON = True
    try:
        with kernels.use_backend(request.param):
            yield request.param
    finally:
        _dispatch.POISON = False


def check(fn, ref_fn, inputs, tol=TOL32, grad_out=None):
    """Compare fn(*inputs) and the grads of every input that requires grad with ref_fn in float64.

    Returns the output so callers can make extra checks."""
    out = fn(*inputs)
    ref_inputs = [t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
                  and t.is_floating_point() else t for t in inputs]
    ref = ref_fn(*ref_inputs)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten elements?)"
    err = relerr(out, ref)
    assert err <= tol, f"forward rel err {err:.3g} > {tol}"
    leaves = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if leaves:
        dy = torch.randn(ref.shape, dtype=torch.float64) if grad_out is None else grad_out.double()
        got = torch.autograd.grad(out, [inputs[i] for i in leaves], dy.to(out.dtype))
        want = torch.autograd.grad(ref, [ref_inputs[i] for i in leaves], dy)
        for i, g, w in zip(leaves, got, want):
            assert g is not None and g.shape == w.shape, f"grad of input {i}: {g} vs {w.shape}"
            assert torch.isfinite(g).all(), f"grad of input {i} has NaN/inf"
            e = relerr(g, w)
            assert e <= tol, f"grad of input {i}: rel err {e:.3g} > {tol}"
    return out


def cuda_relerr_ok(out, ref, tol):
    """GPU tests: low-precision output vs fp32 reference, same max-abs relative measure."""
    err = relerr(out.float(), ref.float())
    assert err <= tol, f"rel err {err:.3g} > {tol}"


def tiny_gpt_losses(steps=2):
    """Losses of a one-layer Llama-shaped GPT trained `steps` SGD steps on the fused-kernel path (the self-check's
    and the race's tests: which path each kernel took shows in the losses)."""
    from megalite import parallel_state as ps
    from megalite.models import GPTModel
    from megalite.tensor_parallel import model_parallel_manual_seed
    from model_util import batch, tiny_config
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    try:
        cfg = tiny_config("llama", num_layers=1, fused_kernels=True)
        model = GPTModel(cfg)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        ids, labels = batch(cfg)
        out = []
        for _ in range(steps):
            loss = model(ids, labels=labels).float().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out
    finally:
        ps.destroy_model_parallel()
