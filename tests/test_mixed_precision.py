"""A precision per data-parallel replica (--data-parallel-precisions): each replica computes in its own
dtype, gradients are reduced in fp32 main-grad buffers, the fp32 main weights are the same everywhere,
and when any replica computes in fp16 every replica runs under one dynamic loss scale, so an overflow
on one skips the step on all (as one fp16 process would).

The bound for a mixed run, derived: with replica 0 in bf16 on its samples A and replica 1 in fp32 on
B, the step-1 gradient is exactly (g_bf16(A) + g_fp32(B)) / 2, where g_bf16(A) is what one bf16
process computes on A alone (the same bf16 operations on the same micro-batches) and g_fp32(B) what
one fp32 process computes on B: compared at fp32's 1e-5 (only the order of fp32 sums differs). After
step 1 the run drifts from the fp32 trajectory by half precision's own chaos on half the samples: held to the
farthest of the bf16 process's rounding twins from the fp32 run (parity_check.TWINS: each twin is a whole bf16
run and one more rounding of every weight away, farther from fp32 than a run that is bf16 on half its samples).
TP2 + SP and interleaved PP2 inside bf16 / fp32 replicas: every quantity within that bound, one set of
main weights per (TP, PP) position. These worlds run under the test process's own ATen capability, as the
harness's bf16 layouts do
(half-precision kernels round at other places under another capability).
"""

import dataclasses

import pytest
import torch

from dist_util import rel_err
from megalite.config import ConfigError
from parity import BigramChainDataset, layout, patched, reference, start_layouts
from parity_check import assert_parity, errors, twin_spread


def precisions(*p):
    return ("--data-parallel-precisions", ",".join(p))


class _Every:
    """Samples start, start + step, ... of a dataset: what one DP rank of two reads at micro-batch 1."""

    def __init__(self, data, start, step=2):
        self.data, self.start, self.step = data, start, step

    def __len__(self):
        return (len(self.data) - self.start) // self.step

    def __getitem__(self, i):
        return self.data[self.start + self.step * i]


def even_samples(args, num_samples):
    return _Every(BigramChainDataset(2 * num_samples[0] + 2, args.seq_length, args.seed), 0), None, None


def odd_samples(args, num_samples):
    return _Every(BigramChainDataset(2 * num_samples[0] + 2, args.seq_length, args.seed), 1), None, None


def main_weights(chunks, optimizer):
    """The fp32 main weights (each replica's own copy) and the model's dtype."""
    return {"main": [m.detach().clone() for m in optimizer.main_params],
            "dtype": str(next(chunks[0].parameters()).dtype), "scale": float(optimizer.loss_scale)}


def skips_alone_at_iteration_4():
    """DP rank 0 skips its 4th step alone (as if only it had seen an overflow)."""
    from megalite import parallel_state as ps
    from megalite.optimizer.optimizer import MixedPrecisionOptimizer
    original, calls = MixedPrecisionOptimizer._unscale_found_inf, [0]

    def found_inf(self, grads, inv_scale):
        calls[0] += 1
        flag = original(self, grads, inv_scale)
        return torch.ones_like(flag) if calls[0] == 4 and ps.get_data_parallel_rank() == 0 else flag
    return patched(MixedPrecisionOptimizer, "_unscale_found_inf", found_inf)


OVERFLOW = ("--initial-loss-scale", str(2 ** 19), "--hysteresis", "1")  # fp16 overflows first, then fits
LAYOUTS = [
    layout("dp2_plain", dp=2),
    layout("dp2_fp32_fp32", dp=2, flags=precisions("fp32", "fp32")),
    layout("dp2_bf16_fp32", dp=2, flags=precisions("bf16", "fp32")),
    layout("dp2_fp16_bf16_overflow", dp=2, flags=precisions("fp16", "bf16") + OVERFLOW),
    layout("fault_skips_alone", dp=2, flags=precisions("fp16", "bf16") + OVERFLOW, fault=skips_alone_at_iteration_4),
]


# TP + SP and PP (1F1B, interleaved) inside replicas of different precisions
FOUR = [layout("tp2_sp_dp2_fp32_bf16", tp=2, sp=True, dp=2, flags=precisions("fp32", "bf16")),
        layout("pp2_interleaved_dp2_bf16_fp32", pp=2, vp=1, dp=2, flags=precisions("bf16", "fp32"))]


@pytest.fixture(scope="module")
def runs():
    worlds = [(lays, start_layouts(lays, n, collect=main_weights, capability=None))
              for lays, n in ((FOUR, 4), (LAYOUTS, 2))]
    return {lay.name: r for lays, world in worlds for lay, r in zip(lays, world.result())}


def _within_bf16_envelope(lay, ranks):
    """Every quantity within the farthest bf16 rounding twin's distance from the fp32 run (module docstring)."""
    exact = reference(layout("fp32", dp=2))
    env = {kind: far for kind, (_, far) in twin_spread(layout("bf16", dtype="bf16"), against=exact).items()}
    for kind, msg, e in errors(dataclasses.replace(lay, flags=()), ranks, exact):
        if kind in ("losses", "norms", "params", "losses@1", "norms@1", "grads"):
            assert e <= env[kind], f"{msg}: {e:.2e} > the farthest bf16 twin's {env[kind]:.2e}"
    return env


def _same_main_weights_over_dp(ranks):
    by_coords = {}
    for r in ranks:  # the DP replicas of each (TP, PP) position hold one set of fp32 main weights
        by_coords.setdefault(r["coords"][:2], []).append(r["collected"]["main"])
    for coords, mains in by_coords.items():
        assert len(mains) == 2 and all(torch.equal(x, y) for x, y in zip(*mains)), f"{coords}: main weights differ"


@pytest.mark.parametrize("lay", FOUR, ids=lambda lay: lay.name)
def test_precisions_with_tp_sp_and_pp_inside_the_replicas(runs, lay):
    ranks = runs[lay.name]
    want = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}
    flags = lay.flags[lay.flags.index("--data-parallel-precisions") + 1].split(",")
    assert all(r["collected"]["dtype"] == want[flags[r["coords"][2]]] for r in ranks)
    _within_bf16_envelope(lay, ranks)
    _same_main_weights_over_dp(ranks)


def test_all_fp32_replicas_are_the_plain_run_bit_for_bit(runs):
    for plain, mixed in zip(runs["dp2_plain"], runs["dp2_fp32_fp32"]):
        assert mixed["losses"] == plain["losses"] and mixed["norms"] == plain["norms"]
        for n, p in plain["params"].items():
            assert torch.equal(mixed["params"][n], p), n
    assert_parity(LAYOUTS[1], runs["dp2_fp32_fp32"])


def test_bf16_and_fp32_replicas_within_the_derived_bound(runs):
    lay = LAYOUTS[2]
    ranks = runs[lay.name]
    assert [r["collected"]["dtype"] for r in ranks] == ["torch.bfloat16", "torch.float32"]
    half = dict(model=("--global-batch-size", "4"))
    g_a = reference(layout("bf16_on_A", dtype="bf16", datasets=even_samples, **half))["grads"]
    g_b = reference(layout("fp32_on_B", datasets=odd_samples, **half))["grads"]
    for r in ranks:
        for name, got in r["grads"].items():  # step 1: exactly the two halves' mean, up to fp32 sum order
            want = (g_a[name].double() + g_b[name].double()) / 2
            assert rel_err(got, want) <= 1e-5, (name, rel_err(got, want))
    env = _within_bf16_envelope(lay, ranks)  # later steps: half precision's envelope of the fp32 run
    print(f"\nbf16 envelope {env}")
    _same_main_weights_over_dp(ranks)


def test_an_fp16_overflow_skips_the_step_on_every_replica(runs):
    ranks = runs["dp2_fp16_bf16_overflow"]
    skipped = [[i for i, n in enumerate(r["norms"]) if n != n] for r in ranks]
    print(f"\nskipped iterations per replica {skipped}, final loss scale {[r['collected']['scale'] for r in ranks]}")
    assert skipped[0] == skipped[1] and 0 < len(skipped[0]) < len(ranks[0]["norms"]), skipped
    assert ranks[0]["collected"]["scale"] == ranks[1]["collected"]["scale"] < 2 ** 19
    assert [r["collected"]["dtype"] for r in ranks] == ["torch.float16", "torch.bfloat16"]
    a, b = (r["collected"]["main"] for r in ranks)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "the replicas' fp32 main weights differ"
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0] - 0.3, ranks[0]["losses"]  # it trains once it fits


def test_a_replica_skipping_alone_is_caught(runs):
    a, b = (r["collected"]["main"] for r in runs["fault_skips_alone"])
    assert not all(torch.equal(x, y) for x, y in zip(a, b)), "the comparison did not see a replica skip alone"


@pytest.mark.parametrize("flags, message", [
    (precisions("bf16"), "gives 1 values for data-parallel size 2"),
    (precisions("bf16", "int8"), "each must be one of bf16, fp16, fp32"),
    (precisions("bf16", "fp32") + ("--bf16",), "drop them"),
    (precisions("bf16", "fp32") + ("--use-distributed-optimizer",), "all-gathers parameters in the model's dtype"),
])
def test_bad_precisions_one_line(flags, message):
    from megalite.cli.parser import _parse
    from parity import BASE
    with pytest.raises(ConfigError, match=message) as e:
        _parse(list(BASE) + list(flags), world_size=2)
    assert "\n" not in str(e.value)
