"""tools/plan.py's predictions beside published throughput, one efficiency table per GPU type
(megalite/planner/gpus.py), never a constant per row.

Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
Table 1): GPT models of 1.7B to 1T parameters on A100-80GB, 8 per node with NVLink/NVSwitch, 8 x 200 Gbit/s HDR
InfiniBand per node, sequence 2048, vocabulary 51200, fp16 with query-key layer scaling (Megatron's default then:
attention scores materialised, before flash attention; megalite runs that path for these flags), full activation
recomputation; TFLOP/s per GPU in their convention, which counts the recomputed forward:
96 B s l h^2 (1 + s/6h + V/16lh). Each row at its published TP / PP / DP as run then (full recomputation, no
sequence parallelism, no distributed optimizer, the gradient all-reduce after the backward).

Megatron-LM's H100 table (its README's images/model_table.png): GPT models of 1.7B to 462B parameters on up to
6,144 H100-80GB, DP 48 throughout, sequence 4096, vocabulary 131072, untied embeddings, bf16, the DP reduction
and parameter gathers overlapped, 8 x 400 Gbit/s InfiniBand per node (50 GB/s per GPU); TFLOP/s per GPU and MFU
in Megatron's convention (no recomputation counted). Each row at its published TP / PP / DP with the distributed
optimizer (--overlap-param-gather needs it) and sequence parallelism. Megatron also overlapped the TP
collectives with the GEMMs (--tp-comm-overlap, Transformer Engine's userbuffers), which megalite does not.

Neither table gives the micro-batch size (nor, for the H100 one, interleaving or recomputation): the planner
takes the fastest it would run, and prints each micro-batch size's prediction beside it. --search: the
planner's first layout on each row's cluster beside the published one as megalite would run it (Narayanan's with
SP and the reduction overlapped).

    python benchmarks/plan_published.py [--table narayanan|megatron-h100|both] [--rows 6] [--search]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402

from megalite.config import ConfigError  # noqa: E402
from megalite.planner.cost import predict  # noqa: E402
from megalite.planner.gpus import parse_cluster  # noqa: E402
from megalite.cli.plan import search, validated  # noqa: E402
from megalite.planner.layout import Layout  # noqa: E402

# params (B), heads, hidden, layers, TP, PP, GPUs, batch, published TFLOP/s per GPU
NARAYANAN_2021 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


# params (B), heads, hidden, layers, TP, PP, GPUs, batch, published TFLOP/s per GPU (MFU 41-49% of 989)
MEGATRON_H100 = [
    (1.7, 16, 2048, 24, 1, 1, 48, 192, 408.8),
    (7.1, 32, 4096, 30, 2, 1, 96, 192, 465.9),
    (16, 48, 6144, 32, 4, 1, 192, 192, 489.1),
    (32, 56, 7168, 48, 8, 1, 384, 192, 459.6),
    (70, 64, 8192, 84, 8, 2, 768, 384, 419.7),
    (119, 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    (177, 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    (314, 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    (462, 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
]


def model_argv(heads, hidden, layers, batch, as_run_then=True):
    """A Narayanan row's model and batch; as_run_then: 2021's local DDP all-reduced the gradients after the
    backward (megalite overlaps the reduction with it by default)."""
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", "2048", "--max-position-embeddings", "2048", "--vocab-size", "51200",
            "--make-vocab-size-divisible-by", "128", "--global-batch-size", str(batch), "--lr", "1e-4",
            "--train-iters", "1", "--fp16", "--apply-query-key-layer-scaling"] + (  # Megatron's fp16 default then
            ["--no-overlap-grad-reduce"] if as_run_then else [])


def h100_argv(heads, hidden, layers, batch):
    """A Megatron H100 row's model and batch (bf16, untied embeddings, the DP collectives overlapped)."""
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", "4096", "--max-position-embeddings", "4096", "--vocab-size", "131072",
            "--make-vocab-size-divisible-by", "128", "--global-batch-size", str(batch), "--lr", "1e-4",
            "--train-iters", "1", "--bf16", "--untie-embeddings-and-output-weights", "--overlap-param-gather"]


TABLES = {  # rows, argv of a row, cluster suffix, inter-node GB/s per GPU, the paper's layout choices
    "narayanan": (NARAYANAN_2021, model_argv, "A100-80GB", 25.0, dict(recomputes=("full",), zeros=(0,))),
    "megatron-h100": (MEGATRON_H100, h100_argv, "H100-80GB", 50.0, dict(recomputes=(None, "selective"), zeros=(1,))),
}


def best_prediction(argv, tp, pp, gpus, cluster, choices, sp=False):
    """The published TP / PP / DP at the micro-batch size, interleaving and recompute (among `choices`) the planner
    prefers; sp=False for 2021's Megatron (no sequence parallelism), True as megalite runs TP."""
    return min(per_micro(argv, tp, pp, gpus, cluster, choices, sp).values(), key=lambda p: p.step_time_s, default=None)


def per_micro(argv, tp, pp, gpus, cluster, choices, sp):
    """{micro-batch size: the fastest prediction that fits at it}."""
    best = {}
    layers = int(argv[argv.index("--num-layers") + 1])
    vps = [None] + [k for k in (1, 2, 4) if pp > 1 and layers % (pp * k) == 0 and layers // (pp * k) >= 2]
    for micro in (1, 2, 4, 8):
        for vp in vps:
            for rc in choices["recomputes"]:
                lay = Layout(tp, pp, 1, gpus // (tp * pp), vp, None, choices["zeros"][0], rc, micro, sp and tp > 1)
                try:
                    p = predict(validated(argv, lay, gpus), lay, cluster)
                except ConfigError:
                    continue
                if p.fits and (micro not in best or p.step_time_s < best[micro].step_time_s):
                    best[micro] = p
    return best


def first_choice(argv, published, cluster, choices):
    """The planner's first layout among those with the paper's own choices, and its predicted time relative to
    the published layout's."""
    found, _ = search(argv, cluster, top=1, **choices)
    return found[0], found[0].step_time_s / published.step_time_s


def run_table(name, rows, do_search):
    table, argv_of, gpu, inter, choices = TABLES[name]
    print(f"{name}: {gpu}, inter-node {inter:g} GB/s per GPU; TFLOP/s per GPU in the paper's convention")
    print(f"{'model':>8} {'TP':>3} {'PP':>3} {'GPUs':>5} {'batch':>5} {'layout chosen':>28} {'published':>9} "
          f"{'predicted':>9} {'error':>7}  memory GiB  where the time goes")
    errors, firsts = [], 0
    for size, heads, hidden, layers, tp, pp, gpus, batch, published in table[:rows]:
        cluster = parse_cluster(f"{gpus}x{gpu}", 8, inter_node_bandwidth=inter)
        argv = argv_of(heads, hidden, layers, batch)
        micros = per_micro(argv, tp, pp, gpus, cluster, choices, sp=name != "narayanan")
        p = min(micros.values(), key=lambda p: p.step_time_s, default=None)
        if p is None:
            print(f"{size:>7}B: no micro-batch size fits")
            continue
        err = p.tflops_per_gpu / published - 1
        errors.append(abs(err))
        parts = ", ".join(f"{k} {100 * v / p.step_time_s:.0f}%" for k, v in p.time.items() if v / p.step_time_s > 0.01)
        chosen = f"mbs {p.layout.micro}" + (f" v{p.layout.vp}" if p.layout.vp else "") + \
            (f" {p.layout.recompute}" if p.layout.recompute else "")
        print(f"{size:>7}B {tp:>3} {pp:>3} {gpus:>5} {batch:>5} {chosen:>28} {published:>9} "
              f"{p.tflops_per_gpu:>9.0f} {100 * err:>+6.1f}%  {p.memory_gib_per_gpu:>10.1f}  {parts}", flush=True)
        each = [f"mbs {m} {q.tflops_per_gpu:.0f} ({q.tflops_per_gpu / published - 1:+.0%})"
                for m, q in sorted(micros.items())]
        print(f"{'':>9}by micro-batch size: {', '.join(each)}", flush=True)
        if do_search:  # against the published layout as megalite runs it (with SP), the planner's other choices
            if name == "narayanan":
                argv = model_argv(heads, hidden, layers, batch, as_run_then=False)
                p = best_prediction(argv, tp, pp, gpus, cluster, choices, sp=True)
            first, ratio = first_choice(argv, p, cluster, choices)
            same = (first.layout.tp, first.layout.pp) == (tp, pp)
            firsts += same or ratio >= 0.95
            print(f"{'':>9}planner's first: {first.layout.describe()} "
                  f"{'(the published TP/PP)' if same else f'predicted {ratio:.3f}x the published layout time'}",
                  flush=True)
    if not errors:
        print("no row fits at its published layout")
        return
    print(f"largest |error| {100 * max(errors):.1f}%, mean {100 * sum(errors) / len(errors):.1f}% over "
          f"{len(errors)} rows"
          + (f"; first pick the published TP/PP or within 5%: {firsts} of {len(errors)}" if do_search else ""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", choices=("narayanan", "megatron-h100", "both"), default="both")
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--search", action="store_true", help="also search each row's cluster (minutes per table)")
    a = ap.parse_args()
    for name in TABLES if a.table == "both" else (a.table,):
        run_table(name, a.rows or len(TABLES[name][0]), a.search)


if __name__ == "__main__":
    main()
