"""megalite/moe/decisions.py and the parity harness's replay of ties (tests/support/decision_replay.py).

- decisions.topk is torch.topk when nobody hooks it, and takes a hook's indices otherwise;
- the Replayer takes the single process's choice for a row whose own choice differs by a tie
  within the rows' difference, and reports a row with no counterpart and a choice that differs
  by more than a tie (a wrong score is not hidden); a router's rows are told by their tokens' inputs;
- through pretrain(): a run whose MoE routing choices are made on scores perturbed by 5e-3 of
  their spread (another machine's rounding, much exaggerated) differs from the single process
  without the replay, and equals it exactly with it.
"""

import torch

from decision_replay import KEY_MATCH, MATCH, Recorder, Replayer
from megalite.moe import decisions
from parity import layout, patched, reference, train
from parity_check import mismatches


def test_topk_is_torch_topk_unless_hooked():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 9, generator=g)
    got, want = decisions.topk(x, 3, 1, "test"), torch.topk(x, 3, dim=1)
    assert torch.equal(got.values, want.values) and torch.equal(got.indices, want.indices)
    fixed = torch.arange(3).expand(37, 3)
    with decisions.hooked(lambda kind, values, k, dim, choosable, about: fixed if kind == "test" else None):
        got = decisions.topk(x, 3, 1, "test")
        assert torch.equal(got.indices, fixed) and torch.equal(got.values, x[:, :3])
        assert torch.equal(decisions.topk(x, 3, 1, "other").indices, want.indices)


def _recorded(rows, k):
    rec = Recorder()
    with decisions.hooked(rec):
        decisions.topk(rows, k, 1, "routing")
    return rec.table()


def test_replay_takes_ties_and_reports_the_rest():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(64, 6, dtype=torch.float64, generator=g)
    ref[5, :3] = torch.tensor([2.0, 1.0, 1.0 + 1e-7])  # a near-tie between the 2nd and 3rd
    table = _recorded(ref, 2)
    world = ref + 1e-9 * torch.randn(ref.shape, dtype=torch.float64, generator=g)
    world[5, 1] += 2e-7  # another rounding: the tie goes the other way
    assert torch.topk(world, 2, 1).indices[5].sort().values.tolist() == [0, 1]
    rep = Replayer(table, MATCH["fp32"])
    with decisions.hooked(rep):
        got = decisions.topk(world, 2, 1, "routing").indices
    assert got[5].sort().values.tolist() == [0, 2] and rep.counts["routing"] == [64, 1] and not rep.problems
    assert torch.equal(got[6:], torch.topk(world, 2, 1).indices[6:])  # the others: its own

    wrong = world.clone()
    wrong[7] = wrong[7].flip(0)  # a wrong score: no counterpart
    rep = Replayer(table, MATCH["fp32"])
    with decisions.hooked(rep):
        got = decisions.topk(wrong, 2, 1, "routing").indices
    assert len(rep.problems) == 1 and "no counterpart" in rep.problems[0], rep.problems
    assert torch.equal(got[7], torch.topk(wrong, 2, 1).indices[7])  # its own choice stands: parity sees it too
    # a counterpart whose recorded choice differs by more than a tie (here: recorded wrongly)
    rows, idx, keys = table[("routing", 6, 2)]
    bad = {("routing", 6, 2): (rows, ref.topk(2, 1, largest=False).indices.sort(-1).values, keys)}
    rep = Replayer(bad, MATCH["fp32"])
    with decisions.hooked(rep):
        decisions.topk(ref, 2, 1, "routing")
    assert rep.problems and all("not a tie" in p for p in rep.problems), rep.problems


def test_keyed_replay_tells_tokens_by_their_input():
    """A router's rows found by its tokens' inputs (decisions.about) at the same router and step: two tokens
    whose scores nearly agree but chose differently are told apart by their inputs; a token whose scores moved
    by more than a rounding is reported; with `steps`, later steps are not replayed."""
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(32, 8, dtype=torch.float64, generator=g)
    ref = torch.rand(32, 4, dtype=torch.float64, generator=g)
    ref[3] = torch.tensor([0.5, 0.40, 0.40 + 1e-7, 0.1])  # token 3: a tie between experts 1 and 2
    ref[4] = ref[3] + torch.tensor([0.0, 2e-3, 0.0, 0.0])  # token 4: nearly token 3's scores, chose {0, 1}
    ref[3, 2] += 2e-3  # token 3 chose {0, 2}
    rec = Recorder()
    with decisions.hooked(rec), decisions.about("router", keys):
        decisions.topk(ref, 2, 1, "routing")
    table = rec.table()
    assert list(table) == [("routing", 4, 2, "router", 0)]
    world = ref.clone()
    world[3, 2] -= 2.1e-3  # a rounding of the tie's size: token 3 now chooses {0, 1}, as token 4 did
    world_keys = keys + 1e-9 * torch.randn(keys.shape, dtype=torch.float64, generator=g)
    values_only = Replayer({("routing", 4, 2): table[("routing", 4, 2, "router", 0)]}, MATCH["fp32"])
    with decisions.hooked(values_only):
        decisions.topk(world, 2, 1, "routing")
    assert values_only.problems and "ambiguous" in values_only.problems[0], values_only.problems
    rep = Replayer(table, 1e-1, KEY_MATCH["fp32"])
    with decisions.hooked(rep), decisions.about("router", world_keys):
        got = decisions.topk(world, 2, 1, "routing").indices
    assert got[3].sort().values.tolist() == [0, 2] and rep.counts["routing"] == [32, 1] and not rep.problems

    wrong = world.clone()
    wrong[9] = 1 - wrong[9]  # the same token, another choice on scores not a rounding apart
    rep = Replayer(table, MATCH["fp32"], KEY_MATCH["fp32"])
    with decisions.hooked(rep), decisions.about("router", world_keys):
        decisions.topk(wrong, 2, 1, "routing")
    assert any("wrong score" in p for p in rep.problems), rep.problems

    rep = Replayer(table, 1e-1, KEY_MATCH["fp32"], steps=1)
    rep.step = 1  # past the replayed steps: every choice its own, nothing looked up
    with decisions.hooked(rep), decisions.about("router", world_keys):
        got = decisions.topk(world, 2, 1, "routing").indices
    assert got[3].sort().values.tolist() == [0, 1] and not rep.problems


def choices_on_perturbed_scores():
    """Each top-k chosen on its values plus noise of 5e-3 of the row's spread; the values returned are
    the true ones at the chosen indices (only the decision sees the perturbation)."""
    original = decisions.topk
    g = torch.Generator().manual_seed(7)

    def topk(values, k, dim, kind, choosable=None):
        spread = values.amax(dim, keepdim=True) - values.amin(dim, keepdim=True)
        noisy = values + 5e-3 * spread * (torch.rand(values.shape, generator=g, dtype=values.dtype) - 0.5)
        idx = original(noisy, k, dim, kind, choosable).indices
        return torch.return_types.topk((values.gather(dim, idx), idx))
    return patched(decisions, "topk", topk)


MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--moe-aux-loss-coeff", "0.01")


def test_replayed_ties_give_the_single_process_run():
    lay = layout("moe_perturbed_choices", model=MOE, fault=choices_on_perturbed_scores)
    ref = reference(lay)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference: the same sums, so the same run exactly
    try:
        replayed = train(lay, decided=ref["decided"])
        alone = train(lay, decided={})  # nothing to replay from: every differing choice stands
    finally:
        torch.set_num_threads(threads)
    rows, taken = replayed["replayed"]["routing"]
    print(f"\n{taken} of {rows} routing choices flipped by the perturbation were replayed")
    assert taken >= 1, "the perturbation flipped no choice: the test shows nothing"
    assert not mismatches(lay, [replayed], ref, tol=0.0), mismatches(lay, [replayed], ref, tol=0.0)[:3]
    differ = [m for m in mismatches(lay, [alone], ref) if "never took" not in m]
    assert differ, "choices flipped by the perturbation went unseen"
