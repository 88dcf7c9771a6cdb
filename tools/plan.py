"""Predict memory per GPU and step time of a layout before running it, or find the best layouts.

    # the best layouts of a Llama-3-70B-shaped model on 64 H100s (pretrain_gpt.py's model flags)
    python tools/plan.py --cluster 64xH100-80GB --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 \\
        --num-attention-heads 64 --group-query-attention --num-query-groups 8 --seq-length 8192 \\
        --max-position-embeddings 8192 --position-embedding-type rope --normalization RMSNorm --swiglu \\
        --untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 128256 \\
        --global-batch-size 512 --bf16
    # one layout: give its parallel flags (--tensor-model-parallel-size ...) and --predict
    # mixed GPUs: --cluster 4xA100-80GB,4xRTX3090-24GB --gpus-per-node 4 (a node holds one type)

Every other flag is pretrain_gpt.py's (a whole training command pastes as it is; --lr and --train-iters, which
change neither memory nor time, may be left out); a layout megalite would refuse is never printed. --json prints one
JSON object per layout. The model behind the figures: megalite/planner/ (docs/planner.md)."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config import ConfigError  # noqa: E402
from megalite.planner.cost import GiB, predict  # noqa: E402
from megalite.planner.gpus import parse_cluster  # noqa: E402
from megalite.cli.plan import search, validated  # noqa: E402
from megalite.config.plan import PlanConfig  # noqa: E402
from megalite.planner.layout import layout_of  # noqa: E402


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--cluster", required=True, help="COUNTxGPU[,COUNTxGPU...], e.g. 64xH100-80GB")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--intra-node-bandwidth", type=float, default=None, help="GB/s per GPU, one direction")
    p.add_argument("--inter-node-bandwidth", type=float, default=None, help="GB/s per GPU, one direction")
    p.add_argument("--predict", action="store_true", help="predict the layout the parallel flags give; no search")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--json", action="store_true")
    return p


def report(p):
    m, t = p.memory, p.time
    lines = [f"{p.layout.describe()}: {p.step_time_s:.3f} s/step, {p.tokens_per_s:,.0f} tokens/s, "
             f"{p.tflops_per_gpu:.0f} TFLOP/s/GPU, MFU {100 * p.mfu:.1f}%" + ("" if p.fits else "  DOES NOT FIT"),
             f"  memory (stage {m['stage']}, {m['gpu']}): " + ", ".join(
                 f"{k} {m[k] / GiB:.1f}" for k in ("weights", "gradients", "optimizer", "activations", "buffers",
                                                   "reserved", "total")) + f" GiB, headroom {m['headroom'] / GiB:.1f}"
             + (f"; host {m['host'] / GiB:.1f} GiB (offloaded optimizer)" if m.get("host") else ""),
             "  time: " + ", ".join(f"{k} {v:.3f}" for k, v in t.items()) + " s",
             "  flags: " + " ".join(p.flags)]
    return "\n".join(lines)


# Flags pretrain_gpt.py requires that change neither memory nor step time: a plan needs none of them.
UNPRICED = ((("--lr",), ["--lr", "1e-4"]),
            (("--train-iters", "--train-samples", "--skip-train"), ["--train-iters", "1"]))


def with_unpriced(model_argv):
    """The user's flags, plus a stand-in for each required flag that does not change the plan and is left out."""
    given = {a.split("=", 1)[0] for a in model_argv if a.startswith("--")}
    return list(model_argv) + [x for flags, stand_in in UNPRICED if not given & set(flags) for x in stand_in]


def main(argv=None):
    ours, model_argv = build_parser().parse_known_args(argv)
    model_argv = with_unpriced(model_argv)
    if ours.top < 1:
        print(f"plan: --top {ours.top} must be >= 1", file=sys.stderr)
        return 2
    try:
        cluster = parse_cluster(ours.cluster, ours.gpus_per_node, ours.intra_node_bandwidth, ours.inter_node_bandwidth)
        if ours.predict:
            from megalite.cli.parser import check_args
            lay = layout_of(PlanConfig.of(check_args(model_argv, cluster.size)))
            found = [predict(validated(model_argv, lay, cluster.size), lay, cluster)]
            tried = 1
        else:
            found, tried = search(model_argv, cluster, ours.top)
    except ConfigError as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    if not found:
        print(f"plan: no layout of this model can launch on {cluster.describe()} (the parallel sizes must divide "
              f"{cluster.size} GPUs and megalite's rules hold)", file=sys.stderr)
        return 2
    if ours.json:
        for p in found:
            print(json.dumps(p.row()))
    else:
        if not ours.predict:
            print(f"{tried} layouts megalite can launch on {cluster.describe()}; the best {len(found)} predicted"
                  + (":" if found[0].fits else " (none fits: the ones closest to fitting):"))
        for p in found:
            print(report(p))
    if not found[0].fits:
        print(f"plan: {'no layout fits' if not ours.predict else 'this layout does not fit'} the GPUs' memory "
              f"(short by {-found[0].memory['headroom'] / GiB:.1f} GiB on {found[0].memory['gpu']})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
