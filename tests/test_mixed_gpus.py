"""Mixed GPUs. --data-parallel-shares: DP ranks take unequal shares of the global batch, and
the update is still the single process's on the whole batch (megalite/batching/iteration_plan.py).
--pipeline-model-parallel-layout: stages with unequal numbers of layers.

Parity (tests/support/parity.py: losses, every step-1 gradient before clipping, the norms, the
parameters after 6 steps, fp32 bound 1e-5 since the DP sums are ordered differently) with TP+SP,
PP with a per-token loss, interleaved PP with ZeRO-2, DP3, `auto` with one replica slowed down,
and uneven layouts (one interleaved with an empty chunk); a checkpoint continued with the same
shares (bit-exact), with other shares, and from an uneven PP2 layout at PP1. The sampler's
slices and the one-line errors need no ranks. The wrong weighting (mean of per-rank means) is
caught in tests/test_fault_injection.py.
"""

import contextlib
import json
import os
import tempfile
import time

import pytest
import torch

from dist_util import rel_err
from megalite.config import ConfigError
from megalite.data import MegatronPretrainingSampler, SharesPretrainingSampler
from megalite.batching.iteration_plan import IterationPlan, balanced_counts, parse_shares
from megalite.batching.microbatches import BatchSchedule
from parity import MB2, STEPS, BigramChainDataset, layout, reference, run_layouts, train
from parity_check import assert_parity


def with_validation(args, num_samples):
    return tuple(BigramChainDataset(n, args.seq_length, args.seed + i) for i, n in enumerate(num_samples))


def shares(*s):
    return ("--data-parallel-shares", ",".join(map(str, s)))


PER_TOKEN = ("--calculate-per-token-loss",)
FOUR = [
    layout("tp2_sp_dp2_shares_3_1", tp=2, dp=2, sp=True, flags=shares(3, 1), model=MB2),
    layout("pp2_dp2_shares_1_3_per_token", pp=2, dp=2, flags=shares(1, 3), model=PER_TOKEN),
    layout("pp2_dp2_interleaved_zero2_shares_3_1", pp=2, dp=2, vp=1, zero=2, flags=shares(3, 1)),
    layout("cp2_dp2_shares_1_3", cp=2, dp=2, flags=shares(1, 3), model=MB2),
    layout("tp2_dp2_zero1_recompute_full_shares_1_3", tp=2, dp=2, zero=1, recompute="full", flags=shares(1, 3),
           model=MB2),
]
LAYOUT = "--pipeline-model-parallel-layout"
FOUR += [
    layout("pp2_dp2_layout_3_1_shares_3_1", pp=2, dp=2, flags=(LAYOUT, "Ettt|tL") + shares(3, 1)),
    layout("pp2_dp2_layout_interleaved_empty_chunk_zero1", pp=2, dp=2, zero=1, flags=(LAYOUT, "Ett|t||tL")),
    # Megatron's split with the embedding and the loss counted as layers: 6 + 2 over 2 x 2 chunks.
    layout("pp2_dp2_vstages2_account_for_embedding_and_loss", pp=2, dp=2, model=("--num-layers", "6"), flags=(
        "--num-virtual-stages-per-pipeline-rank", "2", "--account-for-embedding-in-pipeline-split",
        "--account-for-loss-in-pipeline-split")),
    # Megatron's tunable interleaving: 5 micro-batches per rank (not a multiple of PP) in groups of 5, or 3 + 2.
    layout("pp2_dp2_interleaved_5_microbatches_group_5", pp=2, dp=2, vp=1, model=("--global-batch-size", "10"),
           flags=("--microbatch-group-size-per-virtual-pipeline-stage", "5")),
    layout("pp2_dp2_interleaved_5_microbatches_group_3", pp=2, dp=2, vp=1, model=("--global-batch-size", "10"),
           flags=("--microbatch-group-size-per-virtual-pipeline-stage", "3")),
]


@contextlib.contextmanager
def counting():
    """The run's DP collectives counted from zero."""
    from megalite.distributed import comm
    comm.reset()
    yield


@contextlib.contextmanager
def two_ranks_per_node():
    """Two 'nodes' of two ranks (what torchrun's LOCAL_WORLD_SIZE says), collectives counted."""
    from megalite.distributed import comm
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    comm.reset()
    try:
        yield
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


FOUR += [
    layout("dp4_flat_counted", dp=4, fault=counting),
    layout("dp4_hierarchical_two_nodes", dp=4, fault=two_ranks_per_node, flags=("--hierarchical-grad-reduce",)),
    layout("dp4_hierarchical_two_nodes_shares_2_2_3_1", dp=4, fault=two_ranks_per_node,
           flags=("--hierarchical-grad-reduce",) + shares(2, 2, 3, 1)),
]
HASH = ("--check-weight-hash-across-dp-replicas-interval", "1")  # stop if replicas differ in any bit
COMPRESSED = [
    layout("dp4_topk_ratio_1", dp=4, flags=("--grad-compression", "topk", "--grad-compression-ratio", "1")),
    layout("dp4_topk_from_iteration_4", dp=4, flags=("--grad-compression", "topk", "--grad-compression-ratio", "0.05",
                                                     "--grad-compression-start-iter", "4") + HASH),
    layout("tp2_dp2_powersgd", tp=2, dp=2, model=MB2,
           flags=("--grad-compression", "powersgd", "--grad-compression-ratio", "0.3") + HASH),
]
FOUR += COMPRESSED[:1]
# Global layer indices each pipeline rank builds, per chunk, where the layout says so.
LAYERS = {"pp2_dp2_layout_3_1_shares_3_1": {0: [[0, 1, 2]], 1: [[3]]},
          "pp2_dp2_layout_interleaved_empty_chunk_zero1": {0: [[0, 1], []], 1: [[2], [3]]},
          "pp2_dp2_vstages2_account_for_embedding_and_loss": {0: [[0], [3, 4]], 1: [[1, 2], [5]]}}
THREE = [layout("dp3_shares_4_2_2", dp=3, flags=shares(4, 2, 2))]


def layers_and_collectives(chunks, optimizer):
    from megalite.distributed import comm
    return {"layers": [sorted(int(i) for i in c.module.decoder.layers.keys()) for c in chunks], "comm": comm.counts()}


def slow_second_replica():
    """DP rank 1 sleeps 20 ms per micro-batch: `auto` must give it fewer."""
    import pretrain_gpt
    from megalite import parallel_state as ps
    original = pretrain_gpt.forward_step

    def forward_step(it, model):
        if ps.get_data_parallel_rank() == 1:
            time.sleep(0.02)
        return original(it, model)
    stack = contextlib.ExitStack()
    stack.callback(setattr, pretrain_gpt, "forward_step", original)
    pretrain_gpt.forward_step = forward_step
    return stack


AUTO = layout("dp2_auto_rank1_slow", dp=2, fault=slow_second_replica,
              flags=("--data-parallel-shares", "auto", "--data-parallel-shares-profile-iters", "2"))


def _with_checkpoints(directory):
    """In the ranks: shares 3,1 uninterrupted; saving at step 3 and stopping; then resumed with
    the same shares and with 1,3; plus the `auto` layout. Returns the runs' results."""
    full = train(layout("full", dp=2, flags=shares(3, 1)))
    first = train(layout("save", dp=2, flags=shares(3, 1) + ("--save", directory, "--save-interval", "3",
                                                             "--exit-interval", "3")))
    same = train(layout("same", dp=2, flags=shares(3, 1) + ("--load", directory)))
    other = train(layout("other", dp=2, flags=shares(1, 3) + ("--load", directory)))
    staged = directory + "_layout"
    train(layout("save_layout", pp=2, flags=(LAYOUT, "Ettt|tL", "--save", staged, "--save-interval", "3",
                                               "--exit-interval", "3")))
    from_layout = train(layout("from_layout", dp=2, flags=shares(1, 3) + ("--load", staged)))
    auto = train(AUTO)
    evals = {}
    for name, flags in (("equal", ()), ("shares", shares(3, 1))):  # evaluation follows the shares
        path = f"{directory}_{name}.jsonl"
        train(layout(name, dp=2, datasets=with_validation, flags=flags + (
            "--eval-iters", "2", "--eval-interval", "3", "--log-json", path)))
        if os.path.exists(path):  # the last rank logs
            with open(path) as f:
                evals[name] = [v for line in f for k, v in json.loads(line).items() if k == "validation lm loss"]
    return {"evals": evals,"full": full, "first": first, "same": same, "other": other, "from_layout": from_layout,
            "auto": auto, "chosen": auto["record"].shares}


@pytest.fixture(scope="module")
def runs():
    out = dict(zip((lay.name for lay in FOUR + COMPRESSED[1:]),
                   run_layouts(FOUR + COMPRESSED[1:], 4, collect=layers_and_collectives)))
    out.update(zip((lay.name for lay in THREE), run_layouts(THREE, 3)))
    from dist_util import run_on_ranks
    with tempfile.TemporaryDirectory() as d:
        out["checkpoint"] = run_on_ranks(_with_checkpoints, 2, os.path.join(d, "ckpt"), timeout=300)
    return out


@pytest.mark.parametrize("lay", FOUR + THREE, ids=lambda lay: lay.name)
def test_uneven_shares_and_layouts_match_single_process(runs, lay):
    for r in runs[lay.name] if lay.name in LAYERS else ():
        assert r["collected"]["layers"] == LAYERS[lay.name][r["coords"][1]], f"pipeline rank {r['coords'][1]}"
    assert_parity(lay, runs[lay.name])


def test_hierarchical_reduction_sends_half_the_bytes_across_nodes(runs):
    """Flat: one all-reduce of every bucket. Two nodes of two: the buckets are reduce-scattered
    in the node, half of each crosses nodes in the all-reduce, and is all-gathered back."""
    for flat, hier in zip(runs["dp4_flat_counted"], runs["dp4_hierarchical_two_nodes"]):
        flat, hier = flat["collected"]["comm"], hier["collected"]["comm"]
        print(f"\nflat {flat}\nhierarchical {hier}")
        bucket_bytes = hier["reduce_scatter"]["payload_bytes"]
        assert hier["all_reduce"]["payload_bytes"] * 2 == bucket_bytes == hier["all_gather"]["payload_bytes"]
        assert hier["reduce_scatter"]["calls"] == flat["all_reduce"]["calls"] == hier["all_reduce"]["calls"] > 0
        # The same buckets (padded to an even length: at most one element, 4 bytes, each).
        assert 0 <= bucket_bytes - flat["all_reduce"]["payload_bytes"] <= 4 * flat["all_reduce"]["calls"]


def test_auto_shares_favour_the_faster_replica_and_keep_parity(runs):
    ranks = [r["auto"] for r in runs["checkpoint"]]
    seconds, counts = runs["checkpoint"][0]["chosen"]
    print(f"\nauto: seconds per micro-batch by replica {seconds}, counts {counts}")
    assert all(r["chosen"] == (seconds, counts) for r in runs["checkpoint"]), "ranks chose different shares"
    assert sum(counts) == 8 and counts[0] > counts[1], f"the slowed replica 1 was not given less: {counts}"
    assert seconds[1] > seconds[0] + 0.015, f"the 20 ms sleep of replica 1 was not measured: {seconds}"
    assert_parity(AUTO, ranks)


def test_resume_with_the_same_shares_is_exact_and_with_other_shares_within_bound(runs):
    ref = reference(layout("r", dp=2))
    for r in runs["checkpoint"]:  # per rank
        full, same, other = r["full"], r["same"], r["other"]
        assert r["first"]["losses"] == full["losses"][:3] and len(same["losses"]) == STEPS - 3
        # The same shares sum the same micro-batches in the same order: bit-exact.
        assert same["losses"] == full["losses"][3:]
        for name, want in full["params"].items():
            assert torch.equal(same["params"][name], want), f"same-shares resume differs in {name}"
        # Other shares: the same batches, summed in another order (fp32 bound), never other samples.
        for a, b in zip(other["losses"], full["losses"][3:]):
            assert abs(a - b) <= 1e-5 * abs(b), (other["losses"], full["losses"])
        for name, want in ref["params"].items():
            assert rel_err(other["params"][name], want) <= 1e-5, name
            # Saved by an uneven PP2 layout, continued at PP1 DP2 with shares: global names, same run.
            assert rel_err(r["from_layout"]["params"][name], want) <= 1e-5, name


def test_evaluation_with_shares_equals_equal_shares(runs):
    """Validation at iterations 3 and 6 and the final one (each 2 global batches of 8): the shares'
    global mean over the same samples; the weights differ in the last bits (other DP sums)."""
    evals = runs["checkpoint"][-1]["evals"]
    print(f"\nvalidation lm loss, equal shares {evals['equal']}, shares 3,1 {evals['shares']}")
    assert len(evals["equal"]) == len(evals["shares"]) == 3
    for a, b in zip(evals["shares"], evals["equal"]):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_sampler_slices_are_disjoint_complete_and_resumable():
    sched = BatchSchedule(12, 2, 3)
    plan = IterationPlan(sched, [3, 2, 1])  # 6, 4, 2 samples: 3, 2, 1 micro-batches
    per_rank = [list(SharesPretrainingSampler(60, 0, 2, r, plan)) for r in range(3)]
    assert [len(b) for b in per_rank] == [15, 10, 5]
    for it in range(5):  # each global batch: disjoint runs covering exactly its 12 samples, in rank order
        got = [i for r, n in zip(per_rank, (3, 2, 1)) for b in r[it * n:(it + 1) * n] for i in b]
        assert got == list(range(12 * it, 12 * (it + 1)))
    resumed = list(SharesPretrainingSampler(60, 24, 2, 1, plan))
    assert resumed == per_rank[1][4:]
    # Shares changed at a restart: the stream (which samples each iteration takes) is unchanged.
    other = IterationPlan(sched, [1, 1, 4])
    after = [list(SharesPretrainingSampler(60, 24, 2, r, other)) for r in range(3)]
    for it in range(3):
        got = sorted(i for r, n in zip(after, (1, 1, 4)) for b in r[it * n:(it + 1) * n] for i in b)
        assert got == list(range(24 + 12 * it, 36 + 12 * it))
    # A growing batch (ramp-up 4 -> 8 -> 12 over 24 samples): each iteration's batch is cut by the shares.
    ramp = IterationPlan(BatchSchedule(12, 1, 2, rampup=(4, 4, 24)), [3, 1])
    runs = [list(SharesPretrainingSampler(60, 0, 1, r, ramp)) for r in range(2)]
    consumed, pos = 0, [0, 0]
    while consumed + ramp.global_batch_size(consumed) <= 60:
        g, n = ramp.global_batch_size(consumed), ramp.counts(consumed)
        got = sorted(i for r in range(2) for b in runs[r][pos[r]:pos[r] + n[r]] for i in b)
        assert got == list(range(consumed, consumed + g)) and n == [3 * g // 4, g // 4], (consumed, g, n)
        pos, consumed = [pos[0] + n[0], pos[1] + n[1]], consumed + g
    assert pos == [len(runs[0]), len(runs[1])]
    # Equal shares keep Megatron's own sampler: the default stream is untouched.
    assert list(MegatronPretrainingSampler(60, 0, 2, 1, 3))[:2] == [[2, 3], [8, 9]]


def test_plan_weights_and_counts():
    plan = IterationPlan(BatchSchedule(8, 1, 2), [3, 1])
    assert plan.counts(0) == [6, 2] and plan.loss_divisor(0, 1) == 8 and plan.grad_divisor == 1
    assert plan.first_sample(16, 1) == 22
    equal = IterationPlan(BatchSchedule(8, 1, 2))
    assert equal.counts(0) == [4, 4] and equal.loss_divisor(0, 1) == 4 and equal.grad_divisor == 2
    assert balanced_counts([1.0, 3.0], 8) == [6, 2]
    assert balanced_counts([1.0, 1.0, 1.0], 8) == [3, 3, 2]  # ties: the lower rank first
    assert balanced_counts([1.0, 9.0], 8, unit=2) == [6, 2]  # interleaved: whole units, one each at least
    ramp = IterationPlan(BatchSchedule(16, 1, 2, rampup=(8, 8, 16)), [3, 1])
    assert ramp.counts(0) == [6, 2] and ramp.counts(100) == [12, 4]


@pytest.mark.parametrize("argv, message", [
    (shares(1, 1, 1), "gives 3 shares for data-parallel size 2"),
    (shares(2, 0), "every share must be a positive integer"),
    (shares(2, -1), "every share must be a positive integer"),
    (("--data-parallel-shares", "2,x"), "one positive integer per data-parallel rank"),
    (shares(2, 1) + ("--global-batch-size", "8"), "is not a positive whole number of --micro-batch-size 1"),
    (shares(4, 1) + ("--global-batch-size", "5", "--micro-batch-size", "2"), "1 samples for DP rank 1"),
    (shares(3, 1) + ("--global-batch-size", "8", "--eval-global-batch-size", "6"), "(--eval-global-batch-size)"),
    (("--data-parallel-shares", "auto", "--global-batch-size", "7"), "profiles at equal shares first"),
    (("--data-parallel-shares", "auto", "--rampup-batch-size", "2", "2", "8"), "does not compose with"),
    (("--pipeline-model-parallel-size", "2", LAYOUT, "Et|t|tL"), "has 3 stages, not a multiple of"),
    (("--pipeline-model-parallel-size", "2", LAYOUT, "Ettt|tL"), "places 4 transformer layers (t) but --num-layers"),
    (("--pipeline-model-parallel-size", "2", LAYOUT, "Et|tmL"), "places 1 multi-token prediction layers (m) but "
                                                                 "--mtp-num-layers is 0"),
    (("--pipeline-model-parallel-size", "2", LAYOUT, "Et|tm|L", "--mtp-num-layers", "1"), "no standalone MTP stage"),
    (("--pipeline-model-parallel-size", "2", LAYOUT, "t|EtL"), "the embedding E must appear once"),
    (("--pipeline-model-parallel-size", "2", LAYOUT, "Et|t", "--decoder-first-pipeline-num-layers", "1"),
     "leave out --decoder-first/last"),
    (("--pipeline-model-parallel-size", "2", LAYOUT, "Et|tL", "--num-virtual-stages-per-pipeline-rank", "2"),
     "--num-virtual-stages-per-pipeline-rank and --account-for"),
    (("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--account-for-embedding-in-pipeline-split"), "--num-layers 2 + 1 (embedding) = 3 is not divisible"),
    (("--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
      "--global-batch-size", "9", "--microbatch-group-size-per-virtual-pipeline-stage", "4"),
     "leave a last group of 1, fewer than"),
    (("--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
      "--global-batch-size", "3", "--microbatch-group-size-per-virtual-pipeline-stage", "4"),
     "must lie in [PP=2, micro-batches=3]"),
    (("--hierarchical-grad-reduce", "--use-distributed-optimizer"),
     "the distributed optimizer's reduce-scatter is flat"),
    (("--grad-compression", "topk", "--use-distributed-optimizer"),
     "does not compose with --use-distributed-optimizer"),
    (("--grad-compression", "powersgd", "--grad-compression-ratio", "0"), "must be in (0, 1]"),
    (("--grad-compression", "gzip"), "invalid choice"),
    (("--grad-compression", "topk", "--fp16"), "does not compose with --fp16's loss scaling"),
])
def test_bad_shares_and_layouts_fail_in_one_line(argv, message):
    from megalite.cli.parser import _parse
    base = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
            "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "2", "--mock-data"]
    with pytest.raises(ConfigError) as e:
        _parse(base + list(argv), world_size=2)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_shares_with_a_tunable_interleaving_group_are_checked_per_rank():
    """Shares 3,1 of 20 samples at PP2 interleaved in groups of 5: ranks get 15 and 5 micro-batches,
    both whole groups (the check is per share, not on an equal split)."""
    from megalite.cli.parser import _parse
    argv = ["--num-layers", "4", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
            "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "2", "--mock-data", "--global-batch-size", "20",
            "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
            "--microbatch-group-size-per-virtual-pipeline-stage", "5"] + list(shares(3, 1))
    args = _parse(argv, world_size=4)
    assert args.data_parallel_shares == [3, 1] and args.virtual_pipeline_model_parallel_size == 2


def test_shares_parse():
    assert parse_shares(None, 2) is None and parse_shares("AUTO", 3) == "auto"
    assert parse_shares("4,2,2", 3) == [4, 2, 2] and parse_shares("3 1", 2) == [3, 1]


def test_lossy_compression_starts_when_asked_learns_and_keeps_replicas_identical(runs):
    """topk 5% from iteration 4: steps 1-3 are the single process's; afterwards the update is
    lossy but every replica applies the same one (the run stops if their weights differ in a
    bit, HASH) and the model still learns. PowerSGD at TP2 x DP2 likewise."""
    late, power = COMPRESSED[1], COMPRESSED[2]
    ref = reference(late)
    for r in runs[late.name]:
        assert max(abs(a - b) / b for a, b in zip(r["losses"][:4], ref["losses"][:4])) <= 1e-5
        assert r["losses"][4:] != ref["losses"][4:], "compression from iteration 4 changed nothing"
        assert rel_err(r["grads"]["decoder.layers.0.mlp.linear_fc1.weight"],
                       ref["grads"]["decoder.layers.0.mlp.linear_fc1.weight"]) <= 1e-5
    for r in runs[power.name]:
        print(f"\npowersgd losses {[round(x, 3) for x in r['losses']]}, "
              f"reference {[round(x, 3) for x in ref['losses']]}")
        assert r["losses"][0] - r["losses"][-1] >= 0.3, r["losses"]
        assert r["grads"]["decoder.layers.0.mlp.linear_fc1.weight"].shape == \
            ref["grads"]["decoder.layers.0.mlp.linear_fc1.weight"].shape


@pytest.fixture()
def one_rank_group():
    import torch.distributed as dist
    from dist_util import free_port
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class _FakeBucket:
    def __init__(self, grads, group):
        self.params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(self.params, grads):
            p.main_grad = g
        self.data, self.group, self.index = (grads[0] if len(grads) == 1 else None), group, 0


def test_topk_sends_the_largest_and_feeds_the_rest_back(one_rank_group):
    from megalite.distributed.grad_compression import TopK
    topk = TopK(0.25, 0)
    g1 = torch.tensor([4.0, -3.0, 0.5, 0.25, 1.0, -2.0, 0.1, 0.2])
    sent, b = [], _FakeBucket([torch.zeros(8)], one_rank_group)
    for g in (g1, torch.zeros(8)):  # one bucket, two iterations
        b.data.copy_(g)
        topk.reduce(b)
        sent.append(b.data.clone())
    assert torch.equal(sent[0], torch.tensor([4.0, -3.0, 0, 0, 0, 0, 0, 0]))
    assert torch.equal(sent[1], torch.tensor([0, 0, 0, 0, 1.0, -2.0, 0, 0]))  # the error, largest first
    assert torch.equal(sent[0] + sent[1] + topk.error[id(b)], g1)  # nothing lost


def test_powersgd_is_exact_on_low_rank_and_keeps_the_error(one_rank_group):
    from megalite.distributed.grad_compression import PowerSGD, powersgd_rank
    gen = torch.Generator().manual_seed(0)
    u, v = torch.randn(40, 1, generator=gen), torch.randn(1, 30, generator=gen)
    assert powersgd_rank(40, 30, 0.03) == 1 and powersgd_rank(2, 2, 0.5) == 0  # too small to save anything
    low = u @ v
    full = torch.randn(40, 30, generator=gen)
    psgd = PowerSGD(0.03, 0, 1)
    b = _FakeBucket([low.clone(), full.clone(), torch.randn(7, generator=gen)], one_rank_group)
    vec = b.params[2].main_grad.clone()
    psgd.reduce(b)
    assert rel_err(b.params[0].main_grad, low) <= 1e-5  # rank 1 reproduces a rank-1 gradient
    assert torch.equal(b.params[2].main_grad, vec)  # vectors are all-reduced whole
    approx = b.params[1].main_grad
    assert rel_err(approx + psgd.error[(id(b), 1)], full) <= 1e-6  # error feedback keeps the rest
    assert rel_err(approx, full) > 0.5  # a random matrix is far from rank 1


def _uneven_nodes():
    from megalite import parallel_state as ps
    try:
        ps.initialize_model_parallel(1, 1, ranks_per_node=2)  # 3 DP ranks over nodes of 2: 2 + 1
    except ValueError as e:
        return str(e)
    return None


def test_hierarchical_reduction_refuses_uneven_nodes():
    from dist_util import run_on_ranks
    messages = run_on_ranks(_uneven_nodes, 3)
    assert all(m is not None and "spread unevenly over nodes of 2 ranks ([2, 1] per node)" in m and "\n" not in m
               for m in messages), messages
