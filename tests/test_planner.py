"""tools/plan.py and megalite/planner: clusters, layouts and their flags, the pipeline's bubble, the search.
(The memory model against measured bytes: test_planner_memory.py, test_planner_activations.py.)"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.config import ConfigError
from megalite.planner import cost
from megalite.planner.gpus import GPUS, LINK_EFFICIENCY, parse_cluster
from megalite.planner.layout import Layout, layout_from_args, validated
from megalite.planner.search import search

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
    assert layout_from_args(args) == lay


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
        assert layout_from_args(validated(GPT, p.layout, 8)) == p.layout


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
    assert layout_from_args(cut_args) == cut
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
    assert layout_from_args(shared_args) == shared
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
    from megalite.arguments import model_config
    from megalite.flops import num_floating_point_operations
    args = validated(GPT + extra, Layout(), 1)
    c = model_config(args, args.vocab_size)
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
        assert layout_from_args(margs) == m and f"--expert-tensor-parallel-size {etp}" in " ".join(m.flags())
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
    from megalite.arguments import check_args
    args = check_args(GPT + ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"], 8)
    assert layout_from_args(args).vp == 2  # 8 layers, PP2, 2 chunks each: 2 layers per virtual stage
    args = check_args(GPT + ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3"], 8)
    assert layout_from_args(args).stage_layers == (3, 5)
    args = check_args(GPT + ["--recompute-granularity", "full", "--recompute-method", "block",
                             "--recompute-num-layers", "2"], 8)
    with pytest.raises(ConfigError, match="models full recompute as --recompute-method uniform"):
        layout_from_args(args)


def test_what_the_planner_does_not_model_is_one_line():
    for extra, zero in ((["--semi-sync-method", "diloco"], 1), (["--grad-compression", "powersgd"], 0)):
        lay = Layout(1, 1, 1, 8, None, None, zero, None, 1, False)
        with pytest.raises(ConfigError) as e:
            cost.predict(validated(GPT + extra, lay, 8), lay, parse_cluster("8xA100-80GB"))
        assert f"does not model {extra[0]}" in str(e.value) and "\n" not in str(e.value)


def test_the_overlap_flags_are_priced():
    """--no-overlap-grad-reduce leaves the whole ZeRO-0/1 reduction after the backward (ZeRO-2 reduces each
    micro-batch's either way); --overlap-param-gather hides ZeRO-1/2's gather behind the next forward."""
    from megalite import parallel_state as ps
    from megalite.arguments import model_config
    from megalite.planner import traffic
    cluster = parse_cluster("16xA100-80GB")  # DP across two nodes: the reduction outlasts a backward
    dp = {}
    for zero in (0, 1, 2):
        lay = Layout(1, 1, 1, 16, None, None, zero, None, 1, False)
        for extra in ((), ("--no-overlap-grad-reduce",), ("--overlap-param-gather",)):
            if zero == 0 and extra == ("--overlap-param-gather",):
                continue  # (Megatron's rule: it needs the distributed optimizer)
            dp[zero, extra] = cost.predict(validated(GPT + list(extra), lay, 16), lay, cluster).time["dp"]
    args = validated(GPT + ["--no-overlap-grad-reduce"], Layout(1, 1, 1, 16, None, None, 0, None, 1, False), 16)
    wire = traffic.data_parallel_bytes(args, model_config(args, args.vocab_size), ps.Grid.of(1, 1, 16, 1),
                                       args.global_batch_size // 16)
    assert dp[0, ("--no-overlap-grad-reduce",)] == pytest.approx(
        wire["all_reduce"] / (cluster.link_gbps(range(16)) * 1e9), rel=1e-12)
    assert dp[0, ("--no-overlap-grad-reduce",)] > dp[0, ()] > 0
    assert dp[1, ("--no-overlap-grad-reduce",)] > dp[1, ()]
    assert dp[2, ("--no-overlap-grad-reduce",)] == dp[2, ()]
    assert dp[1, ("--overlap-param-gather",)] < dp[1, ()] and dp[2, ("--overlap-param-gather",)] < dp[2, ()]


def test_per_replica_micro_batch_sizes_are_priced():
    """--data-parallel-micro-batch-sizes: each replica's activations at its own size on its own GPUs, its
    micro-batch count from the run's iteration plan; the flags round-trip; auto (measured at start) is one line."""
    import dataclasses

    from megalite.arguments import check_args
    cluster = parse_cluster("1xA100-40GB,1xRTX3090-24GB", gpus_per_node=1)
    same = Layout(1, 1, 1, 2, None, None, 1, None, 16, False)
    sized = dataclasses.replace(same, micros=(16, 4))
    args = validated(GPT, sized, 2)
    assert "--data-parallel-micro-batch-sizes 16,4" in " ".join(sized.flags()) and layout_from_args(args) == sized
    p_same, p_sized = cost.predict(validated(GPT, same, 2), same, cluster), cost.predict(args, sized, cluster)
    assert p_same.memory["gpu"] == p_sized.memory["gpu"] == "RTX3090-24GB"  # the smaller GPU decides
    assert p_sized.memory["activations"] == pytest.approx(p_same.memory["activations"] / 4, rel=0.01)
    small = Layout(1, 1, 1, 2, None, None, 1, None, 4, False)  # both at 4: the 3090 holds the same
    assert p_sized.memory["total"] == cost.predict(validated(GPT, small, 2), small, cluster).memory["total"]
    shared = dataclasses.replace(sized, shares=(3, 1))  # the A100 takes 48 samples in 3, the 3090 16 in 4
    assert cost.predict(validated(GPT, shared, 2), shared, cluster).step_time_s < 0.6 * p_sized.step_time_s
    auto = check_args(GPT + ["--data-parallel-micro-batch-sizes", "auto", "--device-memory-budget", "20"], 2)
    with pytest.raises(ConfigError, match="not auto"):
        layout_from_args(auto)


def test_the_search_gives_the_replica_that_runs_out_smaller_micro_batches():
    from megalite.planner.search import _fit_replicas
    cluster = parse_cluster("1xA100-80GB,1xRTX3090-24GB", gpus_per_node=1)
    long = [a if a != "1024" or GPT[i - 1] == "--hidden-size" else "4096" for i, a in enumerate(GPT)]  # seq 4096
    lay = Layout(1, 1, 1, 2, None, None, 1, None, 16, False, shares=(3, 1))
    args = validated(long, lay, 2)
    assert not cost.predict(args, lay, cluster).fits  # the 3090 cannot hold 16 sequences of 4096
    p = _fit_replicas(long, args, lay, cluster)
    assert p.fits and p.layout.micros == (16, 8) and "--data-parallel-micro-batch-sizes 16,8" in " ".join(p.flags)


def test_gemm_tiles_run_in_waves_over_the_sms():
    """Tile and wave quantization (planner/gemm.py): a 2048 x 3840 output (a 10k-wide QKV at TP 8) is 240 tiles
    of 256 x 128, three waves of an A100's 108 SMs, 240 / 324 of them useful; 16384 x 6912 fills 32 waves
    exactly; a ragged edge wastes the tiles' overhang; no SMs (a CPU) is no quantization."""
    from megalite.planner.gemm import layer_gemms, time_factor, utilisation
    assert utilisation(2048, 3840, 108) == pytest.approx(240 / 324, rel=1e-12)
    assert utilisation(16384, 6912, 108) == 1.0
    assert utilisation(300, 128, 1) == pytest.approx(300 / 512, rel=1e-12)  # 2 tiles of 256 rows, one SM
    assert utilisation(2048, 3840, None) == 1.0 and time_factor([(7, 5, 3)], 2, None) == 4
    from megalite.arguments import model_config
    args = validated(GPT, Layout(8, 1, 1, 1, None, None, 0, None, 1, True), 8)
    narrow = time_factor(layer_gemms(model_config(args, args.vocab_size), 1024, 8), 1, GPUS["A100-80GB"].sms)
    assert narrow > 3.5  # TP 8 of hidden 1024: 48 to 128 columns per rank, few tiles for 108 SMs


def test_hierarchical_reduction_is_priced_through_the_nodes():
    """--hierarchical-grad-reduce over 2 nodes of 8: a reduce-scatter and an all-gather inside each node on its
    link, 1/8 of the bytes across the nodes; exposed whole under --no-overlap-grad-reduce."""
    cluster = parse_cluster("16xA100-80GB")
    lay = Layout(1, 1, 1, 16, None, None, 0, None, 1, False)
    flat, hier = (cost.predict(validated(GPT + ["--no-overlap-grad-reduce"] + x, lay, 16), lay, cluster).time["dp"]
                  for x in ([], ["--hierarchical-grad-reduce"]))
    reach = LINK_EFFICIENCY
    payload = flat * cluster.link_gbps(range(16)) * 1e9 / (2 * 15 / 16)  # the buckets' bytes
    want = 2 * 7 / 8 * payload / (300e9 * reach["intra"]) + 2 * 1 / 2 * payload / 8 / (25e9 * reach["inter"])
    assert hier == pytest.approx(want, rel=1e-12) and hier < flat / 4
    one_node = parse_cluster("8xA100-80GB")  # a group inside one node runs flat
    lay8 = Layout(1, 1, 1, 8, None, None, 0, None, 1, False)
    assert cost.predict(validated(GPT + ["--hierarchical-grad-reduce"], lay8, 8), lay8, one_node).time["dp"] == \
        cost.predict(validated(GPT, lay8, 8), lay8, one_node).time["dp"]


def test_optimizer_offload_is_priced():
    """--optimizer-cpu-offload: the offloaded fraction's fp32 main values and states leave the GPU (host memory
    holds them and their gradients), the step pays the host's AdamW and the copies over the host link (behind
    the device's part with --overlap-cpu-optimizer-d2h-h2d); a fraction per replica; auto is one line."""
    import dataclasses

    from megalite.arguments import check_args
    from megalite.planner.optimizer_step import HOST_GBPS
    cluster = parse_cluster("2xA100-80GB")
    lay = Layout(1, 1, 1, 2, None, None, 1, None, 1, False)

    def plan(offload, extra=(), cluster=cluster):
        at = dataclasses.replace(lay, offload=offload)
        return cost.predict(validated(GPT + list(extra), at, 2), at, cluster)
    base, half, whole = plan(None), plan((0.5, 0.5)), plan((1.0, 1.0))
    overlapped = plan((0.5, 0.5), ["--overlap-cpu-optimizer-d2h-h2d"])
    assert "--optimizer-cpu-offload --optimizer-offload-fraction 0.5" in " ".join(half.flags)
    assert layout_from_args(validated(GPT, dataclasses.replace(lay, offload=(0.0, 1.0)), 2)).offload == (0.0, 1.0)
    assert base.memory["host"] == 0 < half.memory["host"] < whole.memory["host"]
    moved = base.memory["optimizer"] - whole.memory["optimizer"]  # every main value and Adam state (bf16 model)
    elements = moved / 12
    assert whole.memory["host"] == moved + 4 * elements  # and the gradients' host buffer
    assert base.memory["total"] - whole.memory["total"] == moved
    host_step = elements * 30 / (HOST_GBPS * 1e9)
    copies = elements * 6 / (GPUS["A100-80GB"].host_gbps * 1e9)  # fp32 gradients down, bf16 weights up
    assert whole.time["optimizer"] == pytest.approx(host_step + copies, rel=1e-6)
    assert overlapped.time["optimizer"] < half.time["optimizer"]  # the copies behind the device's half
    mixed = parse_cluster("1xA100-80GB,1xRTX3090-24GB", gpus_per_node=1)  # only the 3090's replica offloads
    per = plan((0.0, 1.0), cluster=mixed)
    assert per.memory["gpu"] == "RTX3090-24GB" and per.memory["host"] == whole.memory["host"]
    with pytest.raises(ConfigError, match="not auto"):
        layout_from_args(check_args(GPT + ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "auto",
                                           "--device-memory-budget", "20"], 2))


def test_per_replica_precisions_are_priced():
    """--data-parallel-precisions: each replica's activations, weights and GEMM rate in its own precision (an
    fp32 replica at the GPU's fp32 peak, its weights and activations in 4-byte elements), MFU against each
    GPU's peak in its replica's precision; bf16 on a GPU without it is one line."""
    cluster = parse_cluster("1xA100-80GB,1xV100-32GB", gpus_per_node=1)
    lay = Layout(1, 1, 1, 2, None, None, 0, None, 1, False)
    fp32 = GPT[:-1]  # (GPT's --bf16 dropped: the list gives each replica its own)

    def plan(precisions):
        return cost.predict(validated(fp32 + ["--data-parallel-precisions", precisions], lay, 2), lay, cluster)
    half, single = plan("bf16,fp16"), plan("bf16,fp32")
    assert half.memory["gpu"] == single.memory["gpu"] == "V100-32GB"
    # (the state to the byte per rank: test_planner_memory.py; some saved tensors are fp32 or ids either way)
    assert single.memory["activations"] > half.memory["activations"] and single.memory["weights"] > \
        half.memory["weights"]
    v100 = GPUS["V100-32GB"]
    assert single.time["compute"] > half.time["compute"] * v100.peak_tflops / v100.fp32_tflops / 2
    peak = (GPUS["A100-80GB"].peak_tflops + v100.peak_tflops) / 2
    assert half.mfu == pytest.approx(half.tflops_per_gpu / peak, rel=1e-12)
    with pytest.raises(ConfigError, match="replica 1 runs on V100-32GB, which cannot compute in bf16"):
        plan("bf16,bf16")


def test_the_search_offloads_the_optimizer_of_the_replica_that_runs_out():
    """A 1.3B model without ZeRO: 18 bytes of state per parameter do not fit an RTX 3090 at any micro-batch; the
    search keeps the 3090 replica's optimizer on the host, the A100's on its GPU. A fraction the user gives is
    every candidate's."""
    from megalite.planner.search import _fit_replicas
    big = [a for a in GPT]
    big[big.index("--num-layers") + 1], big[big.index("--hidden-size") + 1] = "24", "2048"
    cluster = parse_cluster("1xA100-80GB,1xRTX3090-24GB", gpus_per_node=1)
    lay = Layout(1, 1, 1, 2, None, None, 0, None, 1, False)
    args = validated(big, lay, 2)
    assert not cost.predict(args, lay, cluster).fits
    p = _fit_replicas(big, args, lay, cluster)
    assert p.fits and p.layout.offload in ((0.0, 0.5), (0.0, 1.0)) and "--optimizer-cpu-offload" in p.flags
    found, _ = search(big + ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.25"], cluster, top=3)
    assert found and all(p.layout.offload == (0.25,) * p.layout.dp for p in found)


@pytest.mark.parametrize("table, row", [("narayanan", 0), ("narayanan", 5), ("narayanan", 9),
                                        ("megatron-h100", 3), ("megatron-h100", 7), ("megatron-h100", 8)])
def test_published_runs_stay_within_the_issues_15_percent(table, row):
    """benchmarks/plan_published.py's rows (BENCHMARKS.md): a small, a mid and the largest of each table within the
    issue's 15% of the published TFLOP/s per GPU at the published TP / PP / DP. The largest H100 rows fit there
    without full recomputation only because SP keeps each rank's rows of the column layers' input."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plan_published import TABLES, best_prediction
    rows, argv_of, gpu, inter, choices = TABLES[table]
    size, heads, hidden, layers, tp, pp, gpus, batch, published = rows[row]
    cluster = parse_cluster(f"{gpus}x{gpu}", 8, inter_node_bandwidth=inter)
    p = best_prediction(argv_of(heads, hidden, layers, batch), tp, pp, gpus, cluster, choices, sp=table != "narayanan")
    assert p is not None, f"{size}B: nothing fits at TP {tp} PP {pp}"
    assert abs(p.tflops_per_gpu / published - 1) <= 0.15, (size, p.tflops_per_gpu, published)


def test_multi_token_prediction_is_priced():
    """--mtp-num-layers D: D more layers, eh_proj GEMMs and logits on the last stage (a slower stage, more of its
    memory), and D more layers' FLOPs counted as Megatron counts them."""
    cluster = parse_cluster("8xA100-80GB")
    lay = Layout(1, 2, 1, 4, None, None, 1, None, 1, False)
    rope = ["--position-embedding-type", "rope"]
    plain = cost.predict(validated(GPT + rope, lay, 8), lay, cluster)
    mtp = cost.predict(validated(GPT + rope + ["--mtp-num-layers", "1"], lay, 8), lay, cluster)
    assert mtp.memory["stage"] == 1 and mtp.memory["activations"] > plain.memory["activations"]
    assert mtp.memory["weights"] > plain.memory["weights"]  # (its layer, norms, eh_proj and the embedding)
    assert mtp.step_time_s > plain.step_time_s * 1.1  # the last stage now runs 4 + 1 layers and two logits
    h, s, v = 1024, 1024, 50304  # Megatron's FLOPs per token: a layer 72 h^2 + 12 s h, logits 6 h V, eh_proj and
    layer, logits, eh = 72 * h * h + 12 * s * h, 6 * h * v, 6 * (3 * h + 2 * h * h)  # the depth's norms
    flops = mtp.tflops_per_gpu * mtp.step_time_s / (plain.tflops_per_gpu * plain.step_time_s)
    assert flops == pytest.approx(1 + (layer + logits + eh) / (8 * layer + logits), rel=1e-9)


def test_sequence_parallel_pays_its_backward_gathers_where_they_outlast_their_gemms():
    """SP's column layers gather their input rows again in backward, QKV's behind QKV's input-gradient GEMM and
    fc1's behind fc1's: TP time beyond TP without SP (the same ring bytes otherwise) is what each gather outlasts
    its own GEMM by; on a 1 GB/s link that is most of the gathers, on NVLink little."""
    from megalite.planner import gemm as shapes
    from megalite.planner.cost import _stage_time
    args = validated(GPT, Layout(4, 1, 1, 2, None, None, 0, None, 1, True), 8)
    c, e, vocab = cost._figures(args, Layout(4))
    extra = {}
    for link in (1.0, None):
        cluster = parse_cluster("8xA100-80GB", intra_node_bandwidth=link)
        tp = {sp: _stage_time(dataclasses.replace(c, sequence_parallel=sp), Layout(4, 1, 1, 2, sp=sp), cluster, 0,
                              cluster.gpus[0], e, 8, False, vocab)["tp"] for sp in (True, False)}
        gather = 3 / 4 * 1024 * 1024 * e / (cluster.link_gbps(range(4)) * 1e9) + cluster.latency_us * 1e-6
        gemms = shapes.layer_gemms(c, 1024, 4)
        behind = [2 * m * k * n / shapes.utilisation(m, k, 108) / (312e12 * 0.8) for m, k, n in (gemms[0], gemms[2])]
        extra[link] = tp[True] - tp[False]
        assert extra[link] == pytest.approx(8 * sum(max(0.0, gather - g) for g in behind), rel=1e-9)
    assert extra[1.0] > 100 * extra[None] > 0
