"""Each communication primitive, forward and backward, against its definition on 2 and 4 ranks."""

import pytest
import torch

import megalite.tensor_parallel as tpl
from dist_util import run_on_ranks
from megalite import parallel_state as ps


def _full(seed, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _check(n):
    ps.initialize_model_parallel(n, 1)
    r = ps.get_tensor_model_parallel_rank()
    S, B, H = 4 * n, 3, 4 * n
    # Rank r's input and upstream gradient; the definitions below use every rank's.
    xs = [_full(10 + k, (S, B, H)) for k in range(n)]
    gs = [_full(20 + k, (S, B, H)) for k in range(n)]
    out = {}

    def run(fn, x, g_shape_fn):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        g = g_shape_fn(y)
        y.backward(g)
        return y.detach(), x.grad

    # copy: identity / all-reduce of grads
    y, dx = run(tpl.copy_to_tensor_model_parallel_region, xs[r], lambda y: gs[r])
    out["copy"] = torch.equal(y, xs[r]) and torch.allclose(dx, sum(gs))
    # reduce: all-reduce / identity
    y, dx = run(tpl.reduce_from_tensor_model_parallel_region, xs[r], lambda y: gs[r])
    out["reduce"] = torch.allclose(y, sum(xs)) and torch.equal(dx, gs[r])
    # scatter (last dim): keep slice / all-gather grads
    gl = [g.chunk(n, -1)[k] for k, g in enumerate(gs)]
    y, dx = run(tpl.scatter_to_tensor_model_parallel_region, xs[0], lambda y: gl[r])
    out["scatter_last"] = torch.equal(y, xs[0].chunk(n, -1)[r]) and torch.equal(dx, torch.cat(gl, -1))
    # gather (last dim): all-gather / keep slice
    y, dx = run(tpl.gather_from_tensor_model_parallel_region, xs[r], lambda y: gs[0].repeat(1, 1, n))
    out["gather_last"] = torch.equal(y, torch.cat(xs, -1)) and torch.equal(dx, gs[0].repeat(1, 1, n).chunk(n, -1)[r])
    # scatter (sequence): keep slice / all-gather grads
    gf = [g.chunk(n, 0)[k] for k, g in enumerate(gs)]
    y, dx = run(tpl.scatter_to_sequence_parallel_region, xs[0], lambda y: gf[r])
    out["scatter_seq"] = torch.equal(y, xs[0].chunk(n, 0)[r]) and torch.equal(dx, torch.cat(gf, 0))
    # gather (sequence): all-gather / reduce-scatter of grads (TP consumer) or split
    big = [g.repeat(n, 1, 1) for g in gs]
    y, dx = run(lambda x: tpl.gather_from_sequence_parallel_region(x, True), xs[r], lambda y: big[r])
    out["gather_seq"] = torch.equal(y, torch.cat(xs, 0)) and torch.allclose(dx, sum(big).chunk(n, 0)[r])
    y, dx = run(lambda x: tpl.gather_from_sequence_parallel_region(x, False), xs[r], lambda y: big[0])
    out["gather_seq_split"] = torch.equal(dx, big[0].chunk(n, 0)[r])
    # reduce-scatter (sequence): sum then keep slice / all-gather grads
    y, dx = run(tpl.reduce_scatter_to_sequence_parallel_region, xs[r], lambda y: gf[r])
    out["reduce_scatter_seq"] = torch.allclose(y, sum(xs).chunk(n, 0)[r]) and torch.equal(dx, torch.cat(gf, 0))
    # linear over the gathered sequence: the same bits as gather + F.linear, only this rank's rows saved
    w, b = _full(30, (2 * H, H)), _full(31, (2 * H,))
    out["gather_linear"] = _same_as_gather_then_linear(xs[r], w, b, big[r][..., :1].expand(-1, -1, 2 * H))
    out["gather_linear_saves_rows"] = _saved_numel(xs[r], w, b) == xs[r].numel()
    return out


def _grads(f, x, w, b, g):
    x, w, b = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    y = f(x, w, b)
    y.backward(g)
    return [y, x.grad, w.grad, b.grad]


def _same_as_gather_then_linear(x, w, b, g):
    mine = _grads(tpl.linear_with_sequence_parallel_gather, x, w, b, g)
    autograd = _grads(lambda x, w, b: torch.nn.functional.linear(tpl.gather_from_sequence_parallel_region(x), w, b),
                      x, w, b, g)
    return all(torch.equal(m, a) for m, a in zip(mine, autograd))


def _saved_numel(x, w, b):
    """Elements the gathered linear keeps for backward beside its weight."""
    x, w, b = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        tpl.linear_with_sequence_parallel_gather(x, w, b)
    return sum(t.numel() for t in kept if t is not w)


@pytest.mark.parametrize("n", [2, 4])
def test_primitives_match_definitions(n):
    for rank, out in enumerate(run_on_ranks(_check, n, n)):
        assert len(out) == 10
        bad = [k for k, ok in out.items() if not ok]
        assert not bad, f"rank {rank} of {n}: primitives differ from their definition: {bad}"


def test_primitives_are_identities_on_one_rank():
    ps.initialize_model_parallel(1, 1)
    try:
        x = torch.randn(4, 2, 6)
        for f in (tpl.copy_to_tensor_model_parallel_region, tpl.reduce_from_tensor_model_parallel_region,
                  tpl.scatter_to_tensor_model_parallel_region, tpl.gather_from_tensor_model_parallel_region,
                  tpl.scatter_to_sequence_parallel_region, tpl.gather_from_sequence_parallel_region,
                  tpl.reduce_scatter_to_sequence_parallel_region):
            assert torch.equal(f(x), x), f.__name__
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_linear_is_autograds_linear_on_one_rank(dtype, device):
    """Its own backward GEMMs give autograd's bits (fp32 and bf16, with and without a bias; cuBLAS's too)."""
    ps.initialize_model_parallel(1, 1)
    try:
        x, w, b, g = (torch.randn(shape, generator=torch.Generator().manual_seed(k)).to(device, dtype)
                      for k, shape in enumerate([(24, 3, 40), (56, 40), (56,), (24, 3, 56)]))
        for bias in (b, None):
            fs = [tpl.linear_with_sequence_parallel_gather, torch.nn.functional.linear]
            got = [_grads(lambda x, w, _: f(x, w, bias), x, w, b, g)[:3] for f in fs]
            assert all(torch.equal(m, a) for m, a in zip(*got)), f"{dtype}, bias {bias is not None}"
    finally:
        ps.destroy_model_parallel()


def test_gathered_linear_under_autocast_and_frozen_weights():
    """Under autocast it casts as autocast's linear does (same bits, its gradients in the inputs' dtype); a
    frozen weight keeps no input rows for backward, an input that needs no gradient no weight."""
    ps.initialize_model_parallel(1, 1)
    try:
        x, w, b, g = (torch.randn(shape, generator=torch.Generator().manual_seed(k))
                      for k, shape in enumerate([(24, 3, 40), (56, 40), (56,), (24, 3, 56)]))
        mine, autocast = [], []  # the forward under autocast, the backward after it (as a training step runs)
        for f, out in ((tpl.linear_with_sequence_parallel_gather, mine), (torch.nn.functional.linear, autocast)):
            xs = [t.detach().clone().requires_grad_(True) for t in (x, w, b)]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = f(*xs)
            y.backward(g.bfloat16())
            out += [y] + [t.grad for t in xs]
        assert mine[0].dtype == torch.bfloat16 and mine[2].dtype == torch.float32
        assert all(torch.equal(m, a) for m, a in zip(mine, autocast))
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            tpl.linear_with_sequence_parallel_gather(x.requires_grad_(), w, b)  # w, b: no gradient
            tpl.linear_with_sequence_parallel_gather(x.detach(), w.requires_grad_(), b)
        assert [t.shape for t in kept] == [w.shape, x.shape], [t.shape for t in kept]
    finally:
        ps.destroy_model_parallel()
