"""The kernels' self-check (kernels/self_check.py), through the Triton interpreter on CPU: every healthy
kernel passes it, a broken one is caught and replaced by its fallback with one line naming it, a run
with a broken kernel trains exactly as the fallback does, and the check can be turned off."""

import importlib

import pytest
import torch
import triton
import triton.language as tl

import kernels
from kernels import self_check
from kernel_testutil import tiny_gpt_losses

LN = importlib.import_module("kernels.layer_norm")  # the modules (the package's names are the functions)
SWIGLU = importlib.import_module("kernels.swiglu")


@pytest.fixture
def checked():
    """Triton forced (the interpreter) and every kernel checked on first use, from a clean slate."""
    self_check.reset()
    self_check.set_self_check("always")
    with kernels.use_backend("triton"):
        yield
    self_check.set_self_check("cuda")
    self_check.reset()


@triton.jit
def _broken_norm_fwd(X, W, B, Y, MEAN, RSTD, M, N, eps, IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK: tl.constexpr, ROWS: tl.constexpr, ONE_PASS: tl.constexpr, STAGES: tl.constexpr,
                     HOIST: tl.constexpr):
    """Writes y = x: the normalisation and the weight forgotten (persistent, as norm_kernels._norm_fwd)."""
    cols = tl.arange(0, BLOCK)
    for row in range(tl.program_id(0), M, tl.num_programs(0)):
        off = tl.cast(row, tl.int64) * N
        x = tl.load(X + off + cols, mask=cols < N, other=0.0)
        tl.store(Y + off + cols, x, mask=cols < N)
        if not IS_RMS:
            tl.store(MEAN + row, 0.0)
        tl.store(RSTD + row, 1.0)


def test_every_healthy_kernel_passes(checked):
    for name in self_check.KERNELS:
        assert self_check._check(name, torch.device("cpu"), torch.float32) is None, name


def test_a_wrong_kernel_is_replaced_with_one_line(checked, monkeypatch, capfd):
    monkeypatch.setattr(LN, "_norm_fwd", _broken_norm_fwd)
    x, w = torch.randn(8, 64), torch.rand(64) + 0.5
    y = kernels.rms_norm(x, w)
    assert torch.equal(y, torch.nn.functional.rms_norm(x, (64,), w, 1e-5))  # the fallback's result, this very call
    kernels.rms_norm(x, w)
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megalite kernels: rms_norm on cpu (Triton interpreter, float32) "
                                               "disagrees with its fallback (output: relative error"), err
    assert self_check.verdicts()[("rms_norm", "cpu", torch.float32)] is not None


def test_a_kernel_that_raises_is_replaced(checked, monkeypatch, capfd):
    def no_build(*a, **k):
        raise RuntimeError("PTX .version 8.7 does not support .target sm_70")
    monkeypatch.setattr(SWIGLU, "_SwigluFn", type("Broken", (), {"apply": staticmethod(no_build)}))
    x = torch.randn(4, 32)
    g, u = x.chunk(2, -1)
    assert torch.allclose(kernels.swiglu(x), torch.nn.functional.silu(g) * u)
    assert "swiglu on cpu (Triton interpreter, float32) raised RuntimeError: PTX .version 8.7" in capfd.readouterr().err


def test_off_means_unchecked(checked, monkeypatch):
    self_check.set_self_check("off")
    monkeypatch.setattr(LN, "_norm_fwd", _broken_norm_fwd)
    x, w = torch.randn(8, 64), torch.ones(64)
    assert torch.equal(kernels.rms_norm(x, w), x)  # the broken kernel ran: nothing stood in its way
    assert self_check.verdicts() == {}


def test_a_run_with_a_broken_kernel_trains_as_the_fallback(checked, monkeypatch):
    """The caught kernel's first call already returns the fallback's result: the losses are the
    losses of the run where that kernel was never trusted (every other kernel on Triton in both)."""
    monkeypatch.setattr(LN, "_norm_fwd", _broken_norm_fwd)
    caught = tiny_gpt_losses()
    assert self_check.verdicts()[("rms_norm", "cpu", torch.float32)] is not None
    assert self_check.verdicts()[("flash_attention", "cpu", torch.float32)] is None
    self_check.reset()
    self_check.distrust("rms_norm", "cpu", torch.float32, "set by the test")
    assert caught == tiny_gpt_losses()
    self_check.set_self_check("off")
    assert caught[:1] != tiny_gpt_losses(1), \
        "the broken kernel, run unchecked, must change the losses (else this proves nothing)"


def test_every_checked_call_names_a_kernel_with_a_check():
    """A kernel added without a check would be distrusted on every GPU (its check raises KeyError); a name
    checked as another kernel (kernels/choice.py's SELF_CHECK_ONLY: ring attention's blocks) counts as that one."""
    import pathlib
    import re

    from kernels.choice import SELF_CHECK_ONLY
    root = pathlib.Path(__file__).resolve().parents[2]
    names = {m for d in ("kernels", "megalite") for f in (root / d).rglob("*.py")
             for m in re.findall(r'(?:use_triton|_triton_path)\([^)]*kernel="(\w+)"', f.read_text())}
    assert "flash_attention_block" in names, "the ring-attention blocks' name is no longer found: update this test"
    assert {SELF_CHECK_ONLY.get(n, n) for n in names} == set(self_check.KERNELS)
