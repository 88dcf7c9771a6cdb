"""Asynchronous outer updates (--semi-sync-async, megalite/distributed/semi_sync_async.py).

Proof: delayed Nesterov against torch.optim.SGD in float64 (R arrivals from one base are one synchronous step);
the slot decisions in a simulation of uneven replicas (every slot trained once, the staleness bound, the faster
replica trains more); on 4 CPU ranks, S = 0 with equal speeds (TP2, interleaved PP2, CP2, ZeRO-3 with
recompute inside) against the serial DiLoCo reference (as the
synchronous mode: losses, step-1 gradients, global weights, outer momentum, <= 1e-5), and with one replica
slowed: pseudo-gradients sent = applied = slots, each slot once, the bound kept, replicas ending identical;
a checkpoint of an asynchronous run continues as ordinary synchronous training."""

import time

import pytest
import torch

from dist_util import run_on_ranks
from megalite import parallel_state as ps
from megalite.config import ConfigError
from megalite.distributed.semi_sync_async import DelayedNesterov, Slots
from parity import BASE, MOE, check_reference, patched, run_layouts
from semi_sync_reference import DILOCO, EP2, collect, semi, semi_sync_mismatches, serial_reference

ASYNC = ("--semi-sync-async",)


# -- delayed Nesterov in float64 ------------------------------------------------------------------
@pytest.mark.parametrize("nesterov", [True, False])
def test_delayed_nesterov_windows_are_synchronous_sgd_steps(nesterov):
    """R arrivals computed from the same global weights: one torch.optim.SGD step with their sum."""
    torch.manual_seed(0)
    start, R = torch.randn(300, dtype=torch.float64), 3
    p = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=nesterov)
    dn = DelayedNesterov(start.clone(), 0.7, 0.9, nesterov, R)
    for _ in range(4):
        gs = [torch.randn(300, dtype=torch.float64) * 0.01 for _ in range(R)]
        for g in gs:
            dn.apply(g)
        p.grad = sum(gs)
        sgd.step()
        assert dn.count == 0 and torch.allclose(dn.glob, p.detach(), rtol=0, atol=1e-13)
    # a stale arrival in the middle of a window moves the weights by lr x its own value at once
    before = dn.glob.clone()
    g = torch.randn(300, dtype=torch.float64)
    dn.apply(g)
    assert torch.allclose(dn.glob, before - 0.7 * g, rtol=0, atol=1e-13) and dn.count == 1


# -- the slot decisions, simulated ------------------------------------------------------------------
def _simulate(seconds, rounds, staleness):
    """Replicas taking seconds[r] per slot, the server's decisions in arrival order: (slots, trained per replica,
    replicas that waited)."""
    R = len(seconds)
    slots = Slots(0, rounds, R, staleness)
    busy = {r: (seconds[r], slots.holding[r]) for r in range(R)}  # replica -> (finish time, slot)
    trained, waiting, waited, now = {r: [] for r in range(R)}, set(), set(), 0.0
    while busy:
        r = min(busy, key=lambda x: (busy[x][0], x))
        now, slot = busy.pop(r)
        assert slots.applied(r) == slot
        trained[r].append(slot)
        waiting.add(r)
        for w in sorted(waiting):
            nxt = slots.next_for(w)
            if nxt is None:
                waited.add(w)
                continue
            waiting.discard(w)
            if nxt != "stop":
                busy[w] = (now + seconds[w], nxt)
    assert not waiting
    return slots, trained, waited


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_slots_are_trained_once_within_the_staleness_bound(staleness):
    slots, trained, waited = _simulate([1.0, 3.0], 8, staleness)
    every = sorted(s for t in trained.values() for s in t)
    assert every == [(k, r) for k in range(8) for r in range(2)]  # each slot once, none lost
    for replica, (k, _), lowest in slots.grants:
        assert k - lowest <= staleness, (replica, k, lowest)
    if staleness == 0:
        assert [len(t) for t in trained.values()] == [8, 8] and 0 in waited  # the synchronous schedule
    else:
        assert len(trained[0]) > len(trained[1])  # the faster replica trained more of the work
    with_equal = _simulate([1.0, 1.0], 4, staleness)[1]
    assert with_equal == {r: [(k, r) for k in range(4)] for r in range(2)}  # equal speeds: each its own part


def test_one_asynchronous_replica_is_the_ordinary_run():
    """One replica, outer lr 1, momentum 0: every exchange gives back the replica's own weights (up to the
    fp32 rounding of the pseudo-gradient it sends: a difference of two fp32 weights, 2^-24 of the weights)."""
    from test_semi_sync import _run
    plain = _run([])
    one = _run(list(DILOCO[:2]) + ["--semi-sync-steps", "2", "--outer-lr", "1", "--outer-momentum", "0", *ASYNC])
    assert max(abs(a - b) / abs(b) for a, b in zip(one[0], plain[0])) <= 1e-5 and len(one[0]) == len(plain[0])
    for name, t in plain[1].items():
        assert (one[1][name] - t).abs().max() <= 1e-6 * t.abs().max(), name


# -- on ranks ---------------------------------------------------------------------------------------
def slow_replica_one():
    """Replica 1's inner steps take 0.25 s longer (a slower GPU)."""
    import megalite.training.step as training
    original = training.train_step

    def slow(*a, **k):
        if ps.get_replica_rank() == 1:
            time.sleep(0.25)
        return original(*a, **k)
    return patched(training, "train_step", slow)


def collect_async(chunks, opt):
    s = opt.semi_sync
    out = {**collect(chunks, opt), "sent": s.sent, "exchanges": s.exchanges}
    if s.server is not None:
        out.update(applied=list(s.server.applied), grants=list(s.server.slots.grants))
    return out


S0 = ASYNC + ("--semi-sync-max-staleness", "0")
# equal speeds, S = 0: the synchronous schedule, with TP, PP (interleaved), CP, ZeRO-3 + recompute and EP2 inside
SYNCHRONOUS_SCHEDULE = [semi("tp2_r2_async_s0", 2, "2", tp=2, dp=2, flags=S0),
                        semi("pp2_interleaved_r2_async_s0", 2, "2", pp=2, vp=1, dp=2, flags=S0),
                        semi("cp2_r2_async_s0", 2, "2", cp=2, dp=2, flags=S0),
                        semi("zero3_dp4_r2_recompute_async_s0", 2, "2", zero=3, dp=4, recompute="full", flags=S0),
                        semi("ep2_dp4_r2_moe_async_s0", 2, "2", dp=4, model=MOE, flags=S0 + EP2)]
SLOWED = semi("zero2_dp4_r2_async_s1_slowed", 2, "1", zero=2, dp=4, fault=slow_replica_one,
              flags=ASYNC + ("--semi-sync-max-staleness", "1", "--train-iters", "8"))


@pytest.fixture(scope="module")
def world():
    return run_layouts([SLOWED] + SYNCHRONOUS_SCHEDULE, 4, collect=collect_async, side_by_side=False)  # timed


@pytest.mark.parametrize("i", range(len(SYNCHRONOUS_SCHEDULE)), ids=[lay.name for lay in SYNCHRONOUS_SCHEDULE])
def test_equal_speeds_and_no_staleness_are_synchronous_diloco(world, i):
    lay, ranks = SYNCHRONOUS_SCHEDULE[i], world[1 + i]
    dp = 4 if "dp4" in lay.name else 2
    ref = serial_reference(lay, 2, [2, 2], DILOCO, dp)
    bad = semi_sync_mismatches(lay, ranks, ref, [2, 2], DILOCO, momentum_from={0})
    assert not bad, "\n".join(bad[:30])
    check_reference({"losses": ref["losses"][0]}, margin=0.3)


def test_a_slow_replica_does_not_hold_the_fast_one(world):
    ranks, S, rounds = world[0], 1, 8
    done = {}
    for r in ranks:
        c = r["collected"]
        slots = [a for a, _ in c["exchanges"]]
        assert c["sent"] == len(slots) == len(set(slots))
        done.setdefault(c["replica"], slots)
        assert done[c["replica"]] == slots  # every rank of a replica trained the same slots
        if "applied" in c:  # a server: what it applied is what was sent, the bound held at every grant
            assert sum(c["applied"]) == rounds * 2
            assert all(k - lowest <= S for _, (k, _), lowest in c["grants"]), c["grants"]
    assert sorted(done[0] + done[1]) == [(k, r) for k in range(rounds) for r in range(2)]
    assert len(done[0]) > len(done[1]), done  # the fast replica trained more slots
    first = {}
    for r in ranks:  # every replica ends on the same global weights
        for name, t in r["params"].items():
            assert torch.equal(first.setdefault((r["coords"], name), t), t), f"replicas differ in {name}"


# -- checkpoints, errors --------------------------------------------------------------------------
def _checkpoint_runs(d):
    from test_semi_sync import _run
    flags = list(DILOCO) + ["--semi-sync-replicas", "2", "--semi-sync-steps", "2", *ASYNC]
    out = {"async": _run(flags + ["--save", f"{d}/async"])}
    out["sync from async"] = _run(["--load", f"{d}/async"])  # nothing left to train: the saved weights
    return out


def test_an_asynchronous_checkpoint_loads_into_synchronous_training(tmp_path):
    for r in run_on_ranks(_checkpoint_runs, 2, str(tmp_path)):
        for name, t in r["async"][1].items():
            assert torch.equal(r["sync from async"][1][name], t), name


@pytest.mark.parametrize("flags, message", [
    (("--semi-sync-max-staleness", "1"), "bounds --semi-sync-async"),
    (ASYNC + ("--semi-sync-steps", "2,1"), "needs one --semi-sync-steps H"),
    (ASYNC + ("--semi-sync-steps", "5"), "must be a multiple of --semi-sync-steps 5"),
    (ASYNC + ("--semi-sync-steps", "2", "--semi-sync-fragments", "2"), "does not compose with --semi-sync-fragments"),
    (ASYNC + ("--semi-sync-steps", "2", "--eval-interval", "2"), "does not compose with --eval-interval"),
    (ASYNC + ("--semi-sync-steps", "2", "--data-parallel-shares", "1,2"), "--data-parallel-shares"),
    (ASYNC + ("--semi-sync-steps", "2", "--semi-sync-max-staleness", "-1"), "must be >= 0"),
])
def test_bad_combinations_are_one_line(flags, message):
    from megalite.cli.parser import _parse
    with pytest.raises(ConfigError) as e:
        _parse(list(BASE) + list(DILOCO) + list(flags), world_size=2)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
