"""Fault-tolerant replicas on torchft (megalite/training/ft.py): replicas as processes of their own around torchft's
Lighthouse, held to the uninterrupted one-process run (fp32, no dropout: the gradient sums run in another order, so
within the 1e-5 the parity harness holds reordered sums to) and to each other (bit for bit)."""

import pytest
import torch

pytest.importorskip("torchft", reason="fault-tolerant replicas need torchft (pip install 'megalite[ft]')")

import pretrain_gpt  # noqa: E402
from ft_replicas import lighthouse, run_replicas  # noqa: E402
from megalite import parallel_state as ps  # noqa: E402
from megalite.cli.parser import parse_args  # noqa: E402
from megalite.training import pretrain  # noqa: E402
from parity_models import BASE, learnable_datasets  # noqa: E402

ITERS = 4


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_a_replica_that_dies_stops_nobody_and_heals(tmp_path):
    """Replica 1 dies in the middle of iteration 2 (after its backward, before the cross-replica reduction) and is
    started again: the survivor does not apply that step (the vote), runs the batch again alone, and goes on; the
    restarted replica heals from it and trains the rest with it. Both end with the same weights and Adam state, bit
    for bit, and those are the uninterrupted run's (every global batch trained exactly once)."""
    lh = lighthouse(min_replicas=1)
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    try:
        got = run_replicas(lh.address(), 2, tmp_path, save, iters=ITERS + 2, die=(1, 2), rejoin_at=4)
    finally:
        lh.shutdown()
    args = parse_args(list(BASE) + ["--train-iters", str(ITERS + 2)], world_size=1)
    try:
        ref_losses, chunks, _ = pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                                         args, return_state=True)
        ref = {n: p.detach().clone() for c in chunks for n, p in c.module.named_parameters()}
    finally:
        ps.destroy_model_parallel()
    (l0, w0, s0, lr0, saved0), (l1, w1, s1, lr1, saved1) = got[0], got[1]
    assert saved0 == [2, 4, 6] and saved1 == [], (saved0, saved1)  # one writer: the first live replica
    assert len(l0) == ITERS + 2 and len(l1) < ITERS + 2, (len(l0), len(l1))  # replica 1 healed past some
    # the logged loss is the quorum's mean: every iteration's, whoever was alive, is the uninterrupted run's
    assert max(abs(a - b) / abs(b) for a, b in zip(l0, ref_losses)) <= 1e-5, (l0, ref_losses)
    assert l1 == l0[-len(l1):], (l1, l0)
    for n in ref:
        assert (w0[n] == w1[n]).all(), f"the healed replica's {n} differs from the survivor's"
        assert _rel(torch.from_numpy(w0[n]), ref[n]) <= 1e-5, f"{n} differs from the uninterrupted run"
    for k in s0:
        assert all((s0[k][n] == s1[k][n]).all() for n in s0[k]), f"the healed replica's optimizer state {k} differs"
    assert lr0 == lr1 and lr0["num_steps"] == (ITERS + 2) * 8, (lr0, lr1)  # the LR schedule healed too
    from megalite.checkpointing import load_weights
    ps.initialize_model_parallel(1, 1)
    try:  # the checkpoint holds the replicas' state
        model = pretrain_gpt.model_provider(chunks[0].module.config)
        meta = load_weights([model], str(tmp_path / "ckpt"))
        assert meta["iteration"] == ITERS + 2
        assert all((p.detach().numpy() == w0[n]).all() for n, p in model.named_parameters()), "checkpoint differs"
    finally:
        ps.destroy_model_parallel()


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
