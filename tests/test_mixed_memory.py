"""Mixed GPUs of different memory. --data-parallel-micro-batch-sizes: DP replica r runs micro-batches
of M_r samples, and the update is still the single process's on the whole batch (each sample
weighs 1/G: a micro-batch loss is divided by the replica's samples / M_r, megalite/batching/iteration_plan.py).
--optimizer-cpu-offload: a fraction of the optimizer lives and steps in host memory
(megalite/optimizer/offload.py), bit for bit the update without offload.

Parity with one process (tests/support/parity.py: losses, step-1 gradients, norms, parameters after 6
steps, fp32 bound 1e-5): sizes 4,1 at DP2; 1,2,1 at DP3 with shares 1,2,1; TP2 + SP x DP2 with 2,1
and ZeRO-2; PP2 x DP2 with 2,1 and a per-token loss; interleaved PP2 x DP2 with ZeRO-1 and full
recompute; CP2 x DP2; EP2 x DP4 with ZeRO-3 where shares keep the counts equal. A checkpoint resumes
exactly with the same sizes and within the bound with others. --data-parallel-shares auto at sizes 2,1
(and after sizes chosen by memory) balances by speed at the sizes and keeps parity. Offload: fractions
0.5 and per replica 0,1 at DP2 ZeRO-1, 0.5 at ZeRO-2, ZeRO-3, interleaved PP2 and EP2 x DP2 ZeRO-1, at
TP2 (fp32 and bf16) bit for bit equal to no offload; the bytes moved per step equal the formula; resume with and
without offload is exact; an offloaded shard stepped twice or not copied back is caught. Micro-batches
weighted equally whatever their size is caught in tests/test_fault_injection.py.
"""

import os
import tempfile

import pytest
import torch

from dist_util import rel_err, start_on_ranks
from megalite.config import ConfigError
from megalite.batching.iteration_plan import IterationPlan
from megalite.batching.microbatches import BatchSchedule
from parity import MB2, STEPS, layout, patched, reference, start_layouts, train
from parity_check import assert_parity
from test_mixed_gpus import slow_second_replica

# No load-balancing loss: it multiplies two means over a micro-batch's tokens, so it is another function
# of the weights at another micro-batch size (in Megatron too); the routing and experts are not.
MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--moe-aux-loss-coeff", "0",
       "--moe-z-loss-coeff", "0.001", "--moe-ffn-hidden-size", "48")


def sizes(*m):
    return ("--data-parallel-micro-batch-sizes", ",".join(map(str, m)))


def shares(*s):
    return ("--data-parallel-shares", ",".join(map(str, s)))


def offload(fraction):
    return ("--optimizer-cpu-offload", "--optimizer-offload-fraction", fraction)


FOUR = [
    layout("tp2_sp_dp2_sizes_2_1_zero2", tp=2, sp=True, dp=2, zero=2, flags=sizes(2, 1)),
    layout("pp2_dp2_sizes_2_1_per_token", pp=2, dp=2, model=("--calculate-per-token-loss",), flags=sizes(2, 1)),
    layout("cp2_dp2_sizes_1_4", cp=2, dp=2, flags=sizes(1, 4)),
    layout("pp2_dp2_interleaved_zero1_recompute_sizes_2_1", pp=2, vp=1, dp=2, zero=1, recompute="full",
           flags=sizes(2, 1)),
    # shares 2,2,1,1 of 12 with sizes 2,2,1,1: two micro-batches everywhere, so the expert dispatches and
    # ZeRO-3's gathers run the same number of times on every rank
    layout("ep2_dp4_zero3_sizes_2_2_1_1_shares_2_2_1_1", dp=4, zero=3, model=MOE + ("--global-batch-size", "12"),
           flags=sizes(2, 2, 1, 1) + shares(2, 2, 1, 1) + ("--expert-model-parallel-size", "2")),
]
THREE = [layout("dp3_sizes_1_2_1_shares_1_2_1", dp=3, flags=sizes(1, 2, 1) + shares(1, 2, 1))]
TWO = [layout("dp2_sizes_4_1", dp=2, flags=sizes(4, 1))]
# --data-parallel-shares auto at sizes 2,1, replica 1 sleeping 20 ms per micro-batch: balanced in units of
# lcm(2, 1) = 2 samples, a unit costing replica 0 one micro-batch and replica 1 two.
SHARES_AUTO = layout("dp2_sizes_2_1_shares_auto_rank1_slow", dp=2, fault=slow_second_replica,
                     flags=sizes(2, 1) + ("--data-parallel-shares", "auto",
                                          "--data-parallel-shares-profile-iters", "2"))


def _stats(chunks, optimizer):
    st = optimizer.offload
    host = {m.untyped_storage().data_ptr() for g in optimizer._flat if g.grad is not None for m in g.mains}
    model = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
    return {"host": st.host_elements, "device": st.device_elements, "d2h": st.d2h_bytes, "h2d": st.h2d_bytes,
            "steps": st.steps, "aliases_model": bool(host & model),
            "param_bytes": next(chunks[0].parameters()).element_size()}


def stepped_twice():
    from megalite.optimizer.offload import HostSteps
    original = HostSteps.step

    def step(self, grp, outs, adamw):
        adamw(grp.main, grp.grad)
        original(self, grp, outs, adamw)
    return patched(HostSteps, "step", step)


def not_copied_back():
    from megalite.optimizer.offload import HostSteps
    return patched(HostSteps, "step", lambda self, grp, outs, adamw: adamw(grp.main, grp.grad))


def _offload_runs(directory):
    """In two ranks: per layout, the run without offload and with fractions; faults; resumes."""
    out = {}
    # (two samples per micro-batch, tests/support/parity.py's MB2: offload is the optimizer's, whatever the
    # micro-batches)
    cases = {"dp2_zero1": dict(dp=2, zero=1, model=MB2), "dp2_zero2": dict(dp=2, zero=2, model=MB2),
             "dp2_zero3": dict(dp=2, zero=3, model=MB2), "pp2_interleaved": dict(pp=2, vp=1, model=MB2),
             "tp2": dict(tp=2, model=MB2), "tp2_bf16": dict(tp=2, dtype="bf16", model=MB2),
             "ep2_dp2_zero1": dict(dp=2, zero=1, model=MB2 + MOE, flags=("--expert-model-parallel-size", "2"))}
    fractions = {"dp2_zero1": ("0.5", "0,1"), "dp2_zero2": ("0.5",), "dp2_zero3": ("0.5",), "pp2_interleaved": ("0.5",),
                 "tp2": ("0.5",), "tp2_bf16": ("1",), "ep2_dp2_zero1": ("0.5",)}
    for name, kw in cases.items():
        out[name] = train(layout(name, **kw), collect=_stats)
        for f in fractions[name]:
            more = dict(kw, flags=kw.get("flags", ()) + offload(f))
            out[f"{name}@{f}"] = train(layout(f"{name}@{f}", **more), collect=_stats)
    for fault in (stepped_twice, not_copied_back):
        out[fault.__name__] = train(layout(fault.__name__, dp=2, zero=1, model=MB2, flags=offload("0.5"), fault=fault))
    # saved at step 3 with offload, resumed without; saved without, resumed with
    for name, first, then in (("off_to_on", (), offload("0.5")), ("on_to_off", offload("0.5"), ())):
        d = os.path.join(directory, name)
        train(layout("save", dp=2, zero=1, model=MB2,
                     flags=first + ("--save", d, "--save-interval", "3", "--exit-interval", "3")))
        out[name] = train(layout("resume", dp=2, zero=1, model=MB2, flags=then + ("--load", d)))
    # micro-batch sizes: uninterrupted, saved at 3, resumed with the same sizes and with others
    d = os.path.join(directory, "sizes")
    out["sizes_full"] = train(layout("full", dp=2, flags=sizes(4, 1)))
    train(layout("save", dp=2, flags=sizes(4, 1) + ("--save", d, "--save-interval", "3", "--exit-interval", "3")))
    out["sizes_same"] = train(layout("same", dp=2, flags=sizes(4, 1) + ("--load", d)))
    out["sizes_other"] = train(layout("other", dp=2, flags=sizes(2, 4) + ("--load", d)))
    out.update(_auto_runs())
    return out


def _state(chunks, optimizer):
    from megalite.optimizer.memory import state_bytes_by_place
    return state_bytes_by_place(chunks, optimizer)[0]


def _auto_runs():
    """--data-parallel-micro-batch-sizes / --optimizer-offload-fraction auto: a probe with a large budget
    measures the rank; budgets from its figures then force replica 0 to 4 samples per micro-batch and
    replica 1 to 2, and, with less, replica 1 to size 1 with part of its optimizer on the host."""
    from megalite.training.memory_budget import GIB

    def run(name, budgets, flags=(), **kw):
        lay = layout(name, dp=2, flags=("--data-parallel-micro-batch-sizes", "auto", "--device-memory-budget",
                                        ",".join(f"{b / GIB!r}" for b in budgets)) + flags, **kw)
        r = train(lay, collect=_state)
        p, budget, micros, fraction = r["record"].memory
        r.update(budget=budget, micros=micros, fraction=fraction, lay=lay, shares=r["record"].shares,
                 profile=dict(states=p.states, fixed=p.fixed, per=p.per_sample, offloadable=p.offloadable))
        return r
    probe = run("auto_probe", [GIB, GIB])
    p = probe["profile"]
    base = p["states"] + p["fixed"]
    sized = run("auto_sizes", [base + 4.5 * p["per"], base + 2.5 * p["per"]])
    short = base + p["per"] - 0.37 * p["offloadable"]  # one sample fits only with about 37% offloaded
    offloaded = run("auto_offload", [GIB, short], ("--optimizer-cpu-offload", "--optimizer-offload-fraction", "auto"))
    # sizes by memory (4,2 as above), then shares by speed at those sizes (replica 1 sleeps 20 ms per
    # micro-batch): 16 samples in units of lcm(4, 2) = 4
    both = run("auto_sizes_shares_auto", [base + 4.5 * p["per"], base + 2.5 * p["per"]],
               ("--data-parallel-shares", "auto", "--data-parallel-shares-profile-iters", "2"),
               model=("--global-batch-size", "16"), fault=slow_second_replica)
    return {"auto_probe": probe, "auto_sizes": sized, "auto_offload": offloaded, "auto_sizes_shares_auto": both}


@pytest.fixture(scope="module")
def runs():
    # the worlds side by side: one world alone leaves the two cores idle while its ranks wait on each other
    with tempfile.TemporaryDirectory() as d:
        offload = start_on_ranks(_offload_runs, 2, d, timeout=300)
        started = [(lays, start_layouts(lays, n)) for lays, n in ((FOUR, 4), (THREE, 3), (TWO, 2))]
        started.append(([SHARES_AUTO], start_layouts([SHARES_AUTO], 2)))
        out = {lay.name: r for lays, world in started for lay, r in zip(lays, world.result())}
        out["offload"] = offload.result()
    return out


@pytest.mark.parametrize("lay", FOUR + THREE + TWO, ids=lambda lay: lay.name)
def test_micro_batch_sizes_per_replica_match_single_process(runs, lay):
    assert_parity(lay, runs[lay.name])


def test_auto_shares_follow_the_speeds_at_the_sizes_and_keep_parity(runs):
    from megalite.batching.iteration_plan import balanced_counts
    ranks = runs[SHARES_AUTO.name]
    seconds, counts = ranks[0]["record"].shares  # (the run's RunRecord)
    print(f"\nshares auto at sizes 2,1: seconds per micro-batch by replica {seconds}, micro-batches {counts}")
    assert all(r["record"].shares == (seconds, counts) for r in ranks), "ranks chose different shares"
    assert seconds[1] >= 0.02, f"the 20 ms sleep of replica 1 was not measured: {seconds}"
    units = balanced_counts([seconds[0], 2 * seconds[1]], 4)  # 8 samples in units of 2
    # replica 0's 2 samples cost 2c, replica 1's c + 20 ms: the third unit goes to replica 0 whatever c
    assert counts == [units[0], 2 * units[1]] and counts[0] * 2 >= counts[1] and units[0] >= 2, counts
    assert_parity(SHARES_AUTO, ranks)


def _identical(a, b):
    """Where two runs differ: losses, norms, step-1 gradients or final parameters (bit for bit)."""
    bad = [k for k in ("losses", "norms") if a[k] != b[k]]
    bad += [f"grad {n}" for n, g in a["grads"].items() if not torch.equal(g, b["grads"][n])]
    return bad + [f"param {n}" for n, p in a["params"].items() if not torch.equal(p, b["params"][n])]


@pytest.mark.parametrize("case", ["dp2_zero1@0.5", "dp2_zero1@0,1", "dp2_zero2@0.5", "dp2_zero3@0.5",
                                  "pp2_interleaved@0.5", "tp2@0.5", "tp2_bf16@1", "ep2_dp2_zero1@0.5"])
def test_offload_is_bit_for_bit_the_update_without_it(runs, case):
    base = case.split("@")[0]
    for dp_rank, rank in enumerate(runs["offload"]):  # (TP2: the TP rank; one fraction there)
        on, off = rank[case], rank[base]
        assert not _identical(on, off), f"{case} differs from {base}: {_identical(on, off)[:3]}"
        st, none = on["collected"], off["collected"]
        assert none["host"] == 0 and none["d2h"] == 0 and not st["aliases_model"]
        assert st["steps"] == (STEPS if st["host"] else 0), st
        total = st["host"] + st["device"]
        assert total == none["device"], "offload changed what the rank steps"
        fraction = float(case.split("@")[1].split(",")[dp_rank] if "," in case else case.split("@")[1])
        # whole parameters: the host holds F of the elements up to one parameter per param group
        assert (st["host"] > 0) == (fraction > 0) and (st["device"] > 0) == (fraction < 1), st
        assert abs(st["host"] - fraction * total) <= 0.5 * total, st
        # the bytes moved: fp32 gradients down, the model's dtype up, per host element and step
        assert st["d2h"] == STEPS * 4 * st["host"] and st["h2d"] == STEPS * st["param_bytes"] * st["host"], st
        print(f"\n{case} rank {dp_rank}: {st['host']} of {total} elements on the host, "
              f"{st['d2h'] // STEPS} B down and {st['h2d'] // STEPS} B up per step")


@pytest.mark.parametrize("fault", ["stepped_twice", "not_copied_back"])
def test_offload_faults_are_caught(runs, fault):
    for rank in runs["offload"]:
        assert _identical(rank[fault], rank["dp2_zero1"]), f"{fault}: the comparison did not see it"


def test_resume_with_and_without_offload_is_exact(runs):
    for rank in runs["offload"]:
        full = rank["dp2_zero1"]
        for name in ("off_to_on", "on_to_off"):
            r = rank[name]
            assert r["losses"] == full["losses"][3:], (name, r["losses"], full["losses"])
            for n, p in full["params"].items():
                assert torch.equal(r["params"][n], p), f"{name}: {n}"


def test_resume_with_the_same_sizes_is_exact_and_with_other_sizes_within_bound(runs):
    ref = reference(TWO[0])
    for rank in runs["offload"]:
        full, same, other = rank["sizes_full"], rank["sizes_same"], rank["sizes_other"]
        assert same["losses"] == full["losses"][3:]
        for n, p in full["params"].items():
            assert torch.equal(same["params"][n], p), f"same sizes: {n}"
        for a, b in zip(other["losses"], full["losses"][3:]):
            assert abs(a - b) <= 1e-5 * abs(b), (other["losses"], full["losses"])
        for n, p in ref["params"].items():
            assert rel_err(other["params"][n], p) <= 1e-5, n


def test_plan_with_sizes_weighs_each_sample_once():
    plan = IterationPlan(BatchSchedule(8, 1, 2), None, micros=[4, 1])
    assert plan.counts(0) == [1, 4] and plan.first_sample(8, 1) == 12 and plan.grad_divisor == 1
    # each micro-batch's mean over its samples, divided by samples / size: every sample weighs 1/8
    assert plan.loss_divisor(0, 0) == 2 and plan.loss_divisor(0, 1) == 8
    both = IterationPlan(BatchSchedule(12, 1, 3), [1, 2, 3], micros=[2, 4, 3])
    assert both.counts(0) == [1, 1, 2] and [both.first_sample(0, r) for r in range(3)] == [0, 2, 6]
    with pytest.raises(ConfigError, match="not a positive whole number of micro-batches of 3"):
        IterationPlan(BatchSchedule(8, 1, 2), None, micros=[4, 3]).check()


@pytest.mark.parametrize("flags, message", [
    (sizes(4, 1, 1), "gives 3 values for data-parallel size 2"),
    (sizes(4, 0), "every size must be a positive integer"),
    (sizes(3, 1), "not a positive whole number of micro-batches of 3"),
    (sizes(4, 1) + ("--use-distributed-optimizer", "--zero-stage", "3"), "every rank must run the same count"),
    (offload("1.5"), "every fraction must lie in \\[0, 1\\]"),
    (offload("0.5,0.5,0.5"), "gives 3 values for data-parallel size 2"),
    (("--optimizer-offload-fraction", "0.5"), "need --optimizer-cpu-offload"),
    (("--data-parallel-micro-batch-sizes", "auto", "--device-memory-budget", "1", "--semi-sync-method", "diloco",
      "--semi-sync-steps", "2"),
     "does not compose with (semi-synchronous replicas|--data-parallel-micro-batch-sizes auto)"),
    (("--device-memory-budget", "1"), "add one or drop the budget"),
    (("--data-parallel-micro-batch-sizes", "auto"), "need --device-memory-budget"),
    (("--data-parallel-micro-batch-sizes", "auto", "--device-memory-budget", "0"), "every budget must be positive"),
    (("--data-parallel-micro-batch-sizes", "auto", "--device-memory-budget", "1,2,3"), "gives 3 values"),
    (("--data-parallel-micro-batch-sizes", "auto", "--device-memory-budget", "1", "--use-distributed-optimizer",
      "--zero-stage", "3"), "sizes chosen by memory do not keep"),
    (("--optimizer-offload-fraction", "auto", "--device-memory-budget", "1"), "need --optimizer-cpu-offload"),
])
def test_bad_flags_one_line(flags, message):
    from megalite.cli.parser import _parse
    from parity import BASE
    with pytest.raises(ConfigError, match=message) as e:
        _parse(list(BASE) + list(flags), world_size=2)
    assert "\n" not in str(e.value)


def test_auto_sizes_are_the_largest_that_fit_and_keep_parity(runs):
    ranks = runs["offload"]
    for name, want in (("auto_probe", [4, 4]), ("auto_sizes", [4, 2]), ("auto_offload", [4, 1])):
        for dp_rank, rank in enumerate(ranks):
            r = rank[name]
            p, budget = r["profile"], r["budget"]
            print(f"\n{name} replica {dp_rank}: budget {budget:.0f} B, states {p['states']} B, activations "
                  f"{p['fixed']} + {p['per']} B per sample -> sizes {r['micros']}, offload {r['fraction']}")
            assert p["per"] > 0 and r["micros"] == want, (name, r["micros"], want)

            def need(m, offloaded=0.0):
                return p["states"] - offloaded + p["fixed"] + p["per"] * m
            m = r["micros"][dp_rank]
            if name != "auto_offload" or dp_rank == 0:
                assert need(m) <= budget and all(need(k) > budget for k in (1, 2, 4) if k > m), (name, dp_rank)
            else:  # size 1 does not fit; the smallest hundredth of offload that makes it fit was taken
                f = r["fraction"]
                assert need(1) > budget and 0 < f < 1, f
                assert need(1, f * p["offloadable"]) <= budget < need(1, (f - 0.01) * p["offloadable"])
                # the rebuilt optimizer keeps at most that on the device (whole parameters: at least F moved)
                assert r["collected"] + p["fixed"] + p["per"] <= budget, (r["collected"], budget)
        assert_parity(ranks[0][name]["lay"], [rank[name] for rank in ranks])


def test_auto_sizes_then_auto_shares_at_them_keep_parity(runs):
    from megalite.batching.iteration_plan import balanced_counts
    ranks = [rank["auto_sizes_shares_auto"] for rank in runs["offload"]]
    (seconds, counts), micros = ranks[0]["shares"], ranks[0]["micros"]
    print(f"\nsizes auto -> {micros}; shares auto: seconds per micro-batch {seconds} -> micro-batches {counts}")
    assert micros == [4, 2] and all(r["shares"] == (seconds, counts) for r in ranks)
    units = balanced_counts([seconds[0], 2 * seconds[1]], 4)  # a unit of 4 samples: one micro-batch of 4, two of 2
    # 4 samples cost replica 0 4c, replica 1 2 x (2c + 20 ms): the third unit goes to replica 0 whatever c
    assert counts == [units[0], 2 * units[1]] and units[0] >= 2 and seconds[1] >= 0.02, (seconds, counts)
    assert_parity(ranks[0]["lay"], ranks)


def test_a_budget_nothing_fits_names_the_replica_and_the_cost():
    from megalite.training.memory_budget import GIB, Profile, choose
    p = Profile(states=GIB, at1=GIB // 4, at2=GIB // 2, pp_size=1, pp_rank=0)  # 0.25 GiB per sample
    assert choose(p, 2 * GIB, 8, None, False, 0, 1, False, 0) == (4, None)  # 1 + 4 x 0.25 GiB
    stage0 = Profile(states=GIB, at1=GIB // 4, at2=GIB // 2, pp_size=4, pp_rank=0)  # 1F1B: up to 4 in flight
    assert stage0.need(1, 8) == 2 * GIB and stage0.need(4, 8) == 3 * GIB  # 4 of 1 sample; 2 of 4 samples
    assert choose(p, 2 * GIB, 8, 2, True, GIB, 1, False, 0) == (2, 0.0)
    assert choose(p, 1.5 * GIB, 8, 4, True, GIB, 1, False, 0) == (4, 0.5)  # 0.5 GiB of the states moved
    for fraction_auto, hint in ((False, "add --optimizer-cpu-offload"), (True, "even with the whole optimizer")):
        with pytest.raises(ConfigError,
                           match=f"replica 1 cannot fit a micro-batch of 1.*{hint}.*0.2500 GiB per sample"):
            choose(p, 0.5 * GIB, 8, None, fraction_auto, 0.1 * GIB, 1, False, 1)
