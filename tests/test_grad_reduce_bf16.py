"""--grad-reduce-in-bf16 (Megatron's flag; megalite/distributed/grad_buffer.py and sharded_bucket.py): the DP
reduction sends each bucket in bf16, half the bytes, the gradients still accumulated in fp32. A bucket's reduced
value is what the arithmetic says: each rank's fp32 bucket rounded to bf16 once, summed by the collective (rounded
to bf16), back into fp32 -- within u(|a| + |b|) + u|a + b| of the fp32 sum (u = 2^-8, bf16's unit roundoff),
never further, and not equal to it; the wire bytes halve, for the plain all-reduce and ZeRO's reduce-scatter. A
bf16 run at DP2 (plain and ZeRO-2) with it learns as the single process does, its gradients within that bound, and
Megatron's Llama-3 FP8 script that carries it parses (tests/test_megatron_compat.py)."""

import pytest
import torch

from megalite.cli.parser import parse_args
from parity import layout, run_layouts

U = 2.0 ** -8
ARGV = ("--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 8 --micro-batch-size 1 "
        "--train-iters 1 --lr 1e-3").split()


def _reduce(wire, zero):
    """On each of 2 ranks: (the bucket reduced with the fp32 wire, with bf16, the inputs, the wire bytes of each)."""
    import torch.distributed as dist
    from megalite.distributed import comm
    from megalite.distributed.grad_buffer import _Bucket
    from megalite.distributed.sharded_bucket import ShardedBucket
    r = dist.get_rank()
    gen = torch.Generator().manual_seed(10 + r)
    x = torch.randn(64, generator=gen) * torch.logspace(-3, 3, 64)  # (many scales: the rounding is relative)
    out = {}
    for dtype in (None, torch.bfloat16):
        p = torch.nn.Parameter(torch.zeros(64))
        comm.reset()
        if zero:
            b = ShardedBucket([p], 64, 1, torch.zeros(64), torch.zeros(64), 2, r, None, divisor=1)
        else:
            b = _Bucket([p], torch.zeros(64), 2, None, 1)
        b.wire_dtype = dtype
        p.main_grad.copy_(x)
        b.start()
        b.finish()
        got = p.main_grad.clone() if not zero else b.data[b.lo:b.hi].clone()
        out[dtype] = (got, sum(c["wire_bytes"] for c in comm.counts().values()))
    return out[None], out[torch.bfloat16], x


@pytest.mark.parametrize("zero", [False, True], ids=["all_reduce", "zero_reduce_scatter"])
def test_a_bf16_reduced_bucket_is_its_rounded_sum(zero):
    from dist_util import run_on_ranks
    ranks = run_on_ranks(_reduce, 2, None, zero)
    xs = [x for _, _, x in ranks]
    exact = xs[0].double() + xs[1].double()
    want = (xs[0].bfloat16().float() + xs[1].bfloat16().float()).bfloat16().float()  # round, sum, round
    bound = U * (xs[0].abs() + xs[1].abs()).double() + U * exact.abs()
    for r, ((fp32, fp32_bytes), (bf16, bf16_bytes), _) in enumerate(ranks):
        part = slice(32 * r, 32 * r + 32) if zero else slice(None)
        torch.testing.assert_close(fp32, exact[part].float(), rtol=2 ** -23, atol=0)
        assert torch.equal(bf16, want[part]), (bf16 - want[part]).abs().max()
        assert ((bf16.double() - exact[part]).abs() <= bound[part]).all()
        assert not torch.equal(bf16, fp32)  # (it did round)
        assert fp32_bytes > 0 and bf16_bytes * 2 == fp32_bytes, (bf16_bytes, fp32_bytes)


def test_it_refuses_what_it_does_not_compose_with_in_one_line(capsys):
    assert parse_args(ARGV + ["--grad-reduce-in-bf16"], world_size=2).grad_reduce_in_bf16
    for extra, says in ((["--hierarchical-grad-reduce"], "--grad-reduce-in-bf16 with --hierarchical-grad-reduce is "
                                                         "not built yet"),
                        (["--grad-compression", "topk"], "--grad-reduce-in-bf16 with --grad-compression")):
        with pytest.raises(SystemExit):
            parse_args(ARGV + ["--grad-reduce-in-bf16"] + extra, world_size=2)
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and says in err[0], err


LAYOUTS = [layout("dp2_bf16_grad_reduce_in_bf16", dp=2, dtype="bf16", flags=("--grad-reduce-in-bf16",)),
           layout("dp2_zero2_bf16_grad_reduce_in_bf16", dp=2, zero=2, dtype="bf16",
                  flags=("--grad-reduce-in-bf16",))]


@pytest.fixture(scope="module")
def two():
    return dict(zip((lay.name for lay in LAYOUTS), run_layouts(LAYOUTS, 2)))


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.name)
def test_a_bf16_run_reduced_in_bf16_learns_as_the_single_process(two, lay):
    """Its step-1 gradients are the single process's rounded once more: each element within u(|a| + |b|) + u|a + b|
    (the unit test above, exactly), so within 4u of each tensor's largest where a tensor's two halves do not
    cancel to under half their size -- and not equal (the flag takes effect); its losses fall as the single
    process's (check_reference's margin) and end within 4u of them."""
    from parity import check_reference, reference
    from parity_check import errors
    ref, ranks = reference(lay), two[lay.name]
    grads = [e for kind, _, e in errors(lay, ranks, ref) if kind == "grads"]
    assert grads and max(grads) <= 4 * U and max(grads) > 0, (max(grads), 4 * U)
    losses = ranks[-1]["losses"]
    check_reference({"losses": losses})
    assert abs(losses[-1] - ref["losses"][-1]) <= 4 * U * abs(ref["losses"][-1]), (losses, ref["losses"])
