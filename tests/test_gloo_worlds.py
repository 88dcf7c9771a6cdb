"""Every parallel axis on real gloo, against the single process (tests/support/parity.py).

The suite's worlds talk through its shared-memory groups (tests/support/shm_group.py: gloo's semantics, 6-25x faster on
2 cores); users run gloo and NCCL. One world of four gloo ranks here runs a layout per axis, so each run of the
suite checks them on gloo's own transport too: TP with SP and interleaved PP (p2p sends, all-gathers and
reduce-scatters of TP), 1F1B PP with DP and ZeRO-2 (the tied embedding's all-reduce, the buckets' reduce-scatter),
CP's ring with ZeRO-3 (p2p inside attention, the parameters' all-gathers), EP with the all-to-all dispatcher.
"""

import pytest
import torch.distributed as dist

from parity import LLAMA, MB2, MOE, layout, run_layouts
from parity_check import assert_parity

LAYOUTS = [
    layout("tp2_sp_pp2_interleaved_llama", tp=2, sp=True, pp=2, vp=1, model=LLAMA),
    layout("pp2_dp2_zero2_tied", pp=2, dp=2, zero=2),
    layout("cp2_dp2_zero3", cp=2, dp=2, zero=3, model=MB2),
    layout("dp4_ep2_alltoall_zero1", dp=4, zero=1, model=MB2 + MOE,
           flags=("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall")),
]


def _backends(chunks, optimizer):
    """The backend of every group this rank's grid made."""
    from megalite import parallel_state as ps
    return sorted({dist.get_backend(g) for g in ps.current_grid().created} | {dist.get_backend()})


@pytest.fixture(scope="module")
def gloo():
    return dict(zip((lay.name for lay in LAYOUTS), run_layouts(LAYOUTS, 4, collect=_backends, backend="gloo")))


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.name)
def test_axis_on_gloo_matches_single_process(gloo, lay):
    assert all(r["collected"] == ["gloo"] for r in gloo[lay.name]), [r["collected"] for r in gloo[lay.name]]
    assert_parity(lay, gloo[lay.name])
