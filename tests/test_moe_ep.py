"""Expert parallelism (MoE experts split over ranks) through pretrain(), and its token dispatchers.

One spawn of 4 CPU ranks runs every check: the dispatchers alone (identity experts give back
their input exactly, token counts conserved, zero-token experts), parity layouts against the
single process (tests/support/parity.py: losses with the aux and z losses, every gradient before
clipping including routers and experts, grad norms, parameters after 6 steps, at DESIGN's fp32
bound 1e-5), faults the checks must catch, and a checkpoint saved at EP2 that is continued
exactly and re-saved bit for bit at EP4, EP1 and one process.
"""

import os

import pytest
import torch

import pretrain_gpt
from dist_util import OTHER_CAPABILITY, start_on_ranks
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.checkpoint.convert import Reader, find_checkpoint
from megalite.distributed import param_facts
from megalite.moe import experts as experts_module
from megalite.moe.dispatcher import TokenDispatcher
from megalite.training import pretrain
from parity import (BASE, MB2, MOE, MOE_BIAS, SINKHORN, layout, learnable_datasets, logged_by_reference, moe_collect,
                    patched, record_logged, reference, train)
from parity_check import assert_logged_as, assert_parity, mismatches


SHARED = ("--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate")
# SINKHORN (parity.py): under SP the Sinkhorn column sums span the TP ranks' tokens


def ep(n, kind="allgather"):
    return ("--expert-model-parallel-size", str(n), "--moe-token-dispatcher-type", kind)


# -- faults (module level: applied inside the spawned ranks) -----------------------------------
def expert_grads_over_dense_dp():
    """Expert buckets reduced over DP x CP (the dense group) instead of expert-DP."""
    from megalite.distributed import grad_buffer

    def dense(p):
        return (ps.get_data_parallel_group(with_context_parallel=True),
                ps.get_data_parallel_world_size(with_context_parallel=True),
                ps.get_data_parallel_rank(with_context_parallel=True))
    return patched(grad_buffer, "data_parallel", dense)


def expert_norm_counted_twice():
    """The experts' squared norms also summed over their expert-DP replicas (unsharded)."""
    from megalite.optimizer import clip_grads
    original = param_facts.sum_over_model

    def twice(dense, expert, sharded, grid=None):
        return original(dense, expert, True, grid)
    return patched(clip_grads, "sum_over_model", twice)


def local_expert_names():
    """Experts keyed by their local index: every EP rank's first expert is "0"."""
    return patched(experts_module, "expert_key", lambda first, i: str(i))


LAYOUTS = [
    layout("ep4_alltoall", dp=4, model=MB2 + MOE, flags=ep(4, "alltoall")),
    layout("ep2_dp4_zero2_expert_bias", dp=4, zero=2, model=MB2 + MOE + MOE_BIAS, flags=ep(2)),
    # DeepSeek-V3's router: sigmoid, expert bias, group-limited (2 groups of 2; each token's 2 from its best group)
    layout("ep2_dp4_alltoall_expert_bias_groups", dp=4, model=MB2 + MOE + MOE_BIAS + (
        "--moe-router-num-groups", "2", "--moe-router-group-topk", "1"), flags=ep(2, "alltoall")),
    layout("ep2_dp4_replica_check_params_norm", dp=4, model=MB2 + MOE, flags=ep(2, "alltoall") + (
        "--check-weight-hash-across-dp-replicas-interval", "1", "--log-params-norm")),
    layout("ep2_pp2_alltoall_expert_bias_recompute", pp=2, dp=2, recompute="full", model=MB2 + MOE + MOE_BIAS,
           flags=ep(2, "alltoall"), fault=record_logged),
    # sequence parallelism: each TP rank routes its own tokens; experts whole (expert-TP 1) or TP-sharded
    layout("ep2_tp2_sp_etp1_alltoall_seq_aux", tp=2, sp=True, dp=2, model=MB2 + MOE + (
        "--moe-router-load-balancing-type", "seq_aux_loss"), flags=ep(2, "alltoall") + (
        "--expert-tensor-parallel-size", "1"), fault=record_logged),
    layout("ep2_tp2_sp_etp2_alltoall_shared_gate", tp=2, sp=True, dp=2, model=MB2 + MOE + SHARED,
           flags=ep(2, "alltoall"), fault=record_logged),
    layout("ep2_tp2_sp_etp2_allgather_zero2", tp=2, sp=True, dp=2, zero=2, model=MB2 + MOE, flags=ep(2)),
    # (one sample per micro-batch: tests/test_cp_moe_mla.py says why)
    layout("ep2_tp2_sp_sinkhorn", tp=2, sp=True, dp=2, model=SINKHORN, flags=ep(2, "alltoall")),
    layout("ep2_dp4_zero3_recompute_capacity", dp=4, zero=3, recompute="full", flags=ep(2), model=MB2 + MOE + (
        "--moe-expert-capacity-factor", "1.0", "--moe-shared-expert-intermediate-size", "32")),
]
FAULTS = [
    layout("fault_expert_grads_over_dense_dp", dp=4, model=MB2 + MOE, flags=ep(2), fault=expert_grads_over_dense_dp),
    layout("fault_expert_norm_twice", dp=4, model=MB2 + MOE, flags=ep(2), fault=expert_norm_counted_twice),
]


# -- the dispatchers alone ---------------------------------------------------------------------
def _dispatch_checks():
    """Per (EP, dispatcher): this rank's tokens through identity experts (probabilities 0.5 on
    each of the k = 2 chosen experts, so the combine is exact), the rows each local expert got,
    and the gradients of sum(out · G)."""
    out = {}
    num_experts, tokens, h = 8, 6, 5
    for size in (2, 4):
        for kind in ("allgather", "alltoall"):
            ps.initialize_model_parallel(1, 1, expert_model_parallel_size=size)
            try:
                g = torch.Generator().manual_seed(ps.global_rank())
                x = torch.randn(tokens, h, dtype=torch.float64, generator=g).requires_grad_(True)
                # experts 0..6 only: expert 7 gets no token anywhere
                chosen = torch.stack([torch.randperm(num_experts - 1, generator=g)[:2] for _ in range(tokens)])
                routing = torch.zeros(tokens, num_experts, dtype=torch.bool).scatter(1, chosen, True)
                probs = (routing.double() * 0.5).requires_grad_(True)
                d = TokenDispatcher(num_experts, kind)
                rows, counts = d.dispatch(x, probs, routing)
                y = d.combine(rows)  # identity experts
                grad_out = torch.randn(tokens, h, dtype=torch.float64, generator=g)
                (y * grad_out).sum().backward()
                out[(size, kind)] = {"x": x.detach(), "y": y.detach(), "routing": routing, "counts": counts,
                                     "first": d.first, "rows": rows.shape[0], "grad_out": grad_out,
                                     "grad_x": x.grad, "grad_probs": probs.grad}
            finally:
                ps.destroy_model_parallel()
    return out


SOURCES = [(1, 2, None), (2, 2, 1), (2, 2, 2), (2, 1, 1)]  # (TP, EP, ETP): ETP 1 at EP2 pairs TP peers as EP peers


def _source_checks():
    """Per (TP, EP, ETP, dispatcher): each dispatched row's micro-batch index from sources() against the data rank
    its token carries (column 0), or the error where a micro-batch's tokens do not all reach its experts."""
    out = {}
    for tp, size, etp in SOURCES:
        for kind in ("allgather", "alltoall"):
            ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=size, expert_tensor_parallel_size=etp)
            try:
                g = torch.Generator().manual_seed(ps.global_rank())
                x = torch.randn(6, 5, generator=g)
                x[:, 0] = ps.current_grid().data_rank()
                routing = torch.zeros(6, 8, dtype=torch.bool).scatter(
                    1, torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(6)]), True)
                d = TokenDispatcher(8, kind)
                rows, _ = d.dispatch(x, routing.float() * 0.5, routing)
                try:
                    index, count = d.sources()
                    out[(tp, size, etp, kind)] = (rows[:, 0].long(), index, count)
                except ValueError as e:
                    out[(tp, size, etp, kind)] = str(e)
            finally:
                ps.destroy_model_parallel()
    return out


def _pretrain(argv):
    args = parse_args(list(BASE) + list(MB2) + list(MOE) + list(MOE_BIAS) + list(argv),
                      world_size=max(1, ps.world_size()))
    try:
        return pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
    finally:
        ps.destroy_model_parallel()


# with MB2 + MOE + MOE_BIAS: ep2_dp4_zero2_expert_bias
EP2 = ("--use-distributed-optimizer", "--zero-stage", "2") + ep(2)
STOP = ("--train-iters", "3", "--use-checkpoint-opt_param-scheduler")  # load, train nothing, save here


def _world(root, decided, part):
    """part 0: the dispatchers and every other layout; part 1: the rest and the checkpoints (two worlds
    side by side keep both cores busy)."""
    lays = (LAYOUTS + FAULTS)[part::2]
    out = {lay.name: train(lay, moe_collect, decided[lay.name]) for lay in lays}
    if part == 0:
        out["dispatch"] = _dispatch_checks()
        out["sources"] = _source_checks()
        return out
    a, b, c, f = (os.path.join(root, n) for n in ("a", "b", "c", "f"))
    out["first"] = _pretrain(list(EP2) + ["--save", a, "--exit-interval", "3"])
    out["resumed"] = _pretrain(list(EP2) + ["--load", a])
    _pretrain(list(ep(4, "alltoall")) + ["--load", a, "--save", b, *STOP])  # plain optimizer, EP4
    _pretrain(["--use-distributed-optimizer", "--load", a, "--save", c, *STOP])  # EP1, ZeRO-1
    try:  # a save or a load that fails exits through SystemExit
        with local_expert_names():
            _pretrain(list(EP2) + ["--save", f, "--exit-interval", "3"])
        _pretrain(["--load", f, "--save", os.path.join(root, "g"), *STOP])
        out["fault_load"] = "loaded"
    except BaseException as e:  # noqa: BLE001
        out["fault_load"] = f"raised: {type(e).__name__}"
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe_ep"))
    decided = {lay.name: reference(lay)["decided"] for lay in LAYOUTS + FAULTS}  # (tests/support/decision_replay.py)
    parts = [start_on_ranks(_world, 4, root, decided, part, timeout=480, capability=OTHER_CAPABILITY)
             for part in (0, 1)]
    ranks = [{**a, **b} for a, b in zip(*(w.result() for w in parts))]
    return root, {k: [r[k] for r in ranks] for k in ranks[0]}


@pytest.mark.parametrize("size,kind", [(2, "allgather"), (2, "alltoall"), (4, "allgather"), (4, "alltoall")])
def test_dispatchers_return_the_input_and_conserve_tokens(world, size, kind):
    ranks = [r[(size, kind)] for r in world[1]["dispatch"]]
    for r in ranks:
        # identity experts, probabilities 0.5 + 0.5: x exactly; d/dx = G exactly; d/dp_te = <G_t, x_t>
        assert torch.equal(r["y"], r["x"]), (size, kind)
        assert torch.equal(r["grad_x"], r["grad_out"])
        want = (r["grad_out"] * r["x"]).sum(1, keepdim=True) * r["routing"]
        assert torch.allclose(r["grad_probs"], want, rtol=1e-12, atol=0), "h = 5 products summed in another order"
    for i in range(4):  # each EP group (ranks of one expert-DP index) routes among itself
        group = [ranks[j] for j in range(4) if j // size == i // size]
        total = sum(g["routing"].sum(0) for g in group)  # tokens per global expert over the EP group
        r = ranks[i]
        assert r["counts"] == total[r["first"]:r["first"] + 8 // size].tolist(), (size, kind, i)
        assert r["rows"] == sum(r["counts"])
    every = sum(sum(r["counts"]) for r in ranks) // (4 // size)  # counts sum to tokens x k per EP group
    assert every == 4 * 6 * 2 // (4 // size)
    assert ranks[-1]["counts"][-1] == 0  # expert 7 had no token and still ran


@pytest.mark.parametrize("tp,size,etp", SOURCES)
def test_fp8_experts_know_each_rows_micro_batch(world, tp, size, etp):
    """FP8 experts scale each micro-batch's rows apart (megalite/moe/experts.py): the dispatcher names each row's
    micro-batch by its sender's data rank, ranks sharing one (TP peers under SP) merged, in data-rank order; where
    an expert would see only part of a micro-batch's tokens (TP2 + SP at EP1, ETP1), one line says so."""
    for kind in ("allgather", "alltoall"):
        for r in world[1]["sources"]:
            got = r[(tp, size, etp, kind)]
            if (tp, size) == (2, 1):
                assert got.startswith("FP8 MoE experts: an expert gets the tokens of 1 of the 2 TP x CP ranks"), got
                continue
            data_rank, index, count = got
            # TP2 x EP2 at ETP1: the EP peers are one micro-batch's TP peers; at ETP2 an expert sees two micro-batches
            assert count == {(1, 2, None): 2, (2, 2, 1): 1, (2, 2, 2): 2}[(tp, size, etp)], (kind, count)
            assert torch.equal(index, torch.searchsorted(torch.unique(data_rank), data_rank)), (kind, tp, size, etp)
            assert torch.unique(data_rank).numel() == count, (kind, data_rank)


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.name)
def test_expert_parallel_matches_single_process(world, lay):
    assert_parity(lay, world[1][lay.name])


def test_expert_bias_counts_each_training_token_once(world):
    """Each step's counts, summed over the batch: 8 sequences x 16 tokens x k = 2 per MoE layer, under
    full recompute (whose first forward has no gradient) and pipelining; the single process agrees."""
    lay = LAYOUTS[[x.name for x in LAYOUTS].index("ep2_pp2_alltoall_expert_bias_recompute")]
    for r in world[1][lay.name]:
        counts = r["collected"]["counts"]
        assert len(counts) == 2 and all(sum(c) == 8 * 16 * 2 for c in counts), counts  # 2 layers per stage
        assert any(c != counts[0][0] for c in counts[0]), counts  # not all equal: the bias has work
    ref = reference(lay)
    assert any(n.endswith("router.expert_bias") for n in ref["params"])
    for name, t in ref["params"].items():  # ±rate per step towards the mean: a multiple of 1e-2 in 6 steps
        if name.endswith("router.expert_bias"):
            assert t.abs().max() <= 6 * 1e-2 + 1e-6 and (t != 0).any(), (name, t)


@pytest.mark.parametrize("name", ["ep2_tp2_sp_etp1_alltoall_seq_aux", "ep2_tp2_sp_etp2_alltoall_shared_gate",
                                  "ep2_pp2_alltoall_expert_bias_recompute"])
def test_logged_router_losses_do_not_change_with_tp_pp_and_ep(world, name):
    """The log line's load_balancing_loss and z_loss at TP2 + SP x EP2 (each TP rank routes a part of each
    micro-batch) and at PP2 x EP2 (each stage holds one of the two MoE layers; recompute runs each
    router twice) equal the single process's every step, within the fp32 bound (sums in another order),
    on the ranks that print the log line (the last pipeline stage)."""
    lay = LAYOUTS[[x.name for x in LAYOUTS].index(name)]
    want = logged_by_reference(lay)
    assert len(want) == 6 and set(want[0]) == {"load_balancing_loss", "z_loss"}, want
    last_stage = max(r["coords"][1] for r in world[1][name])
    assert_logged_as(want, [r for r in world[1][name] if r["coords"][1] == last_stage], name)


@pytest.mark.parametrize("lay", FAULTS, ids=lambda lay: lay.name)
def test_faults_are_caught(world, lay):
    assert mismatches(lay, world[1][lay.name], reference(lay)), f"{lay.name} went unseen"


def _tensors(root):
    rd = Reader(find_checkpoint(root)[0])
    return {n: rd.get(n) for n in rd.names()}


def test_ep_checkpoint_resumes_exactly_and_moves_between_ep_sizes(world, tmp_path):
    """Saved at EP2 ZeRO-2 over DP4 with an expert bias (a): continued at EP2, bit for bit the
    uninterrupted run's losses (the bias is saved); loaded and saved again at EP4 (plain optimizer), EP1 ZeRO-1 and
    one process: every
    expert weight and Adam state under its global index, bit for bit. Saved with experts named by
    their local index, the checkpoint cannot be read as the model it was."""
    root, w = world
    straight = w["ep2_dp4_zero2_expert_bias"][-1]["losses"]  # the same flags, uninterrupted
    assert w["first"][-1] == straight[:3] and w["resumed"][-1] == straight[3:], (straight, w["first"], w["resumed"])
    d = str(tmp_path / "d")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _pretrain(["--load", os.path.join(root, "a"), "--save", d, *STOP])
    finally:
        torch.set_num_threads(threads)
    ref = _tensors(os.path.join(root, "a"))
    experts = [n for n in ref if ".local_experts.3." in n]
    assert any(n.startswith("optimizer.exp_avg_sq.") for n in experts) and len(ref) > 40, sorted(ref)[:10]
    for name, path in (("EP4", os.path.join(root, "b")), ("EP1 ZeRO-1", os.path.join(root, "c")), ("one process", d)):
        got = _tensors(path)
        assert sorted(got) == sorted(ref), name
        for n, t in ref.items():
            assert torch.equal(got[n], t), f"{name}: {n} changed"
    assert all(r.startswith("raised") for r in w["fault_load"]), w["fault_load"]
