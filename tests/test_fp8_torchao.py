"""megalite's FP8 linear layer against an external reference: torchao's Float8Linear in emulation mode
(torchao.float8, the test extra's), which implements the same tensorwise recipe (dynamic scaling; e4m3 input and
weight, e5m2 gradients: --fp8-format hybrid --fp8-recipe tensorwise). torchao's other recipes differ from
megalite's on purpose (its rowwise rounds scales to powers of two and casts the gradients to e4m3), so only this
one is compared.

The arithmetic is the same but for one rounding: torchao dequantizes by dividing by the scale, megalite (as
torch._scaled_mm) by multiplying with its reciprocal. Each dequantized operand is then within 2 units of roundoff
u = 2^-24 of the other's, each product within 4u, and each output a K-term fp32 sum on both sides, so an element
of the forward and of both gradients is within (2K + 4) u sum_k |a_k| |b_k| of torchao's."""

import types

import pytest
import torch

from megalite.tensor_parallel.fp8 import Fp8Site, fp8_linear

float8 = pytest.importorskip("torchao.float8", reason="torchao (the test extra) is not installed: the external FP8 "
                                                       "reference is unavailable")
U = 2.0 ** -24


def _bound(a, b):
    return (2 * a.shape[1] + 4) * U * (a.abs().double() @ b.abs().double())


def _dequantized(t, dtype):
    top = torch.finfo(dtype).max
    scale = top / t.abs().amax().float()
    return (t.float() * scale).clamp(-top, top).to(dtype).float() / scale


@pytest.mark.parametrize("shape", [(4, 32, 256, 192), (3, 50, 96, 80)], ids=["k256", "k96"])
def test_tensorwise_layer_is_torchaos_float8_linear(shape):
    b, s, k, n = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, k, generator=g) * 3
    w = torch.randn(n, k, generator=g) * 0.05
    dy = torch.randn(b, s, n, generator=g) * 1e-3

    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fp8_linear(xs, ws, Fp8Site("hybrid", "tensorwise", grid=types.SimpleNamespace(tp=1, cp=1)))
    y.backward(dy)

    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data.copy_(w)
    ao = float8.float8_linear.Float8Linear.from_float(lin, config=float8.Float8LinearConfig(emulate=True))
    xa = x.clone().requires_grad_(True)
    ya = ao(xa)
    ya.backward(dy)

    x2, dy2 = x.reshape(-1, k), dy.reshape(-1, n)
    dx_, w_, dy_ = _dequantized(x2, torch.float8_e4m3fn), _dequantized(w, torch.float8_e4m3fn), \
        _dequantized(dy2, torch.float8_e5m2)
    for what, ours, theirs, bound in (
            ("output", y.reshape(-1, n), ya.reshape(-1, n), _bound(dx_, w_.t())),
            ("input gradient", xs.grad.reshape(-1, k), xa.grad.reshape(-1, k), _bound(dy_, w_)),
            ("weight gradient", ws.grad, ao.weight.grad, _bound(dy_.t(), dx_))):
        err = (ours.double() - theirs.double()).abs()
        assert (err <= bound).all(), (what, err.max().item(), bound.max().item())
        assert (ours - theirs).abs().max() < 1e-2 * theirs.abs().max(), what  # (and not both zero or NaN)
