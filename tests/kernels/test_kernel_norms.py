import pytest
import torch
import torch.nn.functional as F

import kernels
import importlib

ln_mod = importlib.import_module("kernels.layer_norm")  # the module, not the function
tuned = importlib.import_module("kernels.tuned")

from kernel_testutil import backend, check, cuda_relerr_ok  # noqa: F401


def _ref_ln(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps) * w
    return y + b if b is not None else y


def _ref_rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _inputs(rows, n, bias=True):
    x = (torch.randn(rows, n) * 2 + 0.5).requires_grad_()
    w = (1 + 0.5 * torch.randn(n)).requires_grad_()
    b = torch.randn(n).requires_grad_() if bias else None
    return x, w, b


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(backend, bias):
    x, w, b = _inputs(37, 1000, bias)
    check(lambda x, w, b: kernels.layer_norm(x, w, b, 1e-5), lambda x, w, b: _ref_ln(x, w, b, 1e-5), [x, w, b])


def test_rms_norm(backend):
    x, w, _ = _inputs(37, 1000, False)
    check(lambda x, w: kernels.rms_norm(x, w, 1e-6), lambda x, w: _ref_rms(x, w, 1e-6), [x, w])


def test_norms_chunked_rows(backend, monkeypatch):
    """Rows longer than the fused block go through the chunked loops (hidden up to 64K on GPU)."""
    monkeypatch.setattr(ln_mod, "FWD_FUSED_BYTES", 256 * 4)
    monkeypatch.setattr(ln_mod, "BWD_FUSED_ELEMS", 256)
    x, w, b = _inputs(37, 1000)
    check(lambda x, w, b: kernels.layer_norm(x, w, b, 1e-5), lambda x, w, b: _ref_ln(x, w, b, 1e-5), [x, w, b])
    check(lambda x, w: kernels.rms_norm(x, w, 1e-5), lambda x, w: _ref_rms(x, w, 1e-5), [x, w])


def test_norms_strided_3d(backend):
    """Non-contiguous 3-D input (a transposed view) and batch 3."""
    base = torch.randn(37, 3, 1000)
    x = base.transpose(0, 1).requires_grad_()  # [3, 37, 1000], not contiguous
    w = (1 + 0.5 * torch.randn(1000)).requires_grad_()
    b = torch.randn(1000).requires_grad_()
    assert not x.is_contiguous()
    check(lambda x, w, b: kernels.layer_norm(x, w, b, 1e-5), lambda x, w, b: _ref_ln(x, w, b, 1e-5), [x, w, b])


def _interpreter_distinct(kernel, n):
    """The configurations of a kernel's tuning space (at n's bucket) that run differently under the interpreter:
    rows per tile and, forward, whether w and b stay in registers. Warps, stages and programs per SM only change
    the machine code (the interpreter runs INTERPRET_PROGRAMS programs, each loop unpipelined)."""
    bucket = 1 << (n - 1).bit_length()
    out = {}
    for cfg in tuned.spaces()[kernel].candidates(bucket, torch.float32):
        key = (cfg["ROWS"], kernel.endswith(".fwd") and ln_mod._hoist(cfg["ROWS"], bucket, cfg["num_warps"]))
        out.setdefault(key, cfg)
    return list(out.values())


@pytest.mark.parametrize("kernel", ["layer_norm.fwd", "layer_norm.bwd", "rms_norm.fwd", "rms_norm.bwd"])
def test_norms_every_configuration(backend, kernel):
    """Every configuration the tuner may choose, on 37 rows: tiles of 1-8 rows over 3 persistent programs, so the
    programs walk unequal tile counts and the last tile is partial (37 = 4 * 8 + 5); w, b kept or reloaded."""
    if backend != "triton":
        pytest.skip("configurations are the Triton path's")
    configs = _interpreter_distinct(kernel, 1000)
    assert {c["ROWS"] for c in configs} >= {1, 2, 4}, configs
    x, w, b = _inputs(37, 1000, kernel.startswith("layer_norm"))
    for cfg in configs:
        with tuned.forced(kernel, cfg):
            if b is not None:
                check(lambda x, w, b: kernels.layer_norm(x, w, b, 1e-5), lambda x, w, b: _ref_ln(x, w, b, 1e-5),
                      [x, w, b])
            else:
                check(lambda x, w: kernels.rms_norm(x, w, 1e-5), lambda x, w: _ref_rms(x, w, 1e-5), [x, w])


def test_norms_fewer_rows_than_programs(backend):
    """2 rows, 3 programs, tiles of 4: one program, one partial tile (each program writes its dW row: they
    start as NaN here); and no rows at all (dW, dB are zeros)."""
    x, w, b = _inputs(2, 1000)
    with tuned.forced("layer_norm.bwd", {**ln_mod.default_config(1024, torch.float32, True), "ROWS": 4}):
        check(lambda x, w, b: kernels.layer_norm(x, w, b, 1e-5), lambda x, w, b: _ref_ln(x, w, b, 1e-5), [x, w, b])
    x0 = torch.randn(0, 1000, requires_grad=True)
    y = kernels.layer_norm(x0, w, b, 1e-5)
    gx, gw, gb = torch.autograd.grad(y, (x0, w, b), torch.randn_like(y))
    assert y.shape == (0, 1000) and gx.shape == (0, 1000) and not gw.any() and not gb.any()


def test_fallback_is_plain_torch():
    x, w, b = _inputs(37, 1000)
    with kernels.use_backend("torch"):
        assert torch.equal(kernels.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (1000,), w, b, 1e-5))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("n", [4096, 8192, 65536])
def test_norms_cuda(dtype, tol, n):
    torch.manual_seed(0)
    x = torch.randn(4096 if n < 65536 else 256, n, device="cuda", dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(n, device="cuda", dtype=dtype)).requires_grad_()
    b = (0.1 * torch.randn(n, device="cuda", dtype=dtype)).requires_grad_()
    dy = torch.randn_like(x)
    for fn, ref, args in [(kernels.layer_norm, _ref_ln, (w, b)), (kernels.rms_norm, _ref_rms, (w,))]:
        out = fn(x, *args, 1e-5)
        grads = torch.autograd.grad(out, (x,) + args, dy)
        xr = x.detach().float().requires_grad_()
        ar = tuple(a.detach().float().requires_grad_() for a in args)
        outr = ref(xr, *ar, 1e-5)
        gr = torch.autograd.grad(outr, (xr,) + ar, dy.float())
        cuda_relerr_ok(out, outr, tol)
        for g, r in zip(grads, gr):
            cuda_relerr_ok(g, r, tol)
