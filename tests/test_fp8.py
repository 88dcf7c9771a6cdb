"""FP8 training without Transformer Engine (--fp8-format / --fp8-recipe; megalite/tensor_parallel/fp8.py): the
GEMMs' arithmetic, layouts against the single process, the delayed recipe's histories through a checkpoint
(--fp8-param-gather: tests/test_fp8_param_gather.py)."""

import dataclasses
import math
import os
import types

import pytest
import torch

import pretrain_gpt
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.tensor_parallel.fp8 import Fp8Site, along, blocks, fp8_linear, scaled
from megalite.training import pretrain
from parity import BASE, MB2, MOE, layout, learnable_datasets, reference, run_layouts
from parity_check import mismatches

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ONE = types.SimpleNamespace(tp=1)  # (a grid of one TP rank: nothing to reduce)
TENSORWISE = ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")
DELAYED = ("--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max")
ROWWISE = ("--fp8-format", "hybrid", "--fp8-recipe", "rowwise")
BLOCKWISE = ("--fp8-format", "e4m3", "--fp8-recipe", "blockwise")


def _dequantized(t, dtype):
    q, undo = scaled(t, dtype, t.abs().amax(), 0)
    return q.float() * undo


def _fp32_gemm_of(got, a, b):
    """got is a @ b summed in fp32: within the accumulation bound k * 2^-24 * (|a| @ |b|) of the exact product,
    element by element, in whatever order this CPU's GEMM sums (torch._scaled_mm and torch.matmul take
    different orders on AMX machines, so bit equality is a property of one machine, not of the layer). A wrong
    operand (unquantized, the other format, a lost scale) is off by FP8's rounding, 2^-4 relative and more."""
    exact = a.double() @ b.double()
    bound = a.shape[1] * 2.0 ** -24 * (a.double().abs() @ b.double().abs())
    assert ((got.double() - exact).abs() <= bound).all(), ((got.double() - exact).abs() / bound).max()


@pytest.mark.parametrize("fmt,grad_dtype,wgrad", [("hybrid", E5M2, True), ("e4m3", E4M3, True),
                                                  ("hybrid", E5M2, False)])
def test_fp8_gemms_are_the_products_of_the_quantized_operands(fmt, grad_dtype, wgrad):
    """Forward, input gradient and weight gradient multiply the operands rounded to FP8 (x, w in e4m3, dy in
    e5m2 under hybrid) with fp32 products: on CPU exactly the fp32 GEMM of the dequantized operands.
    --no-fp8-wgrad: the weight gradient from the unquantized dy and x."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    y = fp8_linear(x, w, Fp8Site(fmt, "tensorwise", wgrad=wgrad, grid=ONE))
    dy = torch.randn_like(y) * 1e-3
    y.backward(dy)
    xq, wq = _dequantized(x.detach().reshape(-1, 32), E4M3), _dequantized(w.detach(), E4M3)
    dyq = _dequantized(dy.reshape(-1, 48), grad_dtype)
    _fp32_gemm_of(y.detach().reshape(-1, 48), xq, wq.t())
    _fp32_gemm_of(x.grad.reshape(-1, 32), dyq, wq)
    _fp32_gemm_of(w.grad, *((dyq.t(), xq) if wgrad else (dy.reshape(-1, 48).t(), x.detach().reshape(-1, 32))))
    full = x.detach() @ w.detach().t()
    assert 0 < (y - full).abs().max() / full.abs().max() < 0.1  # FP8 is not fp32, and not far from it


@pytest.mark.parametrize("recipe,wgrad", [("tensorwise", True), ("tensorwise", False), ("rowwise", True),
                                          ("blockwise", True)])
def test_a_split_backward_defers_the_weight_gradients_fp8_gemm(recipe, wgrad):
    """Under a zero-bubble schedule's B (a store given) the weight gets no gradient and the store its GEMM, which
    at W gives the immediate backward's gradient bit for bit; the input gradient is the same at once."""
    from megalite.pipeline.wgrad import WeightGradStore
    torch.manual_seed(0)
    x, w = torch.randn(4, 8, 256), torch.randn(128, 256)
    dy = torch.randn(4, 8, 128) * 1e-3
    got = {}
    for split in (False, True):
        xs, ws, store = x.clone().requires_grad_(), w.clone().requires_grad_(), WeightGradStore()
        y = fp8_linear(xs, ws, Fp8Site("hybrid", recipe, wgrad=wgrad, grid=ONE), store if split else None)
        with store.collecting((0, 0)):
            y.backward(dy)
        assert (ws.grad is None) == split, (split, ws.grad)
        deferred = store.run((0, 0))
        assert len(deferred) == split and all(p is ws for p, _ in deferred), deferred
        got[split] = (xs.grad, deferred[0][1] if split else ws.grad)
    for now, later, what in zip(got[False], got[True], ("input gradient", "weight gradient")):
        torch.testing.assert_close(later, now, rtol=0, atol=0, msg=what)


def test_rowwise_gemms_requantize_each_operand_along_its_contraction():
    """rowwise: the forward's x per token and w per output feature; the input gradient's dy per token and w per
    input feature; the weight gradient's dy per output feature and x per input feature (each from the unquantized
    tensor): exactly the fp32 GEMMs of those dequantized operands on CPU."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    y = fp8_linear(x, w, Fp8Site("hybrid", "rowwise", grid=ONE))
    dy = torch.randn_like(y) * 1e-3
    y.backward(dy)

    def dq(t, dim, dtype):
        q, undo = along(t, dim, dtype, 0, False, ONE)
        return q.float() * undo
    x2, dy2, w_ = x.detach().reshape(-1, 32), dy.reshape(-1, 48), w.detach()
    assert torch.equal(y.detach().reshape(-1, 48), dq(x2, 0, E4M3) @ dq(w_, 0, E4M3).t())
    assert torch.equal(x.grad.reshape(-1, 32), dq(dy2, 0, E5M2) @ dq(w_, 1, E4M3))
    assert torch.equal(w.grad, dq(dy2.t(), 0, E5M2) @ dq(x2, 1, E4M3))


def test_blockwise_scales_tiles_and_blocks():
    """blockwise (DeepSeek-V3's): a scale per 1 x 128 tile of x and dy along each GEMM's contraction, per 128 x 128
    block of w; each operand's values round to FP8 within their own block (a block of zeros next to a large one
    keeps its values), and the GEMMs are the products of those dequantized operands."""
    torch.manual_seed(0)
    t = torch.randn(3, 300)
    t[:, 128:256] *= 1e-4  # a small block: its own scale keeps it (one scale for the row would flush it)
    d = blocks(t, 1, 128, E4M3, 0)
    assert (d[:, 128:256] != 0).all() and ((d - t).abs() <= t.abs() / 8 + 1e-12).all()
    x = torch.randn(2, 8, 300, requires_grad=True)
    w = torch.randn(160, 300, requires_grad=True)
    y = fp8_linear(x, w, Fp8Site("hybrid", "blockwise", grid=ONE))
    dy = torch.randn_like(y) * 1e-3
    y.backward(dy)
    x2, dy2, w_ = x.detach().reshape(-1, 300), dy.reshape(-1, 160), w.detach()
    wd = blocks(w_, 128, 128, E4M3, 0)
    assert torch.equal(y.detach().reshape(-1, 160), blocks(x2, 1, 128, E4M3, 0) @ wd.t())
    assert torch.equal(x.grad.reshape(-1, 300), blocks(dy2, 1, 128, E5M2, 0) @ wd)
    assert torch.equal(w.grad, blocks(dy2.t(), 1, 128, E5M2, 0) @ blocks(x2.t(), 1, 128, E4M3, 0).t())


def _tp2_layers(recipes):
    """On 2 TP ranks, per recipe: a column- then a row-parallel FP8 layer (TP shards of 256: whole blocks) against
    the same layers whole on this process, from the same input."""
    from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    ps.initialize_model_parallel(2, 1)
    out = []
    try:
        grid, r = ps.current_grid(), ps.get_tensor_model_parallel_rank()
        for recipe in recipes:
            torch.manual_seed(0)
            x, w1, w2 = torch.randn(4, 2, 384), torch.randn(512, 384), torch.randn(384, 512)
            col = ColumnParallelLinear(384, 512, bias=False, grid=grid)
            row = RowParallelLinear(512, 384, bias=False, grid=grid)
            col.weight.data.copy_(w1[256 * r:256 * (r + 1)])
            row.weight.data.copy_(w2[:, 256 * r:256 * (r + 1)])
            col.fp8 = Fp8Site("hybrid", recipe, grid=grid)
            row.fp8 = Fp8Site("hybrid", recipe, row_parallel=True, grid=grid)
            xs = x.clone().requires_grad_(True)
            y = row(col(xs))
            (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
            one = Fp8Site("hybrid", recipe, grid=ONE)
            xr, w1r, w2r = (t.clone().requires_grad_(True) for t in (x, w1, w2))
            yr = fp8_linear(fp8_linear(xr, w1r, one), w2r, one)
            (yr * torch.linspace(-1, 1, yr.numel()).reshape(yr.shape)).sum().backward()
            out.append([((y - yr).abs().max() / yr.abs().max()).item(),
                        ((xs.grad - xr.grad).abs().max() / xr.grad.abs().max()).item(),
                        torch.equal(col.weight.grad, w1r.grad[256 * r:256 * (r + 1)])])
    finally:
        ps.destroy_model_parallel()
    return out


RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")


def test_tensor_parallel_fp8_layers_are_the_whole_layers():
    """TP2 column- and row-parallel FP8 layers compute the whole layers' function under every recipe: the ranks
    agree on the amax of every tensor (row) they hold shards of, and blockwise tiles never cross a shard of whole
    blocks. The column-parallel weight gradient is the whole layer's exactly; outputs and input gradients within
    the fp32 bound (the row-parallel sums reordered). (End to end, a TP run's reordered sums can already move an
    activation across an FP8 midpoint at step 1, so TP is held to its function here, layer by layer.)"""
    from dist_util import run_on_ranks
    for rank in run_on_ranks(_tp2_layers, 2, RECIPES):
        for recipe, (y_err, dx_err, dw_exact) in zip(RECIPES, rank):
            assert y_err <= 1e-5 and dx_err <= 1e-5 and dw_exact, (recipe, y_err, dx_err, dw_exact)


# A layout computes the single process's FP8 function: every scale is of the whole tensor (row, block), whatever
# the layout cuts (the delayed history grows once per iteration with the largest amax over every micro-batch and
# DP rank), so step 1 — the same weights, the same batch, the same machine's arithmetic — holds to DESIGN's bound
# (only fp32 sums after the GEMMs run in another order: DP's gradient reduction, the tied embedding's). From step
# 2 on the runs hold weights a rounding apart, and a value that rounding moves across the midpoint of two FP8
# neighbours lands an eighth of its size away (a block's or tensor's scale moves every value under it): the runs
# part as far as a rounding twin of the single process does (measured: TP2 delayed params 1.3e-2 after 6 steps vs
# twins' 9.8e-3..1.4e-2; PP2 blockwise 2.8e-3), or not at all for a while. The later steps are therefore not
# compared, nor TP end to end (its reordered forward sums can cross a midpoint at step 1 already, seen under
# another machine's rounding): TP is held to its function layer by layer above.
LAYOUTS = [layout("pp2_fp8_tensorwise", pp=2, model=TENSORWISE), layout("dp2_fp8_delayed", dp=2, model=DELAYED),
           layout("pp2_fp8_delayed_untied", pp=2, model=DELAYED + ("--untie-embeddings-and-output-weights",)),
           layout("dp2_fp8_rowwise", dp=2, model=ROWWISE),
           layout("pp2_fp8_blockwise", pp=2, model=BLOCKWISE), layout("dp2_fp8_blockwise", dp=2, model=BLOCKWISE),
           # CP: each rank holds part of every sequence, so an activation's or gradient's amax is the largest over
           # the CP ranks (the weights' are not split)
           layout("cp2_fp8_tensorwise", cp=2, model=TENSORWISE), layout("cp2_fp8_delayed", cp=2, model=DELAYED),
           # multi-token prediction: its projection and transformer layer in FP8 too, on the last stage
           layout("pp2_fp8_mtp_delayed", pp=2,
                  model=DELAYED + ("--mtp-num-layers", "1", "--position-embedding-type", "rope")),
           # interleaved pipeline (2 chunks a stage) and full recompute (each layer's forward, FP8 casts and the
           # delayed amaxes, run twice)
           layout("pp2_vp_fp8_delayed", pp=2, vp=1, model=DELAYED),
           layout("dp2_fp8_tensorwise_recompute", dp=2, recompute="full", model=TENSORWISE),
           # zero-bubble pipelines: each weight gradient's FP8 GEMM deferred to the schedule's W (its dy quantized
           # at B, with the input gradient's)
           layout("pp2_fp8_delayed_zbv", pp=2, model=DELAYED, flags=("--pipeline-schedule", "zbv")),
           layout("pp2_fp8_rowwise_zb_h1", pp=2, model=ROWWISE, flags=("--pipeline-schedule", "zb-h1")),
           layout("pp2_fp8_blockwise_zbv_full_recompute", pp=2, model=BLOCKWISE, recompute="full",
                  flags=("--pipeline-schedule", "zbv")),
           layout("pp2_fp8_tensorwise_dualpipev", pp=2, model=TENSORWISE, flags=("--pipeline-schedule", "dualpipev")),
           # MoE experts under EP2: an expert gets two micro-batches' rows at once and runs each apart, as the single
           # process does (tensorwise scales, row-wise and blockwise weight gradients' scales along the tokens)
           *(layout(f"ep2_fp8_{name}_{kind}", dp=2, model=MB2 + MOE + recipe,
                    flags=("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", kind))
             for name, recipe, kind in (("tensorwise", TENSORWISE, "alltoall"), ("delayed", DELAYED, "allgather"),
                                        ("rowwise", ROWWISE, "allgather"), ("blockwise", BLOCKWISE, "alltoall")))]
# Only step 1 is compared, so each layout (and its reference) trains 2 iterations, the second running what the first
# leaves (the delayed histories' roll, the FP8 weights requantized): 6 would triple this world's time for no check.
# That FP8 training learns is test_fp8_training_learns_the_chain's.
LAYOUTS = [dataclasses.replace(lay, base=lay.base + ("--train-iters", "2")) for lay in LAYOUTS]
STEP_ONE_ONLY = {"losses@1": 1e-5, "norms@1": 1e-5, "grads": 1e-5, "embedding grads": 1e-5,
                 "losses": float("inf"), "norms": float("inf"), "params": float("inf")}


def _amaxes_on_tp2_cp2():
    """On 4 ranks (TP2 x CP2): each rank's amaxes of its own x, w, dy under a column- and a row-parallel site."""
    ps.initialize_model_parallel(2, context_parallel_size=2)
    try:
        grid, rank = ps.current_grid(), torch.distributed.get_rank()
        t = torch.full((3,), float(rank + 1))  # (this rank's tensor: its amax is rank + 1)
        return [[Fp8Site("hybrid", "tensorwise", row_parallel=row, grid=grid).amax(k, t).item()
                 for k in ("x", "w", "dy")] for row in (False, True)]
    finally:
        ps.destroy_model_parallel()


def test_amaxes_are_reduced_over_the_ranks_that_split_each_tensor():
    """TP2 x CP2: a weight's amax over its TP shards; a TP-sharded activation or gradient (a row-parallel layer's
    x, a column-parallel one's dy) over TP x CP in one collective; a whole-across-TP one over CP."""
    from dist_util import run_on_ranks
    for rank, (column, row) in enumerate(run_on_ranks(_amaxes_on_tp2_cp2, 4)):
        tp_max, cp_max = (rank | 1) + 1, (rank | 2) + 1  # (TP ranks vary fastest, then CP)
        assert column == [cp_max, tp_max, 4.0] and row == [4.0, tp_max, cp_max], (rank, column, row)


def test_scales_along_the_tokens_are_refused_with_context_parallelism():
    from megalite.cli.parser import check_args
    from megalite.config import ConfigError
    for recipe in ("rowwise", "blockwise"):
        with pytest.raises(ConfigError, match=f"--fp8-recipe {recipe} with --context-parallel-size 2: its weight-"
                                              "gradient scales run along the tokens, which CP shares out"):
            check_args(list(BASE) + ["--fp8-format", "hybrid", "--fp8-recipe", recipe, "--context-parallel-size", "2"],
                       world_size=2)


@pytest.fixture(scope="module")
def fp8_world():
    # (on this machine's rounding, not another's as the fp32 worlds: a value an fp32 rounding apart can land on
    # the other FP8 neighbour, so only the same arithmetic gives the same quantized operands)
    return dict(zip((lay.name for lay in LAYOUTS), run_layouts(LAYOUTS, 2, capability=None)))


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.name)
def test_fp8_layouts_compute_the_single_process_function(fp8_world, lay):
    # (the reference's 2 steps do not show it learning, which assert_parity asks so that a broken update cannot
    # hide in the parameters: none is compared after step 1 here, and the update learns in the test below)
    bad = mismatches(lay, fp8_world[lay.name], reference(lay), tol=STEP_ONE_ONLY)
    assert not bad, f"{lay.name}: {len(bad)} mismatches against the single-process run:\n" + "\n".join(bad[:40])


@pytest.mark.parametrize("recipe", [TENSORWISE, DELAYED, ROWWISE, BLOCKWISE],
                         ids=["tensorwise", "delayed", "rowwise", "blockwise"])
def test_fp8_training_learns_the_chain(recipe):
    ref = reference(layout("learns", model=recipe))  # (the single process, BASE's 6 steps)
    assert ref["losses"][0] - ref["losses"][-1] > 0.5, ref["losses"]


def _train(argv):
    args = parse_args(list(BASE) + list(DELAYED) + list(argv), world_size=1)
    try:
        return pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("more", [(), ("--bf16", "--use-distributed-optimizer", "--fp8-param-gather"),
                                  ("--bf16", "--use-distributed-optimizer", "--fp8-param-gather", "--zero-stage", "3")],
                         ids=["fp32", "bf16_fp8_param_gather", "bf16_fp8_param_gather_zero3"])
def test_delayed_scaling_histories_resume_from_a_checkpoint(tmp_path, more):
    """The amax histories are saved with the checkpoint (per module name, every rank's): a resumed run's losses
    are the uninterrupted run's, bit for bit (without them its scales restart from the tensors' own amax). With
    --fp8-param-gather the loaded main weights are quantized again, as after the step that was saved."""
    more = list(more)
    whole = _train(["--train-iters", "6"] + more)
    first = _train(["--train-iters", "6", "--save", str(tmp_path), "--save-interval", "3", "--exit-interval", "3"]
                   + more)
    rest = _train(["--train-iters", "6", "--load", str(tmp_path)] + more)
    assert first + rest == whole, (first, rest, whole)


def _fp8_modules(more):
    from megalite.cli.parser import model_config
    from megalite.models import GPTModel
    args = parse_args(list(BASE) + list(DELAYED) + ["--position-embedding-type", "rope"] + more, world_size=1)
    ps.initialize_model_parallel(1, 1)
    try:
        model = GPTModel(model_config(args, args.vocab_size))
        return [n for n, m in model.named_modules() if getattr(m, "fp8", None) is not None]
    finally:
        ps.destroy_model_parallel()


def test_an_fp8_checkpoint_loads_without_fp8_and_back(tmp_path):
    """An FP8 run's checkpoint holds the model's weights (FP8 copies are made from them at each step) with the amax
    histories beside them: a bf16 run without FP8 resumes from it (the histories unused), an FP8 run resumes from
    that run's checkpoint (no histories: the first iteration scales by the tensors' own amax), and its Hugging Face
    export holds the checkpoint's bf16 weights."""
    import json

    from cli_batch import run_tool
    from megalite.checkpoint.convert import Reader, find_checkpoint
    fp8, plain, hf = (str(tmp_path / n) for n in ("fp8", "plain", "hf"))
    run = ["--bf16", "--train-iters", "6"]
    _train(run + ["--save", fp8, "--save-interval", "2", "--exit-interval", "2"])
    def histories(root):
        d = os.path.join(find_checkpoint(root)[0], "fp8")
        return os.listdir(d) if os.path.isdir(d) else []
    assert histories(fp8)
    resumed = _train_plain(run + ["--load", fp8, "--save", plain, "--save-interval", "4", "--exit-interval", "4"])
    assert len(resumed) == 2 and not histories(plain), resumed
    back = _train(run + ["--load", plain])
    assert len(back) == 2 and all(math.isfinite(x) for x in back), back
    rc, out, err = run_tool("convert_checkpoint", "--loader", "megalite", "--saver", "hf", "--load-dir", fp8,
                            "--save-dir", hf)
    assert rc in (0, None), err
    from safetensors.torch import load_file
    theirs = load_file(os.path.join(hf, "model.safetensors"))
    ours = Reader(find_checkpoint(fp8)[0]).get("decoder.layers.0.mlp.linear_fc2.weight")
    assert json.load(open(os.path.join(hf, "config.json")))["torch_dtype"] == "bfloat16"
    assert ours.dtype == torch.bfloat16 and any(  # (GPT-2's Conv1D keeps it transposed)
        t.dtype == torch.bfloat16 and (torch.equal(t, ours) if t.shape == ours.shape else
                                       t.shape == ours.t().shape and torch.equal(t, ours.t())) for t in theirs.values())


def test_first_and_last_layers_can_stay_out_of_fp8():
    fp8 = _fp8_modules(["--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "2"])
    assert sorted({n.split(".")[2] for n in fp8}) == ["1"], fp8  # 4 layers: the first and the last two not
    # multi-token prediction's layers: their projection and transformer layer's GEMMs, as the decoder's last
    mtp = [n for n in _fp8_modules(["--mtp-num-layers", "2"]) if n.startswith("mtp.")]
    assert mtp == [f"mtp.layers.{k}.{m}" for k in range(2) for m in (
        "eh_proj", "transformer_layer.self_attention.linear_qkv", "transformer_layer.self_attention.linear_proj",
        "transformer_layer.mlp.linear_fc1", "transformer_layer.mlp.linear_fc2")], mtp
    assert not [n for n in _fp8_modules(["--mtp-num-layers", "1", "--first-last-layers-bf16"]) if n.startswith("mtp.")]


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_fp8_gemms_on_the_gpu_are_the_products_of_the_quantized_operands(recipe):
    """On CUDA (cuBLASLt's FP8 GEMM, shapes in multiples of 16): the forward and both gradients equal the fp32
    products of the same quantized operands, but for the GEMM's own summation order (1e-5 of the largest product
    at K = 256) and the bf16 rounding of the results (2^-8 of the largest)."""
    torch.manual_seed(0)
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    site = Fp8Site("hybrid", recipe, grid=ONE)
    y = fp8_linear(x, w, site)
    dy = torch.randn_like(y) * 1e-3
    y.backward(dy)
    x2, dy2, w_ = x.detach().reshape(-1, 256), dy.reshape(-1, 512), w.detach()
    if recipe == "rowwise":
        def dq(t, dim, dtype):
            q, undo = along(t, dim, dtype, 0, False, ONE)
            return q.float() * undo
        want = (dq(x2, 0, E4M3) @ dq(w_, 0, E4M3).t(), dq(dy2, 0, E5M2) @ dq(w_, 1, E4M3),
                dq(dy2.t(), 0, E5M2) @ dq(x2, 1, E4M3))
    else:  # (delayed's first iteration scales by each tensor's own amax, as tensorwise does)
        xq, wq, dyq = _dequantized(x2, E4M3), _dequantized(w_, E4M3), _dequantized(dy2, E5M2)
        want = (xq @ wq.t(), dyq @ wq, dyq.t() @ xq)
    for got, ref, what in zip((y.reshape(-1, 512), x.grad.reshape(-1, 256), w.grad), want, ("y", "dx", "dw")):
        err = (got.float() - ref).abs().max() / ref.abs().max()
        assert got.dtype == torch.bfloat16 and err <= 2 ** -8 + 1e-5, (recipe, what, err.item())


def _train_plain(argv):
    args = parse_args(list(BASE) + list(argv), world_size=1)
    try:
        return pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
    finally:
        ps.destroy_model_parallel()
