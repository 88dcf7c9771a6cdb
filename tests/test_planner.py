"""tools/plan.py and megalite/planner: clusters, layouts and their flags, the pipeline's bubble, the search.
(The memory model against measured bytes: test_planner_memory.py, test_planner_activations.py.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.config import ConfigError
from megalite.planner import cost
from megalite.planner.gpus import GPUS, LINK_EFFICIENCY, parse_cluster
from megalite.cli.plan import search, validated
from megalite.planner.layout import Layout, layout_of

ROOT = Path(__file__).resolve().parents[1]
GPT = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
       "--max-position-embeddings", "1024", "--global-batch-size", "64", "--micro-batch-size", "1",
       "--vocab-size", "50257", "--lr", "1e-4", "--train-iters", "10", "--bf16"]


def test_clusters_parse_and_bad_ones_are_one_line():
    c = parse_cluster("4xA100-80GB,4xRTX3090-24GB", gpus_per_node=4)
    assert c.size == 8 and c.types == ["A100-80GB", "RTX3090-24GB"] and c.describe() == "4xA100-80GB,4xRTX3090-24GB"
    reach = LINK_EFFICIENCY["intra"]  # what NCCL's rings reach of a link
    assert c.link_gbps([0, 1]) == 300.0 * reach and c.link_gbps([4, 5]) == 32.0 * reach
    assert c.link_gbps([0, 4]) == 25.0 * LINK_EFFICIENCY["inter"]
    assert parse_cluster("16xh100", intra_node_bandwidth=400).link_gbps([0, 7]) == 400.0 * reach
    for need in ("V100-32GB", "A100-40GB", "A100-80GB", "H100-80GB", "H200", "RTX2080Ti-11GB", "RTX3090-24GB",
                 "RTX4090-24GB", "L40S"):
        assert need in GPUS
    for text, message in (("8xB300", "unknown GPU 'B300'"), ("eight H100", "COUNTxGPU"),
                          ("4xA100-80GB,2xL40S", "fill whole nodes")):
        with pytest.raises(ConfigError) as e:
            parse_cluster(text, gpus_per_node=4)
        assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("lay", [Layout(2, 2, 1, 2, None, None, 1, "selective", 2, True),
                                 Layout(1, 4, 1, 2, 1, None, 0, "full", 1, False),
                                 Layout(4, 1, 2, 1, None, None, 3, None, 4, True),
                                 Layout(1, 2, 1, 4, 2, None, 2, None, 1, False)], ids=lambda lay: lay.describe())
def test_a_layouts_flags_launch_that_layout(lay):
    """The flags the plan prints parse in megalite to the same layout (and the user's own parallel flags give
    way to them)."""
    args = validated(GPT + ["--tensor-model-parallel-size", "8", "--recompute-activations"], lay, 8)
    assert layout_of(args) == lay


def test_a_layout_megalite_refuses_is_refused():
    with pytest.raises(ConfigError, match="not divisible"):
        validated(GPT, Layout(tp=3, dp=1), 3)


def test_the_bubble_is_the_schedules():
    """Equal stages (a vocabulary too small for the output layer to count), communication free: 1F1B idles
    (p-1)/(m+p-1) of the step, interleaving (p-1)/(v m+p-1)."""
    c = parse_cluster("8xH100-80GB", intra_node_bandwidth=1e9)
    for pp, vp, m in ((4, None, 4), (4, None, 16), (4, 1, 8), (2, 2, 8)):
        lay = Layout(1, pp, 1, 8 // pp, vp, None, 0, None, 1, False)
        args = validated(GPT[:-1] + ["--global-batch-size", str(m * 8 // pp), "--fp16", "--vocab-size", "128"], lay, 8)
        p = cost.predict(args, lay, c)
        v = 8 // (pp * vp) if vp else 1
        busy = p.step_time_s - p.time["dp"] - p.time["optimizer"]
        assert p.time["bubble"] / busy == pytest.approx((pp - 1) / (v * m + pp - 1), rel=0.02), (pp, vp, m)


def test_search_ranks_launchable_layouts_that_fit():
    found, tried = search(GPT, parse_cluster("8xRTX3090-24GB"), top=4)
    assert tried > 50 and len(found) == 4 and all(p.fits for p in found)
    assert [p.step_time_s for p in found] == sorted(p.step_time_s for p in found)
    for p in found:  # each one launches that layout
        assert layout_of(validated(GPT, p.layout, 8)) == p.layout


def test_a_pasted_overlap_param_gather_applies_to_the_layouts_with_zero():
    """A Megatron launch line's --use-distributed-optimizer --overlap-param-gather: the search still tries every
    layout (those without ZeRO run without the gather it overlaps), and its ZeRO layouts are priced with it."""
    cluster = parse_cluster("16xA100-80GB")
    zero = dict(recomputes=(None,), zeros=(0, 1))
    plain, n_plain = search(GPT, cluster, top=1000, **zero)
    pasted, n_pasted = search(GPT + ["--use-distributed-optimizer", "--overlap-param-gather"], cluster, top=1000,
                              **zero)
    assert n_pasted == n_plain and len(pasted) == len(plain)
    times = {p.layout: p.time["dp"] for p in plain}
    with_zero = [(p.time["dp"], times[p.layout]) for p in pasted if p.layout.zero]
    assert all(a <= b for a, b in with_zero) and any(a < b for a, b in with_zero)  # (a gather under a bucket: all)
    assert all(p.time["dp"] == times[p.layout] for p in pasted if not p.layout.zero)


def _plan(argv):
    """tools/plan.py's main in this process (a process start re-imports torch): (exit status, stdout, stderr)."""
    from cli_batch import run_tool
    return run_tool("plan", *argv)


def test_plan_prints_json_rows():
    rc, out, err = _plan(["--cluster", "8xA100-80GB", "--predict", "--json", "--tensor-model-parallel-size", "2",
                          "--sequence-parallel", "--pipeline-model-parallel-size", "2", *GPT])
    assert rc == 0, err
    row = json.loads(out.strip().splitlines()[0])
    for key in ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "memory_gib_per_gpu", "flags"):
        assert key in row
    assert "--tensor-model-parallel-size 2" in " ".join(row["flags"]) and 0 < row["mfu"] < 1
    # as a program once (the others run its main in this process): the exit status and one line
    bad = subprocess.run([sys.executable, "tools/plan.py", "--cluster", "8xB300", *GPT], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "unknown GPU" in bad.stderr


def test_mixed_clusters_give_the_faster_stage_more_layers():
    """A100 node then RTX 3090 node, PP2: the A100 stage (4.4x the peak) takes most layers, by the model's own
    min-max cut; the cut's flags launch it; an even split predicts slower."""
    from megalite.planner.cost import balanced_layout
    cluster = parse_cluster("4xA100-80GB,4xRTX3090-24GB", gpus_per_node=4)
    even = Layout(1, 2, 1, 4, None, None, 1, None, 1, False)
    args = validated(GPT, even, 8)
    cut = balanced_layout(args, even, cluster)
    assert cut.stage_layers and cut.stage_layers[0] > 2 * cut.stage_layers[1] and sum(cut.stage_layers) == 8
    cut_args = validated(GPT, cut, 8)
    assert layout_of(cut_args) == cut
    assert cost.predict(cut_args, cut, cluster).step_time_s < cost.predict(args, even, cluster).step_time_s
    found, _ = search(GPT, cluster, top=3)
    assert all(p.layout.pp == 1 or p.layout.stage_layers is None or p.layout.stage_layers[0] > p.layout.stage_layers[1]
               for p in found)


def test_the_readme_mixed_cluster_plan_prints_what_the_readme_shows():
    import re
    import shlex
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Plan a run"):readme.index("## Benchmarks")]
    blocks = re.findall(r"```(bash)?\n(.*?)```", section, re.S)
    command = [b for kind, b in blocks if kind and "4xA100-80GB,4xRTX3090-24GB" in b][0]
    shown = [b for kind, b in blocks if not kind and "4xA100-80GB,4xRTX3090-24GB" in b][0].splitlines()
    argv = shlex.split(" ".join(ln for ln in command.replace("\\\n", " ").splitlines() if not ln.startswith("#")))
    assert argv[:2] == ["python", "tools/plan.py"], argv
    rc, out, err = _plan(argv[2:])
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[:3] == shown[:3] and lines[-1] == shown[-1], (lines, shown)


@pytest.mark.parametrize("extra", [(), ("--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "4096",
                                        "--disable-bias-linear")], ids=["dense", "moe"])
def test_no_layout_beats_the_gemm_ceiling(extra):
    """Every predicted step does at least megalite's FLOP count at the GPU's GEMM ceiling: MFU <= efficiency
    (an MoE layer's k experts counted, as flops.py counts them: k x 4096 here, twice the dense FFN)."""
    argv = GPT + list(extra) + (["--sequence-parallel"] if extra else [])
    found, _ = search(argv, parse_cluster("8xH100-80GB"), top=20)
    assert found and all(0 < p.mfu <= GPUS["H100-80GB"].gemm_efficiency for p in found), \
        [(p.layout.describe(), p.mfu) for p in found]


def test_mixed_replicas_get_shares_by_their_speed():
    """DP8 over an A100 node and an RTX 3090 node: the A100 replicas take more micro-batches
    (--data-parallel-shares), which megalite launches, and the step is predicted faster than at equal shares."""
    from megalite.planner.cost import balanced_shares
    cluster = parse_cluster("4xA100-80GB,4xRTX3090-24GB", gpus_per_node=4)
    equal = Layout(1, 1, 1, 8, None, None, 1, None, 1, False)
    args = validated(GPT, equal, 8)
    shared = balanced_shares(args, equal, cluster)
    assert shared.shares and sum(shared.shares) == 64 and min(shared.shares[:4]) > 2 * max(shared.shares[4:])
    shared_args = validated(GPT, shared, 8)
    assert layout_of(shared_args) == shared
    assert cost.predict(shared_args, shared, cluster).step_time_s < 0.75 * cost.predict(args, equal,
                                                                                       cluster).step_time_s
    alike = parse_cluster("8xA100-80GB")
    assert balanced_shares(args, equal, alike) is equal


def test_a_precision_the_gpus_lack_is_one_line():
    lay = Layout(1, 1, 1, 8, None, None, 1, None, 1, False)
    with pytest.raises(ConfigError) as e:
        cost.predict(validated(GPT[:-1] + ["--bf16"], lay, 8), lay, parse_cluster("8xV100-32GB"))
    assert "V100-32GB cannot compute in bf16" in str(e.value) and "\n" not in str(e.value)
    assert cost.predict(validated(GPT[:-1] + ["--fp16"], lay, 8), lay, parse_cluster("8xV100-32GB")).fits


MLA = ["--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "12", "--position-embedding-type", "rope", "--rope-type", "rope"]


@pytest.mark.parametrize("extra", [[], ["--group-query-attention", "--num-query-groups", "4", "--swiglu"], MLA],
                         ids=["mha", "gqa_swiglu", "mla"])
def test_the_time_models_flops_are_megalites(extra):
    """The step-time model's split of a layer's FLOPs (projections, scores, FFN) adds up to megalite/flops.py."""
    from megalite.planner.flops import num_floating_point_operations
    args = validated(GPT + extra, Layout(), 1)
    c = args.model
    proj, score = cost._attention_terms(c)
    h, L, s, v = c.hidden_size, c.num_layers, c.seq_length, 50304
    ffn = c.ffn_hidden_size * (1.5 if c.swiglu else 1.0)
    ours = 12 * s * L * h * h * (proj + score * s / h + ffn / h + v / (2 * L * h))
    assert ours == pytest.approx(num_floating_point_operations(c, 1, v), rel=1e-12)


def test_review_findings_stay_fixed():
    """Shares are proportions; --flag=value is a layout flag too; MoE layouts carry the experts' TP; fp32 is
    priced at the fp32 peak; what the CLI cannot plan is one line and exit 2."""
    c8, lay = parse_cluster("8xA100-80GB"), Layout(1, 1, 1, 8, None, None, 1, None, 1, False)
    args = validated(GPT, lay, 8)
    same = Layout(1, 1, 1, 8, None, None, 1, None, 1, False, shares=(1,) * 8)
    assert cost.predict(validated(GPT, same, 8), same, c8).step_time_s == pytest.approx(
        cost.predict(args, lay, c8).step_time_s)
    from megalite.planner.layout import strip_layout_flags
    assert strip_layout_flags(["--recompute-granularity=full", "--lr", "1", "--micro-batch-size", "2"]) == ["--lr", "1"]
    moe = GPT + ["--num-experts", "8", "--disable-bias-linear", "--sequence-parallel"]
    states = []
    for etp in (1, 2):
        m = Layout(2, 1, 1, 4, None, 4, 1, None, 1, True, etp=etp)
        margs = validated(moe, m, 8)
        assert layout_of(margs) == m and f"--expert-tensor-parallel-size {etp}" in " ".join(m.flags())
        states.append(cost.predict(margs, m, c8).memory["weights"])
    assert states[0] > states[1]  # ETP 1 keeps whole experts on each rank
    fp32 = cost.predict(validated(GPT[:-1], lay, 8), lay, c8)
    assert fp32.tflops_per_gpu < GPUS["A100-80GB"].fp32_tflops
    for argv, message in ((["--cluster", "7xA100-80GB", *GPT], "no layout of this model can launch"),
                          (["--cluster", "8xA100", *GPT], "ambiguous GPU 'A100'"),
                          (["--cluster", "8xA100-80GB", "--top", "0", *GPT], "--top 0 must be >= 1"),
                          (["--cluster", "8xA100-80GB", "--intra-node-bandwidth", "nan", *GPT], "must be > 0"),
                          (["--cluster", "8xA100-80GB", *[a for a in GPT if a not in ("--vocab-size", "50257")],
                            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v", "--merge-file", "m"],
                           "give --vocab-size")):
        rc, _, err = _plan(argv)  # in this process (test_plan_prints_json_rows runs the script as a program)
        assert rc == 2 and message in err and err.count("\n") == 1, (argv, err)


def test_predict_keeps_the_users_layout_or_says_why_not():
    from megalite.cli.parser import check_args
    args = check_args(GPT + ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"], 8)
    assert layout_of(args).vp == 2  # 8 layers, PP2, 2 chunks each: 2 layers per virtual stage
    args = check_args(GPT + ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3"], 8)
    assert layout_of(args).stage_layers == (3, 5)
    args = check_args(GPT + ["--recompute-granularity", "full", "--recompute-method", "block",
                             "--recompute-num-layers", "2"], 8)
    with pytest.raises(ConfigError, match="models full recompute as --recompute-method uniform"):
        layout_of(args)


def _stage_cut(args):
    """The layers of every (virtual) pipeline stage a parsed command line runs."""
    from megalite.transformer.pipeline_layers import stage_layer_counts
    if args.pipeline_layout:
        return tuple(args.pipeline_layout)
    pp, v = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size or 1
    if v == 1:
        return tuple(stage_layer_counts(args.num_layers, pp, args.decoder_first_pipeline_num_layers,
                                        args.decoder_last_pipeline_num_layers))
    return (args.num_layers // (pp * v),) * (pp * v)


def test_predict_prices_every_pipeline_cut_the_validation_accepts():
    """Every combination of pipeline size, uneven first / last stages, interleaving and recompute that
    pretrain_gpt.py's validation accepts (10 layers: some divide, some do not) is priced by --predict, at the cut
    the run would use (not an even one)."""
    import itertools

    from megalite.cli.parser import check_args
    model = [a if a != "8" else "10" for a in GPT]  # (--num-layers 10)
    cluster, accepted = parse_cluster("8xA100-80GB"), 0
    for pp, first, last, v, full in itertools.product((2, 4), (None, 1, 3), (None, 2, 4), (None, 2), (False, True)):
        flags = ["--pipeline-model-parallel-size", str(pp)]
        flags += ["--decoder-first-pipeline-num-layers", str(first)] if first else []
        flags += ["--decoder-last-pipeline-num-layers", str(last)] if last else []
        flags += ["--num-virtual-stages-per-pipeline-rank", str(v)] if v else []
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
                  "1"] if full else []
        try:
            args = check_args(model + flags, 8)
        except ConfigError:
            continue  # (pretrain_gpt.py refuses it too)
        accepted += 1
        lay = layout_of(args)
        priced = validated(model + flags, lay, 8)
        assert _stage_cut(priced) == _stage_cut(args), (flags, _stage_cut(priced), _stage_cut(args))
        p = cost.predict(priced, lay, cluster)
        assert p.step_time_s > 0, flags
    assert accepted >= 20, accepted


def test_plan_prices_llama3_405b_at_its_published_layout_without_lr_or_train_iters():
    """Llama 3 405B's published pipeline (126 layers on 16 stages, one fewer on the first and last), pasted without
    --lr / --train-iters: priced, at its own cut, as flags and as Megatron's layout string."""
    model = ["--num-layers", "126", "--hidden-size", "16384", "--ffn-hidden-size", "53248", "--num-attention-heads",
             "128", "--group-query-attention", "--num-query-groups", "8", "--seq-length", "8192",
             "--max-position-embeddings", "8192", "--vocab-size", "128256", "--swiglu", "--normalization", "RMSNorm",
             "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
             "--micro-batch-size", "1", "--global-batch-size", "2048", "--bf16", "--tensor-model-parallel-size", "8",
             "--pipeline-model-parallel-size", "16", "--context-parallel-size", "1", "--use-distributed-optimizer",
             "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    cut = "Et*7|" + "t*8|" * 14 + "t*7L"
    for gpus in (8192, 16384):
        for pipeline in (["--decoder-first-pipeline-num-layers", "7", "--decoder-last-pipeline-num-layers", "7"],
                         ["--pipeline-model-parallel-layout", cut]):
            rc, out, err = _plan(["--cluster", f"{gpus}xH100-80GB", "--predict", *model, *pipeline])
            assert "layers 7/8/8/8/8/8/8/8/8/8/8/8/8/8/8/7" in out and cut in out, (gpus, pipeline, out, err)
            assert "missing required" not in err and "not divisible" not in err, err


def test_what_the_planner_does_not_model_is_one_line():
    for extra, zero, named in ((["--semi-sync-method", "diloco", "--semi-sync-async", "--semi-sync-steps", "5"], 1,
                                "--semi-sync-method with --semi-sync-async"),
                               (["--grad-compression", "powersgd"], 0, "--grad-compression")):
        lay = Layout(1, 1, 1, 8, None, None, zero, None, 1, False)
        with pytest.raises(ConfigError) as e:
            cost.predict(validated(GPT + extra, lay, 8), lay, parse_cluster("8xA100-80GB"))
        assert f"does not model {named}" in str(e.value) and "\n" not in str(e.value)


def test_semi_synchronous_replicas_are_priced():
    """Two nodes of 8 A100s, 16 data-parallel ranks: synchronous, every gradient reduction crosses the nodes;
    DiLoCo with a replica per node reduces inside its node and sums the fp32 main weights over the nodes once per
    round, an H-th of it per step (bf16 / fp8 payloads: a half / a quarter of the fp32 all-reduce's bytes for two
    replicas)."""
    cluster = parse_cluster("16xA100-80GB")
    lay = Layout(1, 1, 1, 16, None, None, 1, None, 1, False)
    sync = cost.predict(validated(GPT, lay, 16), lay, cluster)

    def outer(*flags):
        p = cost.predict(validated(GPT + ["--semi-sync-method", "diloco", "--semi-sync-replicas", "2", *flags],
                                   lay, 16), lay, cluster)
        return p.time["outer"], p.time["dp"], p.step_time_s
    one, dp1, _ = outer("--semi-sync-steps", "1")
    eight, dp8, step8 = outer("--semi-sync-steps", "8")
    assert sync.time["outer"] == 0 and one > 0 and eight == pytest.approx(one / 8, rel=1e-12)
    assert dp8 == dp1 < sync.time["dp"]  # the inner reduction stays in the node
    assert step8 < sync.step_time_s
    bf16, fp8 = (outer("--semi-sync-steps", "1", "--semi-sync-quantize", q)[0] for q in ("bf16", "fp8"))
    assert one - bf16 == pytest.approx(2 * (bf16 - fp8), rel=1e-9) and fp8 > 0  # wire w, w/2, w/4; latency alike
    hidden, _, _ = outer("--semi-sync-steps", "8", "--semi-sync-fragments", "2", "--semi-sync-fragment-delay", "3")
    assert hidden < eight  # each fragment's sync behind three inner steps


def test_layout_flags_parsed_over_the_model_flags_are_the_whole_parse():
    """A search parses the model's flags once and each layout's over a copy (cli/parser.py, ModelFlags): the same
    arguments as one parse of both, whatever layout came before (validation of one layout leaves nothing in the
    next one's copy)."""
    from megalite.cli.parser import ModelFlags, check_args
    moe = ["--moe-layer-freq", "[1,0,1,0,1,0,1,0]", "--num-experts", "4", "--disable-bias-linear"]  # a list flag
    model = GPT + moe
    layouts = [["--tensor-model-parallel-size", "2", "--sequence-parallel", "--micro-batch-size", "2"],
               ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--zero-stage", "2",
                "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
                "--pipeline-model-parallel-layout", "Et*3|t*5L", "--micro-batch-size", "1"],
               ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--micro-batch-size", "4"]]
    parsed = ModelFlags(model)
    for flags in layouts + layouts[::-1]:
        assert vars(parsed.at(flags, 8)) == vars(check_args(model + flags, 8)), flags


def test_full_recompute_runs_the_forward_tp_collectives_again():
    """Full recompute re-runs each layer's forward, its TP collectives too: 12 ring collectives per layer instead of
    8 (4 forward, their 4 adjoints backward), so the TP time is 1.5x the run's without recompute (no SP here: its
    backward's extra gathers are the same either way)."""
    cluster = parse_cluster("8xA100-80GB")
    plain, full = (Layout(8, 1, 1, 1, None, None, 0, r, 1, False) for r in (None, "full"))
    tp = [cost.predict(validated(GPT, lay, 8), lay, cluster).time["tp"] for lay in (plain, full)]
    assert tp[0] > 0 and tp[1] == pytest.approx(1.5 * tp[0], rel=1e-12), tp
