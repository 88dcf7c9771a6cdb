"""tests/support/shm_group.py, the shared-memory backend of the suite's worlds: every collective and message
megalite uses
gives what gloo gives (reductions: the members' tensors added in member order, so every member gets the same bits),
outputs appear at wait(), the rings wrap, and a member that has ended fails its peers with gloo's words."""

import pytest
import torch

import shm_group
from dist_util import run_on_ranks

WORLD = 4
SHM = shm_group.NAME
pytestmark = pytest.mark.skipif(not shm_group.available(), reason="shared-memory groups need x86-64 Linux")


def _inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(37, generator=g), torch.randn(8, 3, generator=g)


def _moves():
    """The data-moving calls, whose results are copies: equal, bit for bit, on any backend."""
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    a, b = _inputs(rank)
    out = {}
    gathered = [torch.empty_like(b) for _ in range(n)]
    dist.all_gather(gathered, b)
    out["all_gather"] = torch.stack(gathered)
    flat = torch.empty(n * a.numel())
    dist.all_gather_into_tensor(flat, a)
    out["all_gather_into_tensor"] = flat
    sizes = torch.tensor([(rank + m) % 3 for m in range(n)])  # uneven, some empty
    got = torch.empty(n, dtype=torch.int64)
    dist.all_to_all_single(got, sizes)
    rows = torch.cat([torch.full((int(s), 2), 10.0 * rank + m) for m, s in enumerate(sizes)])
    received = torch.empty(int(got.sum()), 2)
    dist.all_to_all_single(received, rows, got.tolist(), sizes.tolist())
    out["all_to_all_single"] = received
    even = torch.empty(n * 2)
    dist.all_to_all_single(even, torch.arange(n * 2, dtype=torch.float32) + 100 * rank)
    out["all_to_all_single even"] = even
    x = b.clone()
    dist.broadcast(x, src=2)
    out["broadcast"] = x
    objects = [None] * n
    dist.all_gather_object(objects, {"rank": rank, "text": "x" * rank})
    out["all_gather_object"] = objects
    listed = [rank, "from 0"] if rank == 0 else [None, None]
    dist.broadcast_object_list(listed, src=0)
    out["broadcast_object_list"] = listed
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    ra, rb = torch.empty_like(a), torch.empty_like(b)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, nxt, tag=1), dist.P2POp(dist.isend, b, nxt, tag=2),
                                    dist.P2POp(dist.irecv, rb, prv, tag=2), dist.P2POp(dist.irecv, ra, prv, tag=1)])
    for w in reversed(works):  # waited in another order than posted; matched by tag
        w.wait()
    out["p2p"] = (ra, rb)
    dist.barrier()
    return out


def _reductions():
    """Each reduction against the members' tensors combined in member order (all-gathered, then combined here)."""
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    a, _ = _inputs(rank)
    every = [torch.empty_like(a) for _ in range(n)]
    dist.all_gather(every, a)
    checks = {}
    for name, op, combine in (("sum", dist.ReduceOp.SUM, torch.add), ("max", dist.ReduceOp.MAX, torch.maximum),
                              ("min", dist.ReduceOp.MIN, torch.minimum)):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            want = every[0].to(dtype)
            for t in every[1:]:
                want = combine(want, t.to(dtype))
            x = a.to(dtype, copy=True)
            dist.all_reduce(x, op=op)
            checks[f"all_reduce {name} {dtype}"] = torch.equal(x, want)
    full = torch.arange(n * 5, dtype=torch.float32) * (rank + 1) / 7
    want = sum(torch.arange(n * 5, dtype=torch.float32) * (m + 1) / 7 for m in range(n))  # (member order)
    part = torch.empty(5)
    dist.reduce_scatter_tensor(part, full)
    checks["reduce_scatter_tensor"] = torch.equal(part, want[rank * 5:(rank + 1) * 5])
    return checks


def _deferred_and_wrapping():
    """Outputs written at wait(), async handles waited out of order, rings smaller than the traffic, and the
    one-line errors for what does not fit."""
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    checks = {}
    out = torch.full((n,), -1.0)
    work = dist.all_gather_into_tensor(out, torch.tensor([float(rank)]), async_op=True)
    checks["output untouched before wait()"] = out.tolist() == [-1.0] * n
    work.wait()
    checks["output written at wait()"] = out.tolist() == [float(m) for m in range(n)]
    xs = [torch.full((100,), float(rank + i)) for i in range(12)]  # open collectives: 6 KB of parts in a 4 KB ring
    shm_group.PARTS, shm_group.RING = 4096, 2048
    small = dist.new_group(list(range(n)))
    works = [dist.all_reduce(x, group=small, async_op=True) for x in xs]
    for w in reversed(works):
        w.wait()
    checks["async all-reduces waited in reverse"] = all(
        x.tolist() == [float(sum(range(n)) + n * i)] * 100 for i, x in enumerate(xs))
    for step in range(40):  # parts of changing sizes through a 4 KB ring: it wraps
        y = torch.full((1 + (step * 37) % 200,), float(rank + step))
        dist.all_reduce(y, group=small)
        checks.setdefault("parts ring wraps", True)
        checks["parts ring wraps"] &= y.eq(float(sum(range(n)) + n * step)).all().item()
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    for step in range(30):  # messages through a 2 KB ring: it wraps
        msg, got = torch.full((1 + (step * 53) % 120,), float(rank * 100 + step)), torch.empty(1 + (step * 53) % 120)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, msg, nxt, group=small, tag=step % 2),
                                        dist.P2POp(dist.irecv, got, prv, group=small, tag=step % 2)])
        [w.wait() for w in works]
        checks.setdefault("message ring wraps", True)
        checks["message ring wraps"] &= got.eq(float(prv * 100 + step)).all().item()
    for what, call in (("part", lambda: dist.all_reduce(torch.zeros(2048), group=small)),
                       ("send", lambda: dist.send(torch.zeros(1024), nxt, group=small))):
        try:
            call()
            checks[f"a {what} too big refused"] = False
        except RuntimeError as e:
            checks[f"a {what} too big refused"] = "exceeds" in str(e) and "tests/support/shm_group.py" in str(e)
    dist.barrier(group=small)
    return checks


def _member_1_leaves():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        return None  # its process ends; member 0's next collective waits for it
    try:
        dist.barrier()
    except RuntimeError as e:
        return str(e)
    return "the barrier passed without member 1"


@pytest.fixture(scope="module")
def worlds():
    shm = run_on_ranks(_moves, WORLD, timeout=60, backend=SHM)
    gloo = run_on_ranks(_moves, WORLD, timeout=60, backend="gloo")
    return shm, gloo


@pytest.mark.parametrize("call", ["all_gather", "all_gather_into_tensor", "all_to_all_single",
                                  "all_to_all_single even", "broadcast", "all_gather_object",
                                  "broadcast_object_list", "p2p"])
def test_data_moves_as_on_gloo(worlds, call):
    shm, gloo = worlds
    for rank, (got, want) in enumerate(zip(shm, gloo)):
        got, want = got[call], want[call]
        same = all(torch.equal(g, w) for g, w in zip(got, want)) if call == "p2p" else (
            got == want if isinstance(got, list) and not isinstance(got[0], torch.Tensor) else torch.equal(got, want))
        assert same, f"rank {rank}: {call} gave {got}, gloo {want}"


def test_reductions_combine_in_member_order():
    for rank, checks in enumerate(run_on_ranks(_reductions, WORLD, timeout=60, backend=SHM)):
        assert all(checks.values()), f"rank {rank}: {[k for k, ok in checks.items() if not ok]} differ"


def test_outputs_at_wait_and_rings_that_wrap():
    for rank, checks in enumerate(run_on_ranks(_deferred_and_wrapping, WORLD, timeout=60, backend=SHM)):
        assert all(checks.values()), f"rank {rank}: {[k for k, ok in checks.items() if not ok]} failed"


def test_a_member_that_ended_fails_its_peers_as_gloo_would():
    said = run_on_ranks(_member_1_leaves, 2, timeout=30, backend=SHM)[0]
    assert "Connection closed by peer" in said and "member 1" in said, said
