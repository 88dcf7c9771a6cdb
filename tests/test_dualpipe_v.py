"""DualPipeV (--pipeline-schedule dualpipev, megalite/pipeline/zero_bubble.py's dualpipe_v_order): DeepSeek's
DualPipe folded into ZB-V's V. Its plan runs (the checker over p <= 8, m <= 24 with m >= 2p), keeps DualPipe's
order (one chunk's forward beside the other chunk's backward in the steady state, the later half of the drain's
weight gradients deferred), holds 2p + 1 chunk-activations at most and idles no more than ZB-V; a run
reproduces the single process (tests/support/parity.py) at PP2 and PP4, m = 2p, 3p and 9 at PP4, with TP + SP,
EP2 MoE, ZeRO-2 and ZeRO-3, full recompute, bf16 (FP8: tests/test_fp8.py; a ZB-V checkpoint continued under it:
tests/test_checkpoint.py). A lost weight gradient and a reduction fired before the last W must be caught."""

import pytest

from megalite.cli.parser import parse_args
from megalite.pipeline.zero_bubble import W, Action, PlanError, check_plan, dualpipe_v_order, make_plan
from parity import EIGHT_LAYERS, LLAMA, MOE, layout, patched, reference, run_layouts
from parity_check import assert_parity, mismatches
from test_zero_bubble import ARGV, assert_ran_the_plan, weight_gradients_lost

DPV = ("--pipeline-schedule", "dualpipev")


# -- the plan --------------------------------------------------------------------------------------------------
def test_every_dualpipe_v_plan_up_to_8_stages_and_24_micro_batches_runs():
    for p in range(1, 9):
        for m in range(2 * p, 25):
            plan = make_plan("dualpipev", p, m)  # (make_plan checks it: PlanError otherwise)
            assert all(len(acts) == 6 * m for acts in plan.actions), (p, m)
            for r in range(p):  # (chunk-activations, from an F to its W: DualPipe's p + 1/2 micro-batches)
                assert plan.most_alive(r) <= 2 * p + 1, (p, m, r, plan.most_alive(r))
            # never longer than ZB-V's greedy plan by a unit, at p = 2 and 4 the least any plan takes
            zbv = make_plan("zbv", p, m).makespan
            assert plan.makespan <= zbv + 1, (p, m, plan.makespan, zbv)
            if p in (2, 4):
                assert plan.makespan == 6 * m + p - 1, (p, m, plan.makespan)


def test_dualpipe_v_needs_a_full_v_of_micro_batches():
    with pytest.raises(PlanError, match="DualPipeV over 4 ranks needs at least 8 micro-batches, not 7"):
        make_plan("dualpipev", 4, 7)


def _parse(text):
    return [Action(t[0], int(t.partition("c")[2] or 0), int(t[1:].partition("c")[0])) for t in text.split()]


def test_dualpipe_v_keeps_dualpipes_order():
    """p = 2, m = 5, DualPipeV's phases by hand. Pipeline rank 1 (the V's first stage, d = 0, k = 1 stage after
    it): 2k chunk-0 forwards; d + 1 forwards of each chunk; k times a chunk-1 backward, its W, a chunk-1 forward;
    m - 2p + d + 1 = 2 steady pairs (F0 beside B1, F1 beside B0, each W at once); k times B1 and the pair F1 B0;
    the drain's d + 1 = 1 round B1 B0, the B0 deferred (d even: from the middle round's chunk 0 on); k times the
    oldest W and a deferred B0; the W's owed. Rank 0 (d = 1, k = 0): no fill, 3 steady rounds, a drain of 2 rounds
    whose second (odd d: from its chunk 1 on) defers both W's."""
    assert dualpipe_v_order(2, 5, 1) == _parse(
        "F0 F1 F2 F0c1 B0c1 W0c1 F1c1 F3 B1c1 W1c1 F2c1 B0 W0 F4 B2c1 W2c1 F3c1 B1 W1 B3c1 W3c1 F4c1 B2 W2 "
        "B4c1 W4c1 B3 W3 B4 W4")
    assert dualpipe_v_order(2, 5, 0) == _parse(
        "F0 F0c1 F1 F1c1 F2 B0c1 W0c1 F2c1 B0 W0 F3 B1c1 W1c1 F3c1 B1 W1 F4 B2c1 W2c1 F4c1 B2 W2 B3c1 W3c1 B3 W3 "
        "B4c1 B4 W4c1 W4")


def test_broken_dualpipe_v_plans_are_refused():
    from megalite.parallel.pipeline_stages import PipelineStages
    st, plan = PipelineStages(2, 2, "v"), make_plan("dualpipev", 2, 4)
    ranks = [list(a) for a in plan.actions]
    twice = [ranks[0] + [Action(W, 1, 0)], ranks[1]]
    with pytest.raises(PlanError, match="rank 0 runs W0c1 twice"):
        check_plan([tuple(a) for a in twice], 4, st)
    early = [[Action(W, 0, 3)] + [a for a in ranks[0] if a != Action(W, 0, 3)], ranks[1]]
    with pytest.raises(PlanError, match="rank 0 runs W3 before its B"):
        check_plan([tuple(a) for a in early], 4, st)


# -- the command line ----------------------------------------------------------------------------------------
def test_dualpipe_v_runs_two_chunks_per_rank():
    args = parse_args(ARGV.split() + list(DPV), world_size=2)
    assert (args.pipeline_schedule, args.virtual_pipeline_model_parallel_size) == ("dualpipev", 2)
    # evaluation runs the V's forwards alone: any micro-batch count
    assert parse_args(ARGV.split() + list(DPV) + ["--eval-global-batch-size", "2"], world_size=2).pipeline_schedule


@pytest.mark.parametrize("extra,says", [
    ("--global-batch-size 3", "--pipeline-schedule dualpipev needs at least 2 x --pipeline-model-parallel-size 2 = "
                              "4 micro-batches, not 3; change --global-batch-size"),
    ("--global-batch-size 8 --rampup-batch-size 2 2 8",
     "--rampup-batch-size: global batch 2: --pipeline-schedule dualpipev needs at least 2 x"),
    ("--data-parallel-shares auto", "--pipeline-schedule dualpipev with --data-parallel-shares auto is not built"),
    ("--num-layers 6", "--pipeline-schedule dualpipev cuts the model into 2 x --pipeline-model-parallel-size 2"),
    ("--pipeline-model-parallel-size 1", "--pipeline-schedule dualpipev fills a pipeline's bubble"),
    ("--num-virtual-stages-per-pipeline-rank 4 --num-layers 8", "--pipeline-schedule dualpipev runs two model "
                                                                "chunks per rank (its V), not 4"),
])
def test_dualpipe_v_refusals_are_one_line(capsys, extra, says):
    with pytest.raises(SystemExit) as e:
        parse_args(ARGV.split() + list(DPV) + extra.split(), world_size=2)
    assert e.value.code != 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and says in err[0], err


# -- parity ----------------------------------------------------------------------------------------------------
LAYOUTS = [
    layout("pp4_dualpipev", pp=4, flags=DPV, model=EIGHT_LAYERS),  # m = 8 = 2p
    layout("pp4_dualpipev_9_micro_batches_untied", pp=4, flags=DPV,
           model=EIGHT_LAYERS + ("--untie-embeddings-and-output-weights", "--global-batch-size", "9")),
    layout("pp2_dp2_zero2_dualpipev_6_micro_batches_tied", pp=2, dp=2, zero=2, flags=DPV,
           model=("--global-batch-size", "12")),  # m = 6 = 3p
    layout("tp2_pp2_sp_dualpipev_llama", tp=2, pp=2, sp=True, flags=DPV, model=LLAMA),
    layout("pp2_dp2_ep2_moe_dualpipev_zero1", pp=2, dp=2, zero=1, model=MOE,
           flags=DPV + ("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall")),
    layout("pp2_dp2_zero3_dualpipev", pp=2, dp=2, zero=3, flags=DPV),
    layout("pp2_dp2_dualpipev_full_recompute", pp=2, dp=2, recompute="full", flags=DPV),
    layout("pp2_dp2_dualpipev_bf16", pp=2, dp=2, dtype="bf16", flags=DPV),
]


def reduction_before_the_last_w():
    """The DP reduction enabled at the B of the second-last micro-batch, not at the last W: its buckets fire
    before the last micro-batch's weight gradients reach them. (test_zero_bubble's fault, enabling it at the last
    B, breaks nothing here: DualPipeV owes no other W of that chunk then.)"""
    from megalite.pipeline.run import Run
    original = Run.backward_input

    def early(self, chunk, *a):
        if self.bwd_mb[chunk] == self.m - 2 and hasattr(self.chunks[chunk], "sync_enabled"):
            self.chunks[chunk].sync_enabled = True
        return original(self, chunk, *a)
    return patched(Run, "backward_input", early)


# (one-sample micro-batches: DualPipeV needs 2p of them per DP rank)
FAULTY = [layout("weight_gradients_lost@pp2_dp2_dualpipev", pp=2, dp=2, flags=DPV, fault=weight_gradients_lost),
          layout("reduction_before_the_last_w@pp2_dp2_dualpipev", pp=2, dp=2, flags=DPV,
                 fault=reduction_before_the_last_w)]


@pytest.fixture(scope="module")
def four():
    lays = LAYOUTS + FAULTY
    return dict(zip((lay.name for lay in lays), run_layouts(lays, 4)))


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.name)
def test_dualpipe_v_matches_single_process(four, lay):
    ranks = four[lay.name]
    assert_parity(lay, ranks)
    assert_ran_the_plan(lay, ranks, "dualpipev", 2, lambda pp, m: 2 * pp + 1)


@pytest.mark.parametrize("lay", FAULTY, ids=lambda lay: lay.name)
def test_a_lost_weight_gradient_or_an_early_reduction_is_caught(four, lay):
    found = mismatches(lay, four[lay.name], reference(lay))
    assert any("step-1 grad" in m for m in found), found[:5]


# -- the planner ---------------------------------------------------------------------------------------------
def test_the_planner_prices_dualpipe_vs_bubble_and_activations():
    """Equal stages, communication free (as test_zero_bubble's): at p = 2 and 4 DualPipeV idles (p - 1) /
    (6m + p - 1) of the step (its plan's unit-cost step, ZB-V's), and each stage holds its plan's
    chunk-activations (2p + 1)."""
    from megalite.cli.plan import validated
    from megalite.planner import cost
    from megalite.planner.gpus import parse_cluster
    from megalite.planner.layout import Layout
    gpt = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
           "--max-position-embeddings", "1024", "--micro-batch-size", "1", "--vocab-size", "128", "--lr", "1e-4",
           "--train-iters", "10", "--fp16"]
    c = parse_cluster("8xH100-80GB", intra_node_bandwidth=1e9)
    for pp, m in ((4, 8), (4, 16), (2, 8)):
        lay = Layout(1, pp, 1, 8 // pp, 8 // (2 * pp), None, 0, None, 1, False)
        cfg = validated(gpt + ["--global-batch-size", str(m * 8 // pp)] + list(DPV), lay, 8)
        assert cfg.model.pipeline_schedule == "dualpipev"
        pred = cost.predict(cfg, lay, c)
        busy = pred.step_time_s - pred.time["dp"] - pred.time["optimizer"]
        assert pred.time["bubble"] / busy == pytest.approx((pp - 1) / (6 * m + pp - 1), rel=0.02), (pp, m)
        plan = make_plan("dualpipev", pp, m)
        alive = [cost._in_flight(cfg.model, lay, i, m, 2) for i in range(pp)]
        assert alive == [plan.most_alive(i) for i in range(pp)] == [2 * pp + 1] * pp, alive
    # a layout whose DP leaves fewer than 2p micro-batches per pipeline is one the planner cannot launch
    lay = Layout(1, 4, 1, 2, 1, None, 0, None, 1, False)
    with pytest.raises(Exception, match="dualpipev needs at least 2 x --pipeline-model-parallel-size 4"):
        validated(gpt + ["--global-batch-size", "8"] + list(DPV), lay, 8)


def test_a_w_right_after_its_b_is_computed_within_b():
    """Where the plan's next action is the W of the B that runs (DualPipeV's steady state: a whole backward), the
    linear layers' weight-gradient GEMMs run inside B's pass (store.collecting's now) and W only accumulates: the
    same gradient, bit for bit, and nothing read at W (the layer's input changed after B changes nothing)."""
    import torch
    from megalite.pipeline.wgrad import WeightGradStore
    from megalite.tensor_parallel.deferred_wgrad import deferred_linear
    torch.manual_seed(0)
    w, store = torch.nn.Parameter(torch.randn(3, 4)), WeightGradStore()
    got = {}
    for now in (False, True):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
        y = deferred_linear(x, w, None, store)
        with store.collecting((0, 0), now=now):
            y.square().sum().backward()
        assert w.grad is None
        x.add_(1.0)  # (after B: read only by a W computed at W)
        [(p, got[now])] = store.run((0, 0))
        assert p is w
    x, plain = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)), w.detach().clone().requires_grad_()
    torch.nn.functional.linear(x, plain).square().sum().backward()  # (an ordinary backward's gradient)
    want = plain.grad
    torch.testing.assert_close(got[True], want, rtol=0, atol=0)
    assert not torch.equal(got[False], want)  # (deferred: it read the changed input)
