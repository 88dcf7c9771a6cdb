"""The delayed recipe's arithmetic (megalite/tensor_parallel/fp8.py Fp8Site): the scale of iteration k is from
exactly the amaxes of iterations k-L..k-1 (`max`) or k-1 (`most_recent`), each the largest over that iteration's
micro-batches; the first iteration scales by the tensor's own amax; a history restored from its state dict goes on
as the uninterrupted one. Through the torch ops and through the fused cast-and-amax kernel (Triton's interpreter)."""

import types

import pytest
import torch

import kernels
from megalite.tensor_parallel.fp8 import Fp8Site, iteration_amaxes, roll, scale_inverse, scaled

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ONE = types.SimpleNamespace(tp=1, cp=1)
# per iteration, its two micro-batches' amaxes (of x; dy's are a thousandth of them)
AMAXES = [[3.0, 5.0], [2.0, 1.0], [7.0, 0.5], [1.0, 1.0], [0.25, 0.5], [4.0, 2.0], [0.5, 0.5]]


def _with_amax(a, seed):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
    return x / x.abs().max() * a  # (the largest element exactly a)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_the_scale_of_iteration_k_is_from_the_amaxes_before_it(algo, backend):
    site, seen = Fp8Site("hybrid", "delayed", history_len=3, algo=algo, grid=ONE), []
    with kernels.use_backend(backend):
        for k, amaxes in enumerate(AMAXES):
            if k == 3:  # the state dict carries the histories: a fresh site goes on as this one
                state, site = site.state_dict(), Fp8Site("hybrid", "delayed", history_len=3, algo=algo, grid=ONE)
                site.load_state_dict(state)
            for i, a in enumerate(amaxes):
                for which, dtype, scale in (("x", E4M3, 1.0), ("dy", E5M2, 1e-3)):
                    t = _with_amax(a * scale, 10 * k + i)
                    q, inverse = site.quantize(which, t)
                    known = [m * scale for m in seen[-3:]]
                    want = a * scale if not known else max(known) if algo == "max" else known[-1]
                    expect, undo = scaled(t, dtype, torch.tensor(want), 0)
                    assert q.dtype == dtype and torch.equal(q.view(torch.uint8), expect.view(torch.uint8)), (k, which)
                    assert inverse.item() == undo.item() == scale_inverse(dtype, torch.tensor(want), 0).item(), \
                        (k, which)
            roll(iteration_amaxes([types.SimpleNamespace(fp8=site)], lambda t: t))
            seen.append(max(amaxes))
    assert site.state_dict()["x"] == pytest.approx(seen[-1:-4:-1], rel=1e-7)  # newest first


def test_gradient_histories_are_kept_in_the_single_process_units():
    """A layout whose gradients are DP = 2 times the single process's (grad_units 2) keeps half of each gradient
    amax in its history and scales its gradients by twice the history: the same scales, the histories any layout
    resumes."""
    site = Fp8Site("hybrid", "delayed", grid=ONE)
    site.grad_units = 2
    site.quantize("dy", _with_amax(6.0, 0))
    roll(iteration_amaxes([types.SimpleNamespace(fp8=site)], lambda t: t))
    assert site.state_dict()["dy"] == [3.0]
    t = _with_amax(1.0, 1)
    _, inverse = site.quantize("dy", t)
    assert inverse.item() == scale_inverse(E5M2, torch.tensor(6.0), 0).item()
