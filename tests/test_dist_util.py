"""The harness's worlds (tests/support/dist_util.py): ranks that end at different times."""

import time

import pytest
import torch

from dist_util import run_on_ranks


def _late_pair():
    """Rank 0 returns at once; ranks 2 and 3 first talk to each other a second later, in a group made now. Their
    gloo pair connects lazily, through the store, when rank 0 (where torch.distributed's env:// start keeps the
    store) has long finished: the store must outlive every rank (the session's store process)."""
    import torch.distributed as dist
    group = dist.new_group([2, 3])
    rank = dist.get_rank()
    if rank in (2, 3):
        time.sleep(1.0)
        x = torch.full((3,), float(rank))
        dist.all_reduce(x, group=group)
        return x.tolist()
    return None


def test_a_pair_connects_after_rank_0_has_ended():
    assert run_on_ranks(_late_pair, 4, timeout=60, backend="gloo") == [None, None, [5.0] * 3, [5.0] * 3]


def _rank_1_never_comes():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        time.sleep(60)
    dist.barrier()


def test_a_hung_world_reports_where_its_ranks_waited():
    with pytest.raises(AssertionError) as e:
        run_on_ranks(_rank_1_never_comes, 2, timeout=2)  # (starting the world takes about 0.3 s)
    msg = str(e.value)
    assert msg.startswith("timed out after 2s"), msg
    waits = msg.split("rank 1 waited in:")
    assert len(waits) == 2 and "in _rank_1_never_comes" in waits[0] and "in barrier" in waits[0], msg
    assert "in _rank_1_never_comes" in waits[1] and "in barrier" not in waits[1], msg


def _bf16_product():
    """A bf16 product's sum, which oneDNN rounds by its instruction set (and ATen's capability does not change)."""
    torch.set_num_threads(1)  # (as the ranks: the sum's order depends on the threads under ATen's default kernels)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 512, generator=g).bfloat16(), torch.randn(512, 384, generator=g).bfloat16()
    return ((a @ b).float().sum().item(), torch.backends.cpu.get_cpu_capability())


def test_other_machine_ranks_round_as_that_machine_on_both_axes():
    """A rank of the other machine (dist_util.OTHER_MACHINE) rounds a bf16 product as a process started with both of
    that machine's variables does: oneDNN's instruction set is not fixed yet in the fork server it comes from."""
    import os
    import subprocess
    import sys

    from dist_util import OTHER_CAPABILITY, OTHER_MACHINE
    if OTHER_MACHINE is None:
        pytest.skip("this machine's ATen capability is the lowest: there is no other machine below it to emulate")
    code = ("import sys; sys.path[:0] = ['tests', 'tests/support']; import test_dist_util as t; "
            "print(repr(t._bf16_product()))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=dict(os.environ, **OTHER_MACHINE),
                         capture_output=True, text=True, timeout=120, check=True)
    want = eval(out.stdout.strip().splitlines()[-1])
    (got,) = run_on_ranks(_bf16_product, 1, capability=OTHER_CAPABILITY)
    assert got == want, f"a rank of {OTHER_MACHINE} computes {got}, a process started so computes {want}"
