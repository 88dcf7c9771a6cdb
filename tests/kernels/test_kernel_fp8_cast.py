"""kernels.fp8_cast: the Triton kernel (interpreter on CPU) gives torch's FP8 cast of clamp(x * scale) byte for
byte, and the input's amax, on every value where a rounding can go wrong."""
import pytest
import torch

import kernels
from kernels.fp8_cast import fp8_cast

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def _hard_values(dtype):
    """Every finite FP8 value, every midpoint of two neighbours (ties: to even) and the fp32 numbers either side of
    it, values over 14 decades (normal, subnormal, flushed to zero, saturated), signed zeros, fp32 subnormals."""
    every = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    every = every[torch.isfinite(every)].unique()
    mids = (every[1:] + every[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(30000, generator=g) * 10 ** (torch.rand(30000, generator=g) * 14 - 9)
    top = torch.finfo(dtype).max
    return torch.cat([every, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), spread,
                      torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2e-40, 1e30, -1e30, top, -top, top * 1.0001])])


@pytest.mark.parametrize("dtype", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 3.7, 2.0 ** -7])
def test_the_kernel_rounds_as_torch_casts(dtype, scale):
    x, s = _hard_values(dtype), torch.tensor(scale)
    want = (x * s).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    with kernels.use_backend("triton"):
        q, amax = fp8_cast(x, s, dtype, with_amax=True)
    assert q.dtype == dtype and q.shape == x.shape
    bad = (q.view(torch.uint8) != want.view(torch.uint8)).nonzero().flatten()
    assert not bad.numel(), (x[bad[:5]].tolist(), q[bad[:5]].float().tolist(), want[bad[:5]].float().tolist())
    assert amax.item() == x.abs().max().item()


def test_bf16_input_nan_and_empty():
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) * 300
    s = torch.tensor(0.9)
    with kernels.use_backend("triton"):
        q, amax = fp8_cast(x, s, torch.float8_e4m3fn, with_amax=True)
        nan, _ = fp8_cast(torch.tensor([float("nan"), 1.0]), torch.tensor(1.0), torch.float8_e5m2)
        empty, none = fp8_cast(torch.zeros(0, 4), s, torch.float8_e4m3fn, with_amax=True)
    assert torch.equal(q.view(torch.uint8), (x.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    assert amax.item() == x.float().abs().max().item()
    assert nan.float()[0].isnan() and nan.float()[1] == 1.0
    assert empty.shape == (0, 4) and none.item() == 0.0


def test_the_fallback_is_torchs_cast():
    x, s = torch.randn(100), torch.tensor(2.5)
    with kernels.use_backend("torch"):
        q, amax = fp8_cast(x, s, torch.float8_e5m2, with_amax=True)
        _, none = fp8_cast(x, s, torch.float8_e5m2)
    assert torch.equal(q.view(torch.uint8), (x * s).to(torch.float8_e5m2).view(torch.uint8)) and none is None
    assert amax.item() == x.abs().max().item()
    with pytest.raises(ValueError, match="kernels.fp8_cast: dtype must be one of"):
        fp8_cast(x, s, torch.bfloat16)


def _three_iterations(recipe, monkeypatch):
    """An FP8 linear layer's forward and both gradients over three iterations (delayed: the histories roll between
    them, so iterations 2 and 3 cast with the history's scale and take the amax in the same pass), and how many
    times the kernel ran with its amax."""
    import types

    from kernels import fp8_cast as module
    from megalite.tensor_parallel import fp8
    fused = []
    original = module._fp8_cast.run

    def counting(*a, **k):
        fused.append(k.get("WITH_AMAX"))
        return original(*a, **k)
    monkeypatch.setattr(module._fp8_cast, "run", counting)
    site, out = fp8.Fp8Site("hybrid", recipe, history_len=2, algo="max", grid=types.SimpleNamespace(tp=1, cp=1)), []
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g).requires_grad_(True)
    for _ in range(3):
        x = (torch.randn(32, 64, generator=g) * 4).requires_grad_(True)
        y = fp8.fp8_linear(x, w, site)
        y.backward(torch.randn(y.shape, generator=g) * 1e-3)
        out += [y.detach(), x.grad, w.grad.clone()]
        fp8.roll(fp8.iteration_amaxes([types.SimpleNamespace(fp8=site)], lambda t: t))
    return out, fused


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_layers_through_the_kernel_are_the_torch_path(recipe, monkeypatch):
    """The FP8 linear layers' quantization through the kernel (delayed: cast and amax fused once a history scales
    the tensor) gives the torch path's outputs and gradients bit for bit."""
    with kernels.use_backend("triton"):
        got, fused = _three_iterations(recipe, monkeypatch)
    with kernels.use_backend("torch"):
        want, unused = _three_iterations(recipe, monkeypatch)
    assert not unused and all(torch.equal(a, b) for a, b in zip(got, want))
    # (per iteration: x, w, dy cast; delayed from iteration 2 on with the amax: 6 of 9)
    assert fused == ([False] * 3 + [True] * 6 if recipe == "delayed" else [False] * 9), fused


def test_no_fused_kernels_keeps_fp8_casts_in_torch(monkeypatch):
    """--no-fused-kernels (an FP8 site built with fused=False): its casts take torch's ops even where the kernel
    would run."""
    import types

    from kernels import fp8_cast as module
    from megalite.tensor_parallel.fp8 import Fp8Site
    ran = []
    monkeypatch.setattr(module._fp8_cast, "run", lambda *a, **k: ran.append(1))
    x = torch.randn(4, 8)
    with kernels.use_backend("triton"):
        Fp8Site("hybrid", "tensorwise", grid=types.SimpleNamespace(tp=1, cp=1), fused=False).quantize("x", x)
        assert not ran
        Fp8Site("hybrid", "tensorwise", grid=types.SimpleNamespace(tp=1, cp=1)).quantize("x", x)
        assert ran
