"""kernels.grouped_gemm (MoE experts) against a float64 per-expert loop, forward and both gradients,
on the Triton kernels (interpreter on CPU) and the torch fallback; and the experts' grouped path
(megalite/moe/experts.py, --moe-grouped-gemm) against their sequential loop."""
import pytest
import torch

import kernels
import kernels.grouped_gemm as G
from megalite.config import ModelConfig
from megalite.moe.experts import SequentialExperts
from megalite.transformer.mlp import MLP

from kernel_testutil import TOL32, backend, check, cuda_relerr_ok, relerr  # noqa: F401

# 70 rows over 4 experts: one with none, none a multiple of any block size (16, 64) or of each other
COUNTS = [20, 0, 37, 13]
K, M = 32, 48
# Tolerance: the float64 reference against fp32 products. Each output is a dot product of length
# K = 32 (forward), M = 48 (dx) or up to 37 rows (dw), accumulated in fp32 in the kernel's order;
# its rounding error is at most L * 2^-24 * sum|a_i b_i| (about 3e-6 of that sum at L = 48), and the
# sum is within a small factor of max|ref| for random inputs, so TOL32 = 1e-5 (DESIGN.md, fp32 vs
# float64) holds with margin; an expert offset off by one row errs by O(1) (see the fault test).


def _ref(x, counts, *ws):
    """The per-expert loop, written out: rows [start, start + n) of expert e times w[e].T."""
    w = ws[0].unbind(0) if len(ws) == 1 and ws[0].dim() == 3 else ws
    out, start = [], 0
    for n, we in zip(counts, w):
        out.append(x[start:start + n] @ we.t())
        start += n
    return torch.cat(out)


@pytest.fixture(params=[None, (16, 16, 16), (8, 16, 16)], ids=["house-blocks", "blocks16", "blocks8x16"])
def blocks(request):
    """The dtype's own blocks (one partial tile per expert), 16s (several row, column and k blocks
    per expert) and 8-row blocks (10 row blocks: two swizzle groups, the last one partial)."""
    G.BLOCKS = request.param
    try:
        yield request.param
    finally:
        G.BLOCKS = None


def _inputs(counts=COUNTS, e=None):
    e = len(counts) if e is None else e
    return torch.randn(sum(counts), K).requires_grad_(), (torch.randn(e, M, K) * 0.5).requires_grad_()


def test_grouped_gemm(backend, blocks):
    x, w = _inputs()
    check(lambda x, c, w: G.grouped_gemm(x, w, c), _ref, [x, COUNTS, w])


def test_grouped_gemm_weight_list(backend):
    """The experts' separate [M, K] weights (stacked inside): each gets its own gradient."""
    x, _ = _inputs()
    ws = [torch.randn(M, K).requires_grad_() for _ in COUNTS]
    check(lambda x, c, *ws: G.grouped_gemm(x, list(ws), c), _ref, [x, COUNTS, *ws])


def test_grouped_gemm_zero_rows(backend):
    """No rows at all: an empty output, and every expert's weight gradient is zero."""
    x, w = _inputs([0, 0, 0])
    y = G.grouped_gemm(x, w, [0, 0, 0])
    assert y.shape == (0, M)
    dx, dw = torch.autograd.grad(y, [x, w], torch.randn(0, M))
    assert dx.shape == (0, K) and torch.equal(dw, torch.zeros_like(w))


def test_an_off_by_one_expert_offset_is_caught(monkeypatch):
    """Fault injection: the kernels' tables move the boundary of experts 0 and 2 (the zero-count
    expert 1 between them) by one row; the comparison must fail."""
    orig = G._tables

    def shifted(counts, block_m, device):
        c = list(counts)
        c[0], c[2] = c[0] + 1, c[2] - 1
        return orig(c, block_m, device)
    monkeypatch.setattr(G, "_tables", shifted)
    x, w = _inputs()
    with kernels.use_backend("triton"), pytest.raises(AssertionError, match="rel err"):
        check(lambda x, c, w: G.grouped_gemm(x, w, c), _ref, [x, COUNTS, w])


def test_fallback_is_the_plain_loop_and_bad_inputs_are_refused():
    x, w = _inputs()
    with kernels.use_backend("torch"):
        want = torch.cat([xe @ we.t() for xe, we in zip(torch.split(x, COUNTS), w.unbind(0))])
        assert torch.equal(G.grouped_gemm(x, w, COUNTS), want)
        for bad_x, bad_w, bad_c, msg in ((x, w, [20, 0, 50], "counts"), (x, w, [21, 0, 37, 13], "counts"),
                                         (x, w, [21, -1, 37, 13], "counts"), (x[:, :31], w, COUNTS, "got x"),
                                         (x, w.double(), COUNTS, "one dtype")):
            with pytest.raises(ValueError, match=msg):
                G.grouped_gemm(bad_x, bad_w, bad_c)


# -- the experts' grouped path (--moe-grouped-gemm) ---------------------------------------------
def _experts(**kw):
    base = dict(num_layers=2, hidden_size=K, num_attention_heads=2, seq_length=6, vocab_size=32,
                num_moe_experts=len(COUNTS), moe_router_topk=2, add_bias_linear=False, moe_ffn_hidden_size=24,
                moe_grouped_gemm=True, hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return SequentialExperts(ModelConfig(**base), "decoder.layers.0.mlp.experts", MLP)


def _run(experts, rows, grouped):
    out = experts(rows, COUNTS, grouped=grouped)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    params = [p for _, p in experts.named_parameters()]
    return out, torch.autograd.grad(out, [rows] + params, dy)


@pytest.mark.parametrize("act", [dict(swiglu=True), dict(), dict(gelu="exact"), dict(squared_relu=True)],
                         ids=["swiglu", "gelu-tanh", "gelu-exact", "squared-relu"])
def test_grouped_experts_equal_the_sequential_loop(grid, act):
    """Under the interpreter, on CPU: the grouped path's outputs, row gradients and every expert
    parameter's gradient equal the loop's (fp32 summation order only: TOL32); the parameters keep
    their names; each expert layer's forward pre-hooks (--overlap-param-gather's waits) run once."""
    experts = _experts(**act)
    names = [n for n, _ in experts.named_parameters()]
    assert names == [f"local_experts.{e}.linear_fc{i}.weight" for e in range(len(COUNTS)) for i in (1, 2)]
    rows = torch.randn(sum(COUNTS), K).requires_grad_()
    calls = []
    for n, m in experts.named_modules():
        if n.endswith(("linear_fc1", "linear_fc2")):
            m.register_forward_pre_hook(lambda mod, args, n=n: calls.append(n))
    with kernels.use_backend("triton"):
        want, want_g = _run(experts, rows, grouped=False)
        calls.clear()
        got, got_g = _run(experts, rows, grouped=True)
    assert sorted(calls) == sorted(n for n, m in experts.named_modules() if n.endswith(("fc1", "fc2")))
    assert relerr(got, want) <= TOL32
    for name, g, w in zip(["rows"] + names, got_g, want_g):
        assert g.shape == w.shape and relerr(g, w) <= TOL32, name
    for g in got_g[3:5]:  # expert 1 has no rows: zero gradients (its gradient hooks still fire)
        assert torch.equal(g, torch.zeros_like(g))
    # on CPU the flag keeps the loop (bit for bit the sequential path)
    assert torch.equal(experts(rows, COUNTS), experts(rows, COUNTS, grouped=False))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, TOL32)])
def test_grouped_gemm_cuda(dtype, tol):
    """Real blocks on the GPU, uneven counts (one expert without rows); full-fp32 products for fp32."""
    torch.manual_seed(0)
    counts = [700, 0, 1333, 29, 2034]
    x = torch.randn(sum(counts), 1024, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(5, 2816, 1024, device="cuda", dtype=dtype) * 0.03).requires_grad_()
    y = G.grouped_gemm(x, w, counts)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = _ref(xr, counts, wr)
    dxr, dwr = torch.autograd.grad(yr, [xr, wr], dy.double())
    for got, want in ((y, yr), (dx, dxr), (dw, dwr)):
        cuda_relerr_ok(got, want, tol)
    assert torch.equal(dw[1], torch.zeros_like(dw[1]))
