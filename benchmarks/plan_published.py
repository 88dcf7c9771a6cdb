"""tools/plan.py's predictions beside published throughput: Narayanan et al. 2021 ("Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", Table 1: GPT models of 1.7B to 1T parameters on
A100-80GB, 8 per node with NVLink/NVSwitch, 8 x 200 Gbit/s HDR InfiniBand per node, sequence 2048, vocabulary
51200, fp16 with query-key layer scaling (Megatron's default then: attention scores materialised, before flash
attention; megalite runs that path for these flags), full activation recomputation; TFLOP/s per GPU in their convention, which counts the
recomputed forward: 96 B s l h^2 (1 + s/6h + V/16lh)).

For each row the planner predicts the published TP / PP / DP as run then (full recomputation, no sequence
parallelism, no distributed optimizer, the gradient all-reduce after the backward) at the micro-batch size it prefers (1, 2, 4, 8; the paper does not
list it), and prints the relative error of the predicted TFLOP/s per GPU. One efficiency table per GPU type
(megalite/planner/gpus.py), never a constant per row. --search: the planner's first layout on each row's
cluster beside the published one as megalite would run it (with SP, the reduction overlapped).

    python benchmarks/plan_published.py [--rows 6] [--search]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402

from megalite.config import ConfigError  # noqa: E402
from megalite.planner.cost import predict  # noqa: E402
from megalite.planner.gpus import parse_cluster  # noqa: E402
from megalite.planner.layout import Layout, validated  # noqa: E402
from megalite.planner.search import search  # noqa: E402

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


def model_argv(heads, hidden, layers, batch, as_run_then=True):
    """The row's model and batch; as_run_then: 2021's local DDP all-reduced the gradients after the backward
    (megalite overlaps the reduction with it by default)."""
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", "2048", "--max-position-embeddings", "2048", "--vocab-size", "51200",
            "--make-vocab-size-divisible-by", "128", "--global-batch-size", str(batch), "--lr", "1e-4",
            "--train-iters", "1", "--fp16", "--apply-query-key-layer-scaling"] + (  # Megatron's fp16 default then
            ["--no-overlap-grad-reduce"] if as_run_then else [])


def best_prediction(argv, tp, pp, gpus, cluster, sp=False):
    """The published layout as run then (sp=False: 2021's Megatron had no sequence parallelism, and no ZeRO),
    or as megalite would run it (sp=True, its default with TP)."""
    best = None
    for micro in (1, 2, 4, 8):
        lay = Layout(tp, pp, 1, gpus // (tp * pp), None, None, 0, "full", micro, sp and tp > 1)
        try:
            p = predict(validated(argv, lay, gpus), lay, cluster)
        except ConfigError:
            continue
        if p.fits and (best is None or p.step_time_s < best.step_time_s):
            best = p
    return best


def first_choice(argv, published, cluster):
    """The planner's first layout among those with the paper's own choices (full recompute, no distributed
    optimizer), and its predicted time relative to the published layout's."""
    found, _ = search(argv, cluster, top=1, recomputes=("full",), zeros=(0,))
    return found[0], found[0].step_time_s / published.step_time_s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=len(NARAYANAN_2021))
    ap.add_argument("--search", action="store_true", help="also search each row's cluster (minutes per row)")
    a = ap.parse_args()
    print("Narayanan et al. 2021, Table 1 (A100-80GB, full recompute; TFLOP/s per GPU in the paper's convention)")
    print(f"{'model':>8} {'TP':>3} {'PP':>3} {'GPUs':>5} {'batch':>5} {'mbs':>4} {'published':>9} {'predicted':>9} "
          f"{'error':>7}  memory GiB  where the time goes")
    errors = []
    for size, heads, hidden, layers, tp, pp, gpus, batch, published in NARAYANAN_2021[:a.rows]:
        cluster = parse_cluster(f"{gpus}xA100-80GB", 8)
        p = best_prediction(model_argv(heads, hidden, layers, batch), tp, pp, gpus, cluster)
        if p is None:
            print(f"{size:>7}B: no micro-batch size fits")
            continue
        err = p.tflops_per_gpu / published - 1
        errors.append(abs(err))
        parts = ", ".join(f"{k} {100 * v / p.step_time_s:.0f}%" for k, v in p.time.items() if v / p.step_time_s > 0.01)
        print(f"{size:>7}B {tp:>3} {pp:>3} {gpus:>5} {batch:>5} {p.layout.micro:>4} {published:>9} "
              f"{p.tflops_per_gpu:>9.0f} {100 * err:>+6.1f}%  {p.memory_gib_per_gpu:>10.1f}  {parts}", flush=True)
        if a.search:  # against the published layout as megalite runs it (with SP), the planner's other choices
            argv = model_argv(heads, hidden, layers, batch, as_run_then=False)
            first, ratio = first_choice(argv, best_prediction(argv, tp, pp, gpus, cluster, sp=True), cluster)
            same = (first.layout.tp, first.layout.pp) == (tp, pp)
            print(f"{'':>9}planner's first: {first.layout.describe()} "
                  f"{'(the published TP/PP)' if same else f'predicted {ratio:.3f}x the published layout'}",
                  flush=True)
    print(f"largest |error| {100 * max(errors):.1f}%, mean {100 * sum(errors) / len(errors):.1f}% over {len(errors)} rows")


if __name__ == "__main__":
    main()
