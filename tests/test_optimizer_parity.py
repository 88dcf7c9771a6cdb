"""--optimizer muon / sgd / lion at parallel layouts against the single process (tests/parity.py: losses,
step-1 gradients, grad norms, every parameter after 6 steps, DESIGN's fp32 bound 1e-5), and Muon's
whole-matrix bookkeeping: under ZeRO each matrix is orthogonalised by exactly one rank of its sharding
group, the Newton-Schulz work balanced over them.

Muon runs its Newton-Schulz steps in fp32 here (--muon-fp32-matmul-prec high: the bf16 default rounds
at 2^-8, which no parity bound can hold) on the Llama-shaped model (GQA QKV split into q, k, v; SwiGLU's
fused fc1 gathered blockwise under TP), with --muon-scale-mode shape_scaling. Why not the default
spectral scale: Newton-Schulz maps a small singular value s to about (a_1 ... a_5) s, 494 s for the
quintic set, so the rounding differences of sums taken in another order (1e-7 of the momentum) reach
the orthogonalised update 494 times larger, and the update is lr x scale of it. Spectral's scale
sqrt(max(out, in)) is 5.7-11 on these matrices, shape_scaling's 1-2: measured after 6 steps, the
largest parameter error is 1.2-1.3e-5 with spectral (beyond DESIGN's 1e-5) and 5.4-6.2e-6 with
shape_scaling. The scale itself is a constant factor per matrix, checked on one process
(tests/test_optimizers.py). Two spawned worlds: two ranks (TP2 + SP with each TP mode, PP2,
DP2 with ZeRO-1/2/3, CP2, EP2) and four (TP2 x DP2 with ZeRO-1: Muon, SGD, Lion).
"""

import pytest

from megalite.optimizer.newton_schulz import flops
from parity import LLAMA, MOE, assert_parity, layout, mismatches, patched, reference, start_layouts

MUON_FLAGS = ("--optimizer", "muon", "--muon-fp32-matmul-prec", "high", "--muon-nesterov", "--muon-scale-mode",
              "shape_scaling")
MUON = LLAMA + MUON_FLAGS
MUON_MOE = MUON_FLAGS + MOE  # (the GPT-2-shaped MoE every MoE parity test shares)


def shard_only():
    """Fault: Newton-Schulz on each TP shard instead of the whole matrix (what blockwise does)."""
    from megalite.optimizer import muon
    return patched(muon.MuonMatrices, "_global_shape", lambda self, p, shape: tuple(shape))


def twice():
    """Fault: every matrix orthogonalised twice (the update of the update)."""
    from megalite.optimizer import muon
    once = muon.MuonMatrices.orthogonalise
    return patched(muon.MuonMatrices, "orthogonalise", lambda self, p, m: once(self, p, once(self, p, m)))


TWO = [layout("muon_tp2_sp", tp=2, sp=True, model=MUON),
       layout("muon_tp2_sp_distributed", tp=2, sp=True, model=MUON, flags=("--muon-tp-mode", "distributed")),
       layout("muon_pp2", pp=2, model=MUON),
       layout("muon_dp2_zero1", dp=2, zero=1, model=MUON),
       layout("muon_dp2_zero2", dp=2, zero=2, model=MUON),
       layout("muon_dp2_zero3", dp=2, zero=3, model=MUON),
       layout("muon_cp2", cp=2, model=MUON),
       layout("muon_ep2_zero1", dp=2, zero=1, model=MUON_MOE, flags=("--expert-model-parallel-size", "2")),
       ]
FAULTS = [layout("muon_tp2_sp_fault_shard_only", tp=2, sp=True, model=MUON, fault=shard_only),
          layout("muon_dp2_zero1_fault_twice", dp=2, zero=1, model=MUON, fault=twice)]
FOUR = [layout("muon_tp2_dp2_zero1", tp=2, dp=2, zero=1, model=MUON),
        layout("sgd_tp2_dp2_zero1", tp=2, dp=2, zero=1, model=LLAMA + ("--optimizer", "sgd", "--lr", "0.3")),
        layout("lion_tp2_dp2_zero1", tp=2, dp=2, zero=1, model=LLAMA + ("--optimizer", "lion", "--lr", "3e-3"))]


def collect(chunks, optimizer):
    m = getattr(optimizer, "_muon", None)
    return None if m is None else dict(m.stats)


@pytest.fixture(scope="module")
def worlds():
    two = start_layouts(TWO + FAULTS, 2, collect)
    four = start_layouts(FOUR, 4, collect)
    lays = TWO + FAULTS + FOUR
    return dict(zip([lay.name for lay in lays], two.result() + four.result()))


@pytest.mark.parametrize("lay", TWO + FOUR, ids=lambda lay: lay.name)
def test_optimizer_layouts_match_the_single_process(worlds, lay):
    assert_parity(lay, worlds[lay.name])


@pytest.mark.parametrize("lay", FAULTS, ids=lambda lay: lay.name)
def test_the_checks_catch_muon_faults(worlds, lay):
    assert mismatches(lay, worlds[lay.name], reference(lay)), f"{lay.name}: the fault went unnoticed"


def test_zero_orthogonalises_each_matrix_once_balanced(worlds):
    """Under ZeRO the ranks of a sharding group split the matrices: their counts add up to the single
    process's (each matrix once: 4 layers x (q, k, v, proj, fc1, fc2)) and each rank's Newton-Schulz FLOPs
    equal the formula's share, within 10% of the mean."""
    ref = 4 * 6 * 6  # matrices per step x 6 steps
    for name in ("muon_dp2_zero1", "muon_dp2_zero2", "muon_dp2_zero3"):
        stats = [r["collected"] for r in worlds[name]]
        assert sum(s["matrices"] for s in stats) == ref, (name, stats)
        per_step = [s["ns_flops"] / 6 for s in stats]
        # the model's matrices (hidden 32, 8 heads of 4, 4 groups, SwiGLU ffn 64): q 32x32, k and v 16x32
        # each, proj 32x32, fc1 128x32, fc2 32x64
        shapes = [(32, 32), (16, 32), (16, 32), (32, 32), (128, 32), (32, 64)] * 4
        assert sum(per_step) == sum(flops(r, c, 5) for r, c in shapes), (name, per_step)
        assert max(per_step) <= 1.1 * sum(per_step) / 2, (name, per_step)
    plain = [r["collected"] for r in worlds["muon_tp2_dp2_zero1"]]
    assert sum(s["matrices"] for s in plain) == 2 * ref  # over 2 DP ranks, on each of 2 TP ranks (duplicated)
