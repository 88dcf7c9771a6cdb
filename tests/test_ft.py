"""Fault-tolerant replicas on torchft (megalite/training/ft.py): replicas as processes of their own around torchft's
Lighthouse, held to the uninterrupted one-process run (fp32, no dropout: the gradient sums run in another order, so
within the 1e-5 the parity harness holds reordered sums to) and to each other (bit for bit)."""

import re

import pytest
import torch

pytest.importorskip("torchft", reason="fault-tolerant replicas need torchft (pip install 'megalite[ft]')")

import pretrain_gpt  # noqa: E402
from ft_replicas import lighthouse, run_replicas  # noqa: E402
from megalite import parallel_state as ps  # noqa: E402
from megalite.cli.parser import parse_args  # noqa: E402
from megalite.training import pretrain  # noqa: E402
from parity_models import BASE, MB2, learnable_datasets  # noqa: E402

ITERS = 4


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _one_process(iters, extra=()):
    """The uninterrupted one-process run: (its losses, its weights after `iters` steps, its model config)."""
    args = parse_args(list(BASE) + ["--train-iters", str(iters)] + list(extra), world_size=1)
    try:
        losses, chunks, _ = pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                                     args, return_state=True)
        return losses, {n: p.detach().clone() for c in chunks for n, p in c.module.named_parameters()}, \
            chunks[0].module.config
    finally:
        ps.destroy_model_parallel()


def test_replicas_that_die_stop_nobody_heal_and_a_new_one_joins(tmp_path, capfd):
    """Three replicas; in iteration 2 replica 1 dies during the cross-replica reduction (its part sent) and replica 2
    before it (two at once): the survivor applies neither attempt (the vote) and trains alone on the whole batch
    until both, started again, heal from it (by iteration 4), and a new fourth replica joins at iteration 5. Replica
    2 has --ft-replica-share 2: the batch of 8 is split 2, 2, 4 over the first three, taken whole by the survivor
    alone, and split 2, 2, 3, 1 over the four. All four end with the same weights and Adam state, bit for bit, and
    those, and every
    iteration's logged loss, are the uninterrupted run's (every global batch trained exactly once, whatever the
    split)."""
    lh = lighthouse(min_replicas=1)
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    try:
        got = run_replicas(lh.address(), 3, tmp_path, save, iters=ITERS + 3, die=[(1, 2, "during"), (2, 2, "before")],
                           rejoin_at=4, join_at=5, own={2: ["--ft-replica-share", "2"]})
    finally:
        lh.shutdown()
    ref_losses, ref, config = _one_process(ITERS + 3)
    assert sorted(got) == [0, 1, 2, 3], sorted(got)
    out = capfd.readouterr().out
    for r, n in ((0, 2), (1, 2), (2, 3), (3, 1)):  # the four replicas' last split: shares 1, 1, 2, 1 of 8
        assert f"4 live replicas; this one trains {n} of 8 samples (replica {r};" in out, (r, n)
    l0, w0, s0, lr0, saved0, *_ = got[0]
    assert saved0 == [2, 4, 6, 7] and all(got[r][4] == [] for r in (1, 2, 3)), [got[r][4] for r in got]  # one writer
    assert len(l0) == ITERS + 3, len(l0)
    # the logged loss is the quorum's: every iteration's, whoever was alive, is the uninterrupted run's
    assert max(abs(a - b) / abs(b) for a, b in zip(l0, ref_losses)) <= 1e-5, (l0, ref_losses)
    for n in ref:
        assert _rel(torch.from_numpy(w0[n]), ref[n]) <= 1e-5, f"{n} differs from the uninterrupted run"
    for r in (1, 2, 3):
        lr, w, s, lrs, *_ = got[r]
        assert len(lr) >= (4 if r < 3 else 3) and lr == l0[-len(lr):], (r, lr, l0)  # healed by 4 (or sooner) / 5
        for n in ref:
            assert (w0[n] == w[n]).all(), f"replica {r}'s {n} differs from the survivor's"
        for k in s0:
            assert all((s0[k][n] == s[k][n]).all() for n in s0[k]), f"replica {r}'s optimizer state {k} differs"
        assert lrs == lr0 and lr0["num_steps"] == (ITERS + 3) * 8, (r, lrs, lr0)  # the LR schedule healed too
    from megalite.checkpoint.manager import load_weights
    ps.initialize_model_parallel(1, 1)
    try:  # the checkpoint holds the replicas' state
        model = pretrain_gpt.model_provider(config)
        meta = load_weights([model], str(tmp_path / "ckpt"))
        assert meta["iteration"] == ITERS + 3
        assert all((p.detach().numpy() == w0[n]).all() for n, p in model.named_parameters()), "checkpoint differs"
    finally:
        ps.destroy_model_parallel()


def test_a_reduction_failed_on_one_side_frees_the_peers_waiting_in_it(tmp_path):
    """Three replicas; in iteration 2 replica 1's cross-replica reduction fails on its side alone (as when a peer
    died and only this replica's exchanges with it failed) while replicas 0 and 2 wait inside the reduction for it.
    Once the vote went against the step, replica 1 closes its process group: the two fail at once, not after
    --ft-timeout (60 s here), and the step runs again over all three (nobody died): the one-process run. Without
    the close they wait the whole timeout, and no quorum forms meanwhile (one replica asking of three
    heartbeating is not a majority)."""
    import time
    lh = lighthouse(min_replicas=1)
    start = time.perf_counter()
    try:
        got = run_replicas(lh.address(), 3, tmp_path, ["--ft-timeout", "60"], iters=ITERS, refuse={1: 2})
    finally:
        lh.shutdown()
    took = time.perf_counter() - start
    assert took < 30, f"the replicas waited {took:.0f} s: the peers sat in the failed reduction until the timeout"
    ref_losses, ref, _ = _one_process(ITERS)
    l0, w0, *_ = got[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(l0, ref_losses)) <= 1e-5, (l0, ref_losses)
    for r in (1, 2):
        assert got[r][0] == l0 and all((got[r][1][n] == w0[n]).all() for n in ref), f"replica {r} differs"
    for n in ref:
        assert _rel(torch.from_numpy(w0[n]), ref[n]) <= 1e-5, f"{n} differs from the uninterrupted run"


@pytest.mark.parametrize("inner", [["--use-distributed-optimizer", "--ft-min-replicas", "2"],
                                   ["--use-distributed-optimizer", "--zero-stage", "3"],
                                   ["--tensor-model-parallel-size", "2", *MB2],
                                   ["--pipeline-model-parallel-size", "2"]],
                         ids=["dp2-zero1", "dp2-zero3", "tp2", "pp2"])
def test_replicas_of_two_ranks_heal(tmp_path, inner, capfd):
    """Two replicas of two ranks each: data-parallel inside with ZeRO-1 or ZeRO-3 (each rank sums only the gradient
    shard it owns with its counterpart in the other replica, HSDP-style; ZeRO-3's weights gathered from the healed
    shards as they are used), or tensor-parallel (each rank its own slice of the
    weights), or pipeline-parallel (each rank its stage's layers); both ranks of replica 1 die in iteration 2 and
    are started again (as its torchrun would): they heal rank by rank from replica 0's. Every rank's weights and
    optimizer state equal its counterpart's bit for bit,
    and the weights and losses are the one-process run's."""
    lh = lighthouse(min_replicas=1)
    try:
        got = run_replicas(lh.address(), 2, tmp_path, inner + ["--save", str(tmp_path / "ckpt"), "--save-interval",
                                                                str(ITERS)], iters=ITERS, die=[(1, 2, "before")],
                           rejoin_at=3, ranks=2, rejoin_when_waiting="--ft-min-replicas" in inner)
    finally:
        lh.shutdown()
    ref_losses, ref, config = _one_process(ITERS, MB2 if MB2[0] in inner else ())
    assert sorted(got) == [(0, 0), (0, 1), (1, 0), (1, 1)], sorted(got)
    l0 = got[(0, 0)][0]
    assert max(abs(a - b) / abs(b) for a, b in zip(l0, ref_losses)) <= 1e-5, (l0, ref_losses)
    for k in (0, 1):
        (la, wa, sa, lra, *_), (lb, wb, sb, lrb, *_) = got[(0, k)], got[(1, k)]
        assert len(lb) >= 1 and lb == l0[-len(lb):] and la == l0, (k, la, lb)  # (healed at the next quorum or so)
        # (PP: a stage's, the last one's with its copy of the tied embedding, which one process does not name)
        assert wa.keys() == wb.keys() and set(wa) <= set(ref) | {"output_layer.weight"}, sorted(set(wa) - set(ref))
        for n in wa:
            assert (wa[n] == wb[n]).all(), f"rank {k}: the healed replica's {n} differs"
        assert sa.keys() == sb.keys() and sa, (k, sorted(sa), sorted(sb))
        for n in sa:
            assert all((sa[n][key] == sb[n][key]).all() for key in sa[n]), f"rank {k}: optimizer shard of {n} differs"
        assert lra == lrb, (lra, lrb)
    assert set(got[(0, 0)][1]) | set(got[(0, 1)][1]) | {"output_layer.weight"} == set(ref) | {"output_layer.weight"}
    if "--ft-min-replicas" in inner:  # alone, the survivor waited for the restarted replica instead of training
        out = capfd.readouterr().out
        assert "megalite: fault tolerance: 1 live replica, fewer than --ft-min-replicas 2: waiting for more (replica " \
               "0)" in out and "1 live replica; this one trains" not in out, out[-3000:]
    whole = _checkpointed(tmp_path / "ckpt", config)
    assert whole.keys() == ref.keys(), sorted(whole)
    for n, w in whole.items():  # the replicas' weights, whole (any inner layout)
        assert _rel(w, ref[n]) <= 1e-5, f"{n} differs from the one-process run"


def _checkpointed(path, config):
    """The weights a checkpoint holds, loaded whole in one process."""
    from megalite.checkpoint.manager import load_weights
    ps.initialize_model_parallel(1, 1)
    try:
        model = pretrain_gpt.model_provider(config)
        load_weights([model], str(path))
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        ps.destroy_model_parallel()


def test_measured_shares_give_the_slow_replica_less(tmp_path, capfd):
    """--ft-replica-share auto: two replicas time their first two iterations (equal halves of the batch); replica 1
    sleeps 60 ms in each micro-batch's forward step (a slower GPU), so from then on the batch is split by the measured
    speeds and the fast replica trains most of it. Every batch is still trained exactly once: the losses and weights
    are the one-process run's, and the replicas end bit-identical."""
    lh = lighthouse(min_replicas=1)
    try:
        got = run_replicas(lh.address(), 2, tmp_path, ["--ft-replica-share", "auto", "--ft-share-profile-iters", "2"],
                           iters=ITERS + 1, slow={1: 0.06})
    finally:
        lh.shutdown()
    out = capfd.readouterr().out
    ref_losses, ref, _ = _one_process(ITERS + 1)
    assert "2 live replicas; this one trains 4 of 8 samples (replica 0;" in out  # the profiled iterations
    # (once on each replica; the two processes' lines may interleave in the captured output)
    chosen = re.findall(r"--ft-replica-share auto: ms per micro-batch by live replica [0-9., ]+-> micro-batches "
                        r"(\d+), (\d+) \(replica", out)
    assert len(chosen) == 2 and chosen[0] == chosen[1], chosen
    fast, slow = (int(n) for n in chosen[0])
    assert fast >= 6 and slow >= 1 and fast + slow == 8, chosen
    assert f"2 live replicas; this one trains {fast} of 8 samples (replica 0;" in out, chosen
    (l0, w0, s0, *_), (l1, w1, *_) = got[0], got[1]
    assert max(abs(a - b) / abs(b) for a, b in zip(l0, ref_losses)) <= 1e-5, (l0, ref_losses)
    for n in ref:
        assert _rel(torch.from_numpy(w0[n]), ref[n]) <= 1e-5 and (w0[n] == w1[n]).all(), n


FP8_DELAYED = ["--fp8-format", "hybrid", "--fp8-amax-history-len", str(ITERS), "--fp8-amax-compute-algo", "max"]


def test_fp8_replicas_share_their_histories_and_heal_them(tmp_path):
    """FP8 (delayed scaling) replicas: each iteration's amaxes are the maximum over the quorum (as one process's are
    over its micro-batches), taken into the histories only when the step commits, and a restarted replica heals them
    from its peer. Replica 1 dies during iteration 2's reduction and heals: both end with the same weights, Adam
    state and histories bit for bit; step 1 is the one-process FP8 run's (later FP8 steps part from a rounding
    apart, as any layout's do). Fails with each replica's own amaxes, or a heal without the histories."""
    lh = lighthouse(min_replicas=1)
    try:
        got = run_replicas(lh.address(), 2, tmp_path, FP8_DELAYED, iters=ITERS, die=[(1, 2, "during")], rejoin_at=3)
    finally:
        lh.shutdown()
    ref_losses, _, _ = _one_process(ITERS, FP8_DELAYED)
    (l0, w0, s0, *_, h0), (l1, w1, s1, *_, h1) = got[0], got[1]
    assert abs(l0[0] - ref_losses[0]) <= 1e-5 * abs(ref_losses[0]) and l0[0] - l0[-1] > 0.1, (l0, ref_losses)
    assert all((w0[n] == w1[n]).all() for n in w0) and all((s0[k][n] == s1[k][n]).all() for k in s0 for n in s0[k])
    assert h0 and h0 == h1, "the replicas' FP8 histories differ"
    # (every iteration's entry: the healed replica's first ones came with the heal)
    assert all(len(h["x"]) == ITERS and h["x"][-1] > 0 for h in h0.values()), h0


def test_an_unreachable_lighthouse_is_one_line(capsys):
    args = parse_args(list(BASE) + ["--train-iters", "1", "--ft-lighthouse", "localhost:1", "--ft-replica-id", "0",
                                    "--ft-connect-timeout", "1"], world_size=1)
    try:
        with pytest.raises(SystemExit) as e:
            pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
    finally:
        ps.destroy_model_parallel()
    assert e.value.code != 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("megalite: error")]
    assert len(err) == 1 and "--ft-lighthouse localhost:1: cannot join the Lighthouse within --ft-connect-timeout 1 s" \
        in err[0], err


def test_replicas_launched_differently_are_named():
    """The first quorum compares every replica's model and inner layout (their mean must equal each one's): what
    differs is named in the one line that stops them."""
    from megalite.cli.parser import model_config
    from megalite.training.ft import disagreement, fingerprint
    ps.initialize_model_parallel(1, 1)
    try:
        def values(*flags):
            args = parse_args(list(BASE) + list(flags), world_size=1)
            return fingerprint(args, ps.current_grid(), model_config(args, args.vocab_size))
        names, mine = values()
        for flags, named in ((("--hidden-size", "64"), ["model architecture"]),
                             (("--global-batch-size", "16"), ["--global-batch-size"]), ((), [])):
            other = values(*flags)[1]
            assert disagreement(names, mine, [(a + b) / 2 for a, b in zip(mine, other)]) == named, flags
    finally:
        ps.destroy_model_parallel()


def _outer_reference(records, lr, momentum):
    """The outer step DiLoCo defines, in float64, from the participating replicas' records (local weights, global
    weights and outer momentum before it, samples): g = sum_r w_r (global - local_r), buf = mu buf + g, global -=
    lr (g + mu buf) (Nesterov); and each element's bound on the fp32 rounding the replicas' step went through (the
    contributions cast to fp32 and summed in fp32, the outer momentum and the new global weights stored in fp32)."""
    import numpy as np
    total = sum(r["samples"] for r in records)
    glob, buf = records[0]["glob"], records[0]["buf"]
    out, bound = [], []
    for i, g0 in enumerate(glob):
        parts = [r["samples"] / total * (g0 - r["local"][i]) for r in records]
        g = sum(parts)
        b = g if buf is None else momentum * buf[i] + g
        new = g0 - lr * (g + momentum * b)
        u = 2.0 ** -24
        out.append(new)
        bound.append(4 * u * (np.abs(new) + lr * (1 + 2 * momentum) * sum(np.abs(p) for p in parts)))
    return out, bound


def test_diloco_replicas_under_faults(tmp_path, capfd):
    """DiLoCo over three fault-tolerant replicas, two inner steps per round. Replica 1 dies in the middle of round
    2 (iteration 3): the survivors' outer step at iteration 4 fails the vote and runs again over the two of them,
    weighted by the samples they trained (the dead replica's inner steps lost; the log says how many samples).
    Replica 1, started again, asks replica 0 for the state at round 3's start, and replica 0 dies while sending it:
    replica 1 heals from replica 2 instead, and the two train round 3. Every outer step equals the one computed here
    from its participants' local weights, and the last two replicas end on the same weights, bit for bit."""
    import numpy as np
    from ft_replicas import outer_records
    lh = lighthouse(min_replicas=1)
    try:
        got = run_replicas(lh.address(), 3, tmp_path, ["--semi-sync-method", "diloco", "--semi-sync-steps", "2"],
                           iters=6, die=[(1, 3, "before")], rejoin_at=5, lose=[0])
    finally:
        lh.shutdown()
    assert sorted(got) == [1, 2], sorted(got)
    out = capfd.readouterr().out
    # the split of 8 over three is 3, 3, 2 micro-batches of one sample: replica 1's 3 of both iterations lost
    assert "the outer step at iteration 4 ran over 2 of the round's 3 replicas; 6 of its 16 samples were lost" in out
    assert "replica 1 healed from a live peer at iteration 4" in out
    rec = outer_records(tmp_path)
    assert [len(r) for r in rec[0]] == [2] and [len(r) for r in rec[1]] == [1, 1] and [len(r) for r in rec[2]] == [3]
    rounds = ([rec[0][0][0], rec[1][0][0], rec[2][0][0]],  # round 1: all three
              [rec[0][0][1], rec[2][0][1]],  # round 2: the survivors of replica 1's death
              [rec[1][1][0], rec[2][0][2]])  # round 3: replica 1 healed from replica 2 (replica 0 died sending)
    assert [sum(r["samples"] for r in who) for who in rounds] == [16, 10, 16]
    for k, who in enumerate(rounds):
        want, bound = _outer_reference(who, 0.7, 0.9)
        for r in who:
            assert all((r["after"][i] == who[0]["after"][i]).all() for i in range(len(want))), k
        for i, (w, b) in enumerate(zip(want, bound)):
            assert (np.abs(who[0]["after"][i] - w) <= b).all(), (k, i, np.abs(who[0]["after"][i] - w).max(), b.max())
    for a, b in zip(rounds[2][0]["glob"] + rounds[2][0]["buf"], rounds[2][1]["glob"] + rounds[2][1]["buf"]):
        assert (a == b).all(), "the healed replica did not start round 3 on the global weights and momentum"
    assert all((got[1][1][n] == got[2][1][n]).all() for n in got[2][1]), "replica 1 ends on other weights"


def test_diloco_replicas_of_two_ranks_with_zero(tmp_path):
    """DiLoCo over two replicas of two ranks each (ZeRO-1 inside): each rank's outer step sums the main-weight
    shard it owns with its counterpart's, and equals the outer step computed here from the two shards' records;
    counterparts end bit-identical."""
    import numpy as np
    from ft_replicas import outer_records
    lh = lighthouse(min_replicas=1)
    try:
        got = run_replicas(lh.address(), 2, tmp_path, ["--semi-sync-method", "diloco", "--semi-sync-steps", "2",
                                                       "--use-distributed-optimizer"], iters=4, ranks=2)
    finally:
        lh.shutdown()
    assert sorted(got) == [(0, 0), (0, 1), (1, 0), (1, 1)], sorted(got)
    rec = outer_records(tmp_path)
    for k in (0, 1):  # rank k of both replicas: its shard's two outer steps
        assert [len(x) for x in rec[(0, k)] + rec[(1, k)]] == [2, 2], (k, rec.keys())
        for step in (0, 1):
            who = [rec[(0, k)][0][step], rec[(1, k)][0][step]]
            want, bound = _outer_reference(who, 0.7, 0.9)
            for i, (w, b) in enumerate(zip(want, bound)):
                assert (who[0]["after"][i] == who[1]["after"][i]).all(), (k, step, i)
                assert (np.abs(who[0]["after"][i] - w) <= b).all(), (k, step, i)
    for k in (0, 1):
        assert all((got[(0, k)][1][n] == got[(1, k)][1][n]).all() for n in got[(0, k)][1]), k
