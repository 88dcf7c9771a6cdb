"""Zero-bubble pipelines (--pipeline-schedule zb-h1 | zbv, megalite/pipeline/zero_bubble.py): every plan runs (the
checker over every schedule, p <= 8, m <= 24, and broken plans it must refuse), its bubble is the paper's, and a
split-backward run reproduces the single process (tests/support/parity.py) at PP2 and PP4, with TP + SP, DP with
ZeRO-1/2, tied and untied embeddings, MoE experts over EP, CP, full and selective recompute, bf16, fp16, MTP,
explicit layouts and micro-batch counts that are not a multiple of the stages (FP8: tests/test_fp8.py); ZB-V's two
chunks per rank sit in a V (megalite/parallel/pipeline_stages.py). A reduction fired at B instead of the last W, a
lost weight gradient, the V's tied copies left unsummed and its layers placed as the loop must be caught. One
spawn of four ranks runs the layouts; test_checkpoint.py moves checkpoints between the V and the loop."""

import contextlib

import pytest

from megalite.cli.parser import parse_args
from megalite.pipeline.zero_bubble import B, F, W, Action, PlanError, check_plan, make_plan, one_f_one_b_order
from parity import EIGHT_LAYERS, LLAMA, MB2, MOE, layout, patched, reference, run_layouts
from parity_check import assert_parity, mismatches

ZB = ("--pipeline-schedule", "zb-h1")
ZBV = ("--pipeline-schedule", "zbv")


# -- the plans -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv"])
def test_every_plan_up_to_8_stages_and_24_micro_batches_runs(schedule):
    v = 2 if schedule == "zbv" else 1
    for p in range(1, 9):
        for m in range(1, 25):
            plan = make_plan(schedule, p, m)  # (make_plan checks it: PlanError otherwise)
            assert all(len(acts) == 3 * m * v for acts in plan.actions), (p, m)
            for r in range(p):  # (in chunk-activations: the V's are half a stage's)
                assert plan.most_alive(r) <= v * min(p, m), (schedule, p, m, r)
                if schedule == "1f1b":
                    assert plan.most_alive(r) == min(p - r, m), (p, m, r)


def test_zbv_has_almost_no_bubble():
    """Unit costs per chunk (F = B = W = 1, a stage's costs halved): once m >= p the V's step at p = 2 and 4 is the
    least possible, 6m + p - 1 (the rank at the V's turning point waits p - 1 for its first input, and is never
    idle after), at other p <= 8 within p / 2 units of it; in a stage's time units never longer than ZB-H1's."""
    for p in range(2, 9):
        for m in range(1, 25):
            zbv, zb = make_plan("zbv", p, m).makespan, make_plan("zb-h1", p, m).makespan
            assert zbv / 2 <= zb, (p, m, zbv, zb)
            if m >= p and p in (2, 4):
                assert zbv == 6 * m + p - 1, (p, m, zbv)
            if m >= p:
                assert zbv <= 6 * m + p - 1 + p // 2, (p, m, zbv)
    assert round(make_plan("zbv", 4, 8).idle_fraction(0), 4) == round(3 / 51, 4)


def test_bubbles_are_the_papers():
    """Unit costs F = B = W = 1: 1F1B's step is (m + p - 1)(F + B + W); ZB-H1's 3m + (p - 1) once m >= p (its
    bubble (p - 1)(F + B - W), a third of 1F1B's), and never longer than 1F1B's."""
    for p in range(2, 9):
        for m in range(1, 25):
            one, zb = make_plan("1f1b", p, m).makespan, make_plan("zb-h1", p, m).makespan
            assert one == 3 * (m + p - 1), (p, m, one)
            assert zb <= one, (p, m, zb, one)
            if m >= p:
                assert zb == 3 * m + p - 1, (p, m, zb)
    assert round(make_plan("1f1b", 4, 8).idle_fraction(0), 4) == round(3 / 11, 4)
    assert round(make_plan("zb-h1", 4, 8).idle_fraction(0), 4) == round(3 / 27, 4)


def _good(p=2, m=3, schedule="zb-h1"):
    return [list(acts) for acts in make_plan(schedule, p, m).actions]


def _without(acts, op, mb):
    return [a for a in acts if (a.op, a.mb) != (op, mb)]


@pytest.mark.parametrize("broken,says", [
    (lambda ranks: [ranks[0], _without(ranks[1], W, 2)], "rank 1 never runs W2"),
    (lambda ranks: [ranks[0] + [Action(W, 0, 1)], ranks[1]], "rank 0 runs W1 twice"),
    (lambda ranks: [[Action(W, 0, 0)] + _without(ranks[0], W, 0), ranks[1]], "rank 0 runs W0 before its B"),
    (lambda ranks: [ranks[0], [Action(F, 0, 1), Action(F, 0, 0)] + ranks[1][2:]],
     "rank 1 runs F0 after F1: each chunk's F's in micro-batch order"),
    # rank 0 sends F1's activation only after B0, which waits for rank 1's B0, which waits for that activation
    (lambda ranks: [[Action(F, 0, 0), Action(B, 0, 0), Action(F, 0, 1), Action(B, 0, 1), Action(W, 0, 0),
                     Action(W, 0, 1)],
                    [Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 0), Action(B, 0, 1), Action(W, 0, 0),
                     Action(W, 0, 1)]], "rank 0 waits for ever at B0"),
])
def test_broken_plans_are_refused_naming_the_rank(broken, says):
    m = 2 if "for ever" in says else 3
    ranks = broken(_good(m=m))
    with pytest.raises(PlanError, match=says.replace("(", r"\(")):
        check_plan([tuple(acts) for acts in ranks], m)


def test_broken_v_plans_are_refused_naming_the_chunk():
    from megalite.parallel.pipeline_stages import PipelineStages
    st = PipelineStages(2, 2, "v")
    ranks = _good(m=2, schedule="zbv")
    check_plan([tuple(acts) for acts in ranks], 2, st)
    lost = [ranks[0], [a for a in ranks[1] if (a.op, a.chunk, a.mb) != (W, 1, 0)]]
    with pytest.raises(PlanError, match="rank 1 never runs W0c1"):
        check_plan([tuple(acts) for acts in lost], 2, st)
    # rank 0 (the V's turning point) runs stage 2's forward before stage 1's: its input is never made before
    swapped = [[Action(F, 1, 0)] + [a for a in ranks[0] if a != Action(F, 1, 0)], ranks[1]]
    with pytest.raises(PlanError, match="rank 0 waits for ever at F0c1"):
        check_plan([tuple(acts) for acts in swapped], 2, st)


def test_one_f_one_b_plan_keeps_megatrons_order():
    for p, m in ((2, 4), (4, 8), (4, 3)):
        for r in range(p):
            fb = [a for a in make_plan("1f1b", p, m).actions[r] if a.op != W]
            assert fb == one_f_one_b_order(p, m, r), (p, m, r)


# -- the command line ----------------------------------------------------------------------------------------
ARGV = "--mock-data --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 8 --micro-batch-size 1 " \
       "--global-batch-size 4 --train-iters 1 --lr 1e-3 --pipeline-model-parallel-size 2"


def test_delay_wgrad_compute_is_zb_h1():
    assert parse_args(ARGV.split() + ["--delay-wgrad-compute"], world_size=2).pipeline_schedule == "zb-h1"
    assert parse_args(ARGV.split(), world_size=2).pipeline_schedule == "1f1b"
    vp = ARGV.split() + ["--num-layers-per-virtual-pipeline-stage", "1"]
    assert parse_args(vp, world_size=2).pipeline_schedule == "interleaved"


def test_zbv_runs_two_chunks_per_rank_at_any_micro_batch_count():
    args = parse_args(ARGV.split() + list(ZBV) + ["--global-batch-size", "3"], world_size=2)
    assert (args.pipeline_schedule, args.virtual_pipeline_model_parallel_size) == ("zbv", 2)
    layout = ARGV.split() + list(ZBV) + ["--pipeline-model-parallel-layout", "Ett|t||tL"]
    assert parse_args(layout, world_size=2).pipeline_layout == (2, 1, 0, 1)


@pytest.mark.parametrize("extra,says", [
    ("--pipeline-schedule zbv --num-layers 6", "--pipeline-schedule zbv cuts the model into 2 x "
     "--pipeline-model-parallel-size 2 = 4 stages: --num-layers 6 does not divide evenly"),
    ("--pipeline-schedule zbv --num-virtual-stages-per-pipeline-rank 4 --num-layers 8",
     "--pipeline-schedule zbv runs two model chunks per rank (its V), not 4"),
    ("--pipeline-schedule zbv --decoder-first-pipeline-num-layers 1",
     "--pipeline-schedule zbv with --decoder-first/last-pipeline-num-layers: its V puts the first and the last"),
    ("--pipeline-schedule zbv --pipeline-model-parallel-size 1",
     "--pipeline-schedule zbv fills a pipeline's bubble: it needs --pipeline-model-parallel-size > 1"),
    ("--pipeline-schedule interleaved", "--pipeline-schedule interleaved needs virtual stages"),
    ("--pipeline-schedule zb-h1 --num-layers-per-virtual-pipeline-stage 1",
     "--pipeline-schedule zb-h1 runs one model chunk per rank"),
    ("--pipeline-schedule zb-h1 --pipeline-model-parallel-size 1",
     "--pipeline-schedule zb-h1 fills a pipeline's bubble: it needs --pipeline-model-parallel-size > 1"),
    ("--delay-wgrad-compute --pipeline-schedule 1f1b", "--delay-wgrad-compute is --pipeline-schedule zb-h1's split"),
    ("--delay-wgrad-compute --pipeline-model-parallel-layout auto",
     "--delay-wgrad-compute with --pipeline-model-parallel-layout auto is not built yet"),
])
def test_schedule_refusals_are_one_line(capsys, extra, says):
    with pytest.raises(SystemExit) as e:
        parse_args(ARGV.split() + extra.split(), world_size=2)
    assert e.value.code != 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and says in err[0], err


# -- parity ----------------------------------------------------------------------------------------------------
def reduction_at_last_b():
    """The DP reduction enabled at the last micro-batch's B (as 1F1B's backward does) instead of at its W: the
    buckets start before the last weight gradients reach them."""
    from megalite.pipeline.run import Run
    original = Run.backward_input

    def early(self, chunk, *a):
        if self.bwd_mb[chunk] == self.m - 1 and hasattr(self.chunks[chunk], "sync_enabled"):
            self.chunks[chunk].sync_enabled = True
        return original(self, chunk, *a)
    return patched(Run, "backward_input", early)


def weight_gradients_lost():
    """A store that loses the first micro-batch's deferred weight gradients."""
    from megalite.pipeline.wgrad import WeightGradStore
    original = WeightGradStore.run
    return patched(WeightGradStore, "run", lambda self, key: [] if key[1] == 0 else original(self, key))


UNTIED = ("--untie-embeddings-and-output-weights",)
LAYOUTS = [
    layout("pp4_zb_h1", pp=4, flags=ZB, model=EIGHT_LAYERS),
    layout("pp4_zb_h1_6_micro_batches_untied", pp=4, flags=ZB,
           model=EIGHT_LAYERS + UNTIED + ("--global-batch-size", "6")),
    layout("tp2_pp2_sp_zb_h1_llama", tp=2, pp=2, sp=True, flags=ZB, model=LLAMA),
    layout("pp2_dp2_zero2_zb_h1_tied", pp=2, dp=2, zero=2, flags=ZB),
    layout("pp2_cp2_zb_h1_selective_recompute", pp=2, cp=2, recompute="selective", flags=ZB, model=MB2),
    layout("pp2_dp2_ep2_moe_zb_h1_zero1", pp=2, dp=2, zero=1, model=MB2 + MOE,
           flags=ZB + ("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall")),
    layout("pp4_zbv", pp=4, flags=ZBV, model=EIGHT_LAYERS),
    layout("pp4_zbv_6_micro_batches_untied", pp=4, flags=ZBV,
           model=EIGHT_LAYERS + UNTIED + ("--global-batch-size", "6")),
    layout("tp2_pp2_sp_zbv_llama", tp=2, pp=2, sp=True, flags=ZBV, model=LLAMA),
    layout("pp2_dp2_zero2_zbv_tied", pp=2, dp=2, zero=2, flags=ZBV),
    layout("pp2_dp2_zbv_full_recompute", pp=2, dp=2, recompute="full", flags=ZBV),
    layout("pp2_dp2_zbv_bf16", pp=2, dp=2, dtype="bf16", flags=ZBV),
    layout("pp2_dp2_zbv_fp16_loss_scaling", pp=2, dp=2, dtype="fp16", flags=ZBV),
    layout("pp2_dp2_zbv_mtp", pp=2, dp=2, flags=ZBV,
           model=("--mtp-num-layers", "1", "--position-embedding-type", "rope")),
    layout("pp2_dp2_zbv_explicit_layout", pp=2, dp=2, model=EIGHT_LAYERS,
           flags=ZBV + ("--pipeline-model-parallel-layout", "Ettt|t|tt|ttL")),
    layout("pp2_dp2_ep2_moe_zbv_zero1", pp=2, dp=2, zero=1, model=MB2 + MOE,
           flags=ZBV + ("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall")),
]


def v_copies_unsummed():
    """The V's two copies of a tied embedding on one rank reduced only over the embedding group (the loop's
    rule), each left with its own chunk's gradient."""
    import torch.distributed as dist
    from megalite import parallel_state as ps
    from megalite.distributed import finalize

    def loop_rule(chunks):
        g = ps.grid_of(chunks)
        for m in chunks:
            m = m.module
            if g.rank in g.emb_ranks and getattr(m, "shares_embedding_across_stages", False) and \
                    (w := m.shared_embedding_or_output_weight()) is not None:
                dist.all_reduce(finalize._grad(w), group=g.emb_group)
    return patched(finalize, "allreduce_embedding_grads", loop_rule)


def v_layers_placed_as_the_loop():
    """The V's plan run over chunks that build the loop's layers (chunk j of rank r: stage j p + r)."""
    from megalite.parallel.grid import Grid
    return patched(Grid, "stage_of", lambda self, chunk, pp_rank=None:
                   chunk * self.pp + (self.pp_rank if pp_rank is None else pp_rank))


FAULTY = [layout("reduction_at_last_b@pp2_dp2_zb_h1", pp=2, dp=2, flags=ZB, fault=reduction_at_last_b),
          layout("weight_gradients_lost@pp2_dp2_zb_h1", pp=2, dp=2, flags=ZB, fault=weight_gradients_lost),
          layout("v_copies_unsummed@pp2_dp2_zbv", pp=2, dp=2, flags=ZBV, fault=v_copies_unsummed),
          layout("v_layers_placed_as_the_loop@pp2_dp2_zbv", pp=2, dp=2, flags=ZBV, fault=v_layers_placed_as_the_loop)]


@pytest.fixture(scope="module")
def four():
    lays = LAYOUTS + FAULTY
    return dict(zip((lay.name for lay in lays), run_layouts(lays, 4)))


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.name)
def test_zero_bubble_matches_single_process(four, lay):
    ranks = four[lay.name]
    assert_parity(lay, ranks)
    v = 2 if "zbv" in lay.name else 1
    assert_ran_the_plan(lay, ranks, "zbv" if v == 2 else "zb-h1", v, lambda pp, m: v * min(pp, m))


def assert_ran_the_plan(lay, ranks, schedule, v, most_alive):
    """Every stage ran `schedule`'s plan action for action (v chunks per rank; PP4 where the layout's name says),
    with at most most_alive(pp, m) chunk-activations alive."""
    pp = 4 if "pp4" in lay.name else 2
    for r in ranks:
        ran, stage = r["record"].schedule, r["coords"][1]
        m = len([op for op in ran.ops if op[0] == F]) // v
        want = [(a.op, a.chunk, a.mb) for a in make_plan(schedule, pp, m).actions[stage]]
        assert ran.ops == want, f"{lay.name} stage {stage}: {ran.ops}"
        assert ran.max_alive <= most_alive(pp, m), f"{lay.name} stage {stage}: {ran.max_alive} alive"


@pytest.mark.parametrize("lay", FAULTY, ids=lambda lay: lay.name)
def test_a_misplaced_or_lost_weight_gradient_is_caught(four, lay):
    found = mismatches(lay, four[lay.name], reference(lay))
    assert any("step-1 grad" in m for m in found), found[:5]


def _recomputed_split_backward(split):
    """A recomputed region (a linear layer and a norm, tensor_parallel's checkpoint) backward from y.sum(): under a
    split backward's B (split) or a plain one; the parameters' .grad right after B, the deferred (param, gradient)
    pairs, and the input's gradient."""
    import torch
    from megalite.pipeline.wgrad import WeightGradStore
    from megalite.tensor_parallel import checkpoint
    from megalite.tensor_parallel.deferred_wgrad import deferred_linear
    torch.manual_seed(0)
    store, norm = WeightGradStore(), torch.nn.LayerNorm(4)
    w = torch.nn.Parameter(torch.randn(3, 4))
    x = torch.randn(2, 4, requires_grad=True)
    y = checkpoint(lambda t: deferred_linear(norm(t), w, None, store if split else None), x,
                   wgrad_store=store if split else None)
    with store.collecting((0, 0)) if split else contextlib.nullcontext():
        y.square().sum().backward()
    at_b = {n: p.grad for n, p in (("norm.weight", norm.weight), ("norm.bias", norm.bias), ("w", w))}
    deferred = {n: g for p, g in store.run((0, 0))
                for n, q in (("norm.weight", norm.weight), ("norm.bias", norm.bias), ("w", w)) if p is q}
    return at_b, deferred, x.grad


def test_a_recomputed_regions_weight_gradients_wait_for_w():
    """Under full recompute the checkpoint's inner backward would accumulate its parameters' gradients at B (the
    DP hooks firing there, a deferred weight's with no gradient at all: the run crashes); given the split
    backward's store, its B hands them to the store instead."""
    import torch
    at_b, deferred, dx = _recomputed_split_backward(split=True)
    plain, _, plain_dx = _recomputed_split_backward(split=False)
    assert all(g is None for g in at_b.values()), {n: g is not None for n, g in at_b.items()}
    assert sorted(deferred) == sorted(plain), sorted(deferred)
    for n, g in deferred.items():
        torch.testing.assert_close(g, plain[n], rtol=0, atol=0, msg=n)
    torch.testing.assert_close(dx, plain_dx, rtol=0, atol=0)


# -- the planner ---------------------------------------------------------------------------------------------
def test_the_planner_prices_zb_h1s_bubble_and_activations():
    """Equal stages, communication free (as test_planner's bubble test): zb-h1 idles (p-1)/(3m+p-1) of the step
    (a third of 1F1B's bubble, F = B = W), and each stage holds the plan's micro-batches alive, p on every stage."""
    from megalite.cli.plan import validated
    from megalite.planner import cost
    from megalite.planner.gpus import parse_cluster
    from megalite.planner.layout import Layout
    gpt = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
           "--max-position-embeddings", "1024", "--micro-batch-size", "1", "--vocab-size", "128", "--lr", "1e-4",
           "--train-iters", "10", "--fp16"]
    c = parse_cluster("8xH100-80GB", intra_node_bandwidth=1e9)
    for pp, m in ((4, 4), (4, 16), (2, 8), (8, 8)):
        lay = Layout(1, pp, 1, 8 // pp, None, None, 0, None, 1, False)
        argv = gpt + ["--global-batch-size", str(m * 8 // pp)]
        one, zb = (cost.predict(validated(argv + extra, lay, 8), lay, c) for extra in ([], list(ZB)))
        busy = zb.step_time_s - zb.time["dp"] - zb.time["optimizer"]
        assert zb.time["bubble"] / busy == pytest.approx((pp - 1) / (3 * m + pp - 1), rel=0.02), (pp, m)
        assert zb.time["bubble"] == pytest.approx(one.time["bubble"] / 3, rel=0.02), (pp, m)
        cfg = validated(argv + list(ZB), lay, 8)
        assert [cost._in_flight(cfg.model, lay, i, m, 1) for i in range(pp)] == [min(pp, m)] * pp


def test_the_planner_prices_zbvs_bubble_and_activations():
    """As zb-h1's: at p = 2 and 4 zbv idles (p - 1) / (6m + p - 1) of the step (a chunk's F = B = W) and each
    stage holds the plan's chunk-activations (at most 2p, 1F1B's first stage's)."""
    from megalite.cli.plan import validated
    from megalite.planner import cost
    from megalite.planner.gpus import parse_cluster
    from megalite.planner.layout import Layout
    gpt = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
           "--max-position-embeddings", "1024", "--micro-batch-size", "1", "--vocab-size", "128", "--lr", "1e-4",
           "--train-iters", "10", "--fp16"]
    c = parse_cluster("8xH100-80GB", intra_node_bandwidth=1e9)
    for pp, m in ((4, 4), (4, 16), (2, 8)):
        lay = Layout(1, pp, 1, 8 // pp, 8 // (2 * pp), None, 0, None, 1, False)
        argv = gpt + ["--global-batch-size", str(m * 8 // pp)]
        cfg = validated(argv + list(ZBV), lay, 8)
        assert cfg.model.pipeline_schedule == "zbv"
        zbv = cost.predict(cfg, lay, c)
        busy = zbv.step_time_s - zbv.time["dp"] - zbv.time["optimizer"]
        assert zbv.time["bubble"] / busy == pytest.approx((pp - 1) / (6 * m + pp - 1), rel=0.02), (pp, m)
        plan = make_plan("zbv", pp, m)
        assert [cost._in_flight(cfg.model, lay, i, m, 2) for i in range(pp)] == [plan.most_alive(i)
                                                                                 for i in range(pp)]


def test_the_planners_search_applies_zb_h1_to_the_plain_pipelines_only():
    from megalite.cli.plan import search
    from megalite.planner.gpus import parse_cluster
    gpt = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512",
           "--max-position-embeddings", "512", "--micro-batch-size", "1", "--global-batch-size", "32",
           "--vocab-size", "1024", "--lr", "1e-4", "--train-iters", "10", "--bf16"]
    ranked, _ = search(gpt + list(ZB), parse_cluster("8xH100-80GB"), top=200)
    assert {p.layout.pp > 1 for p in ranked} == {True, False}, [p.layout.describe() for p in ranked][:5]


# -- evaluation ------------------------------------------------------------------------------------------------
def _evaluations(runs):
    """Per run (extra flags), what every evaluation of it returned on this rank (BASE's model, --skip-train)."""
    import pretrain_gpt
    from megalite import parallel_state as ps
    from megalite.training import parts, pretrain
    from parity import BASE
    from parity_models import BigramChainDataset
    out, original = [], parts.evaluate

    def datasets(args, num_samples):
        return None, BigramChainDataset(num_samples[1], args.seq_length, args.seed), None

    def recorded(*a, **k):
        out[-1].append(original(*a, **k))
        return out[-1][-1]
    with patched(parts, "evaluate", recorded):
        for extra in runs:
            out.append([])
            args = parse_args(list(BASE) + ["--skip-train", "--eval-iters", "2", "--pipeline-model-parallel-size",
                                            "2"] + list(extra), world_size=ps.world_size())
            try:
                pretrain(datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
            finally:
                ps.destroy_model_parallel()
    return out


def test_zbv_evaluates_as_1f1b():
    """Forward only, the V's plan runs its forwards alone (each rank's two chunks, the turning point handed over
    within rank 0): the same losses as 1F1B's, bit for bit (the same arithmetic per layer); dualpipev's too, at
    fewer micro-batches than its training needs (2 < 2p)."""
    from dist_util import run_on_ranks
    small = ("--eval-global-batch-size", "2")
    runs = [(), ZBV, ZBV + UNTIED, small, ("--pipeline-schedule", "dualpipev") + small]
    one, zbv, untied, one_small, dualpipev = run_on_ranks(_evaluations, 2, runs, timeout=300)[1]
    assert one and one == zbv, (one, zbv)
    assert one_small and one_small == dualpipev and one_small != one, (one_small, dualpipev)
    assert untied and untied != one  # (another model: the losses are not constants)
