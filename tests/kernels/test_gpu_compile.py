"""Every Triton kernel, forward and backward, built to a real cubin for sm_90 and sm_80 on this
CPU machine (no GPU needed; see tests/kernels/gpu_compile.py), at the shapes real models use:
each build must succeed, fit the chip's shared memory per block, and the hot kernels (flash
attention at head dim <= 128, norms, softmax up to 8k, cross-entropy, elementwise, AdamW)
must not spill registers. The interpreter accepts things the GPU compiler rejects (a Python
global read inside @jit, oversized blocks), which is what this catches.
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpu_compile import SMEM_LIMIT, CASES, table  # noqa: E402  (imports triton, not kernels)


@pytest.fixture(scope="module")
def results(request):
    """The build started in the background when the suite started (tests/conftest.py), or,
    when this module runs alone, started here."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "support"))
    from kernels_compile_bg import results as build_results
    res, seconds = build_results(request.config)
    if res is None:
        pytest.skip("this triton build has no NVIDIA backend, so nothing can be compiled for sm_80/sm_90")
    print(f"\nbuilt for sm_90 and sm_80 {seconds:.1f} s after the start, with triton {res[0]['triton']}")
    print(table(res))
    return res


def test_every_kernel_builds(results):
    for res in results:
        assert not res["errors"], "\n".join(f"sm_{e['arch']} {e['case']}: {e['error']}" for e in res["errors"])
        assert not res["unbuilt"], f"sm_{res['arch']}: kernels no case launches: {res['unbuilt']}"
        kernels = {r["kernel"] for r in res["rows"]}
        assert {"_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq", "_softmax_fwd", "_softmax_bwd"} <= kernels
    assert sorted(r["arch"] for r in results) == [80, 90]


def test_shared_memory_fits(results):
    for res in results:
        limit = SMEM_LIMIT[res["arch"]]
        over = [f"{r['kernel']} ({r['case']}): {r['shared']} B" for r in res["rows"] if r["shared"] > limit]
        assert not over, f"sm_{res['arch']} allows {limit} B of shared memory per block; over it: {over}"


def test_hot_kernels_do_not_spill(results):
    hot = {label for _, label, is_hot, _ in CASES if is_hot}
    for res in results:
        rows = [r for r in res["rows"] if r["case"] in hot]
        assert rows, "no hot kernel was built"
        spills = [f"{r['kernel']} ({r['case']}): {r['spill_bytes']} B/thread" for r in rows if r["spill_bytes"]]
        assert not spills, f"sm_{res['arch']}: register spills in hot kernels: {spills}"
        assert all(0 < r["regs"] <= 255 for r in res["rows"])
