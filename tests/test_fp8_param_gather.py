"""--fp8-param-gather (Megatron's): ZeRO-1/2/3 gather FP8 weights quantized from the fp32 main weights (about half
the bf16 bytes), bit-equal to the one-rank function, each weight scaled whole at any TP/PP/CP layout; the GEMMs
multiply exactly those FP8 copies. (The FP8 recipes themselves: tests/test_fp8.py.)"""

import pytest
import torch

import pretrain_gpt
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.tensor_parallel.fp8 import fp8_linear, scaled
from megalite.training import pretrain
from parity import BASE, learnable_datasets
from test_fp8 import _train_plain

E4M3 = torch.float8_e4m3fn
TENSORWISE = ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")


PARAM_GATHER = TENSORWISE + ("--bf16", "--use-distributed-optimizer", "--fp8-param-gather")


def _gathered_fp8_weights(argv, world_size):
    """Train `argv` on this world; return (losses, {weight name: (FP8 bytes, scale inverse, model-dtype values)})
    of the FP8 weights as --fp8-param-gather left them, and {name: the fp32 main weight} where this rank holds
    whole ones (one data-parallel rank)."""
    args = parse_args(list(BASE) + list(argv), world_size=world_size)
    try:
        losses, chunks, optimizer = pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                                             args, return_state=True)
        for c in chunks:  # ZeRO-3: every unit gathered (as for its forward), its FP8 copies with it
            for u in getattr(getattr(c, "units", None), "units", ()):
                c.units.ensure(u)
        names = {p: n for c in chunks for n, p in c.module.named_parameters()}
        got = {names[p]: (p.fp8_weight[0].view(torch.uint8).clone(), p.fp8_weight[1].item(), p.detach().clone())
               for c in chunks for p in names if getattr(p, "fp8_weight", None) is not None}
        mains = {names[pc.param]: mp.detach().clone().view(pc.param.shape) for pc, mp in
                 zip(optimizer.pieces, optimizer.main_params) if pc.end - pc.start == pc.param.numel()}
        # a layer's GEMM multiplies exactly that FP8 copy: its output against the product of the dequantized
        # operands (what the CPU's FP8 GEMM computes: tensor_parallel/fp8.py scaled_mm)
        m = next(m for c in chunks for m in c.module.modules() if getattr(m, "fp8", None) is not None)
        x = torch.randn(8, m.weight.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        with torch.no_grad():
            y = fp8_linear(x, m.weight, m.fp8)
            wq, inverse, _ = m.weight.fp8_weight
            xq, undo = scaled(x, E4M3, x.abs().amax(), 0)
            uses_copy = torch.equal(y, ((xq.float() * undo) @ (wq.float() * inverse).t()).to(torch.bfloat16))
        return losses, got, mains, optimizer.fp8_gather.buckets[0].wire.bytes_per_gather(), \
            optimizer.fp8_gather.buckets[0].param_bytes(), uses_copy
    finally:
        ps.destroy_model_parallel()


def test_fp8_param_gather_quantizes_the_main_weights_and_moves_fp8():
    """--fp8-param-gather (one process, ZeRO over one rank): after every step each FP8 weight's FP8 copy is its fp32
    main weight quantized with the main weight's own scale (not the bf16 copy's), the model's buffer holds its
    dequantized values, and the GEMMs use that copy from the second iteration on (the first is the same as without
    it; later ones differ)."""
    losses, got, mains, _, _, uses_copy = _gathered_fp8_weights(list(PARAM_GATHER) + ["--train-iters", "3"], 1)
    assert uses_copy
    plain = _train_plain(list(TENSORWISE) + ["--bf16", "--use-distributed-optimizer", "--train-iters", "3"])
    assert got and len(got) == 4 * 4, sorted(got)  # QKV, projection, fc1, fc2 of 4 layers
    for n, (raw, inverse, model) in got.items():
        q, undo = scaled(mains[n], E4M3, mains[n].abs().amax(), 0)
        assert torch.equal(raw, q.view(torch.uint8)) and inverse == undo.item(), n
        assert torch.equal(model, (q.float() * undo).to(torch.bfloat16)), n
    assert losses[0] == plain[0] and losses[1:] != plain[1:], (losses, plain)


@pytest.mark.parametrize("flags", [["--zero-stage", "1"], ["--zero-stage", "3"], ["--context-parallel-size", "2"]],
                         ids=["zero1", "zero3", "cp2_zero1"])  # (CP2: ZeRO shards over the CP ranks)
def test_fp8_param_gather_over_zero_is_the_one_rank_function(flags):
    """Two data-parallel ranks (ZeRO-1; ZeRO-3, whose unit gathers move the FP8 bytes each time a unit is gathered)
    gather the FP8 weights as bytes (each weight's amax reduced over the ranks that hold its pieces): every rank ends
    with exactly the FP8 copies, scales and dequantized weights of the one-rank run, each GEMM uses its copy, and a
    gather moved about half the bf16 bytes (the biases and norms travel in bf16). --lr 0 keeps the fp32 main weights
    the same in both runs, so their quantization must agree bit for bit."""
    from dist_util import run_on_ranks
    argv = list(PARAM_GATHER) + ["--train-iters", "2", "--lr", "0"]
    _, one, _, _, _, _ = _gathered_fp8_weights(argv, 1)
    for losses, got, _, wire, bf16, uses_copy in run_on_ranks(_gathered_fp8_weights, 2, argv + flags,
                                                              2, capability=None):
        assert got.keys() == one.keys() and uses_copy
        for n, (raw, inverse, model) in got.items():
            assert torch.equal(raw, one[n][0]) and inverse == one[n][1] and torch.equal(model, one[n][2]), n
        assert wire < 0.6 * bf16, (wire, bf16)
        print(f"bytes gathered per bucket: {wire} (FP8) against {bf16} (bf16)")


@pytest.mark.parametrize("layout, counterpart", [
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], lambda r: r % 2),  # (TP ranks vary fastest)
    (["--pipeline-model-parallel-size", "2"], lambda r: r // 2)], ids=["tp2_sp", "pp2"])  # (then DP, then PP)
def test_fp8_param_gather_over_zero3_with_model_parallelism(layout, counterpart):
    """TP2 + SP or PP2, x DP2 under ZeRO-3: each rank's unit gathers give exactly the FP8 copies, scales and
    dequantized weights of its counterpart in a run without data parallelism (--lr 0: the same main weights), its
    GEMMs using them."""
    from dist_util import run_on_ranks
    argv = list(PARAM_GATHER) + ["--train-iters", "2", "--lr", "0"] + layout
    two = run_on_ranks(_gathered_fp8_weights, 2, argv, 2, capability=None)
    four = run_on_ranks(_gathered_fp8_weights, 4, argv + ["--zero-stage", "3"], 4, capability=None)
    for r, (_, got, _, _, _, uses_copy) in enumerate(four):
        ref = two[counterpart(r)][1]
        assert got and got.keys() == ref.keys() and uses_copy, r
        for n, (raw, inverse, model) in got.items():
            assert torch.equal(raw, ref[n][0]) and inverse == ref[n][1] and torch.equal(model, ref[n][2]), (r, n)


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                    ["--pipeline-model-parallel-size", "2"]], ids=["tp2_sp", "pp2"])
def test_fp8_param_gather_scales_each_weight_whole(layout):
    """Under TP each rank quantizes its shard of a weight with the whole weight's scale (its amax the largest over
    the TP ranks), under PP each stage its own weights: every FP8 copy is exactly its rank's fp32 main weights
    quantized so, and each layer's GEMM uses it."""
    from dist_util import run_on_ranks
    argv = list(PARAM_GATHER) + ["--train-iters", "2"] + layout
    ranks = run_on_ranks(_gathered_fp8_weights, 2, argv, 2, capability=None)
    tp = "--tensor-model-parallel-size" in layout
    for _, got, mains, _, _, uses_copy in ranks:
        assert got and uses_copy
        for n, (raw, inverse, _) in got.items():
            whole = max(r[2][n].abs().amax() for r in ranks) if tp else mains[n].abs().amax()
            q, undo = scaled(mains[n], E4M3, whole, 0)
            assert torch.equal(raw, q.view(torch.uint8)) and inverse == undo.item(), n
