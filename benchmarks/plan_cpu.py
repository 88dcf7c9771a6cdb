"""The planner's ranking against measured runs, on a cluster where every layout can be run: 4 gloo CPU ranks.

The ranks are described to the planner as a "GPU" measured here, the 4 ranks running at once (each one
thread): GEMM rate (fp32 matmul), memory bandwidth (an in-place add over 32 MB), host time per small
operator, and the gloo all-reduce bandwidth over the 4 ranks. Then every layout of a small GPT that the
planner's search would consider (TP x PP x DP, ZeRO 0/1, micro-batch 1/2/4; no recompute: everything fits)
runs `pretrain` for a few steps; the median step after the first is its measured time. Goal (issue 37): the
layout the planner ranks first is within 10% of the fastest measured.

--semi-sync (issue 66): data parallelism over the 4 ranks, synchronous against DiLoCo replicas (2 or 4 of them,
H inner steps per round): each run's mean step over whole rounds after the first step (an outer step every H),
against the planner's price of it.

    python benchmarks/plan_cpu.py [--steps 6] [--semi-sync]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from gloo_ranks import spawn  # noqa: E402
from megalite.config import ConfigError  # noqa: E402
from megalite.planner.cost import predict  # noqa: E402
from megalite.planner.gpus import GPU, Cluster  # noqa: E402
from megalite.planner.layout import Layout, validated  # noqa: E402

WORLD = 4
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
         "--max-position-embeddings", "256", "--vocab-size", "2048", "--global-batch-size", "16", "--lr", "1e-4",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--log-interval", "1000",
         "--eval-iters", "0", "--eval-interval", "0", "--num-workers", "0", "--no-fused-kernels", "--train-iters", "6"]


def _calibrate():
    import torch.distributed as dist

    def rate(fn, reps):
        fn()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    gemm = 2 * 512 ** 3 / rate(lambda: torch.mm(a, b), 20) / 1e12
    x = torch.zeros(8 << 20)
    bandwidth = 2 * x.numel() * 4 / rate(lambda: x.add_(1.0), 10) / 1e9
    small = torch.zeros(64)
    overhead = rate(lambda: small.add_(1.0), 2000) * 1e6
    buf, one = torch.zeros(1 << 20), torch.zeros(1)
    link = 2 * (WORLD - 1) / WORLD * buf.numel() * 4 / rate(lambda: dist.all_reduce(buf), 10) / 1e9
    latency = rate(lambda: dist.all_reduce(one), 200) * 1e6
    return gemm, bandwidth, overhead, link, latency


def _run(argv, steps):
    import pretrain_gpt
    from megalite import parallel_state as ps
    from megalite import training
    from megalite.cli.parser import parse_args
    from megalite.training import step
    times, original = [], step.train_step

    def timed(*a, **k):
        t = time.perf_counter()
        out = original(*a, **k)
        times.append(time.perf_counter() - t)
        return out
    step.train_step = timed
    try:
        args = parse_args(argv + ["--train-iters", str(steps)], world_size=WORLD)
        training.pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
    finally:
        step.train_step = original
        ps.destroy_model_parallel()
    return statistics.mean(times[1:]) if "--semi-sync-method" in argv else statistics.median(times[1:])


def layouts():
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            if WORLD % (tp * pp):
                continue
            dp = WORLD // (tp * pp)
            for zero in (0, 1) if dp > 1 else (0,):
                for micro in (1, 2, 4):
                    if 16 % (micro * dp) == 0:
                        yield Layout(tp, pp, 1, dp, None, None, zero, None, micro, tp > 1)


SEMI_SYNC = [[]] + [["--semi-sync-method", "diloco", "--semi-sync-replicas", str(r), "--semi-sync-steps", str(h)]
                    for r, h in ((2, 1), (2, 4), (2, 8), (4, 1), (4, 8))]


def semi_sync_variants():
    """(layout, its extra flags): DP 4 with ZeRO-1, synchronous or as DiLoCo replicas."""
    lay = Layout(1, 1, 1, WORLD, None, None, 1, None, 1, False)
    return [(lay, extra) for extra in SEMI_SYNC]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--semi-sync", action="store_true", help="price DiLoCo replicas against synchronous DP")
    a = ap.parse_args()
    if a.semi_sync:
        a.steps = max(a.steps, 17)  # (whole rounds of 8 after the first step)
    gemm, bandwidth, overhead, link, latency = [statistics.median(v) for v in zip(*spawn(WORLD, _calibrate))]
    rank = GPU("CPU-rank", 8, gemm, False, link, "gloo", 1.0, bandwidth, gemm, overhead, asynchronous=False)
    cluster = Cluster((rank,) * WORLD, WORLD, {"CPU-rank": link}, link, {"intra": 1.0, "inter": 1.0}, latency)
    print(f"a CPU rank (4 at once): {gemm * 1e3:.1f} GFLOP/s fp32 matmul, {bandwidth:.1f} GB/s add, "
          f"{overhead:.1f} us per small op; gloo all-reduce {link:.2f} GB/s, {latency:.0f} us for one element")
    rows = []
    for lay, extra in semi_sync_variants() if a.semi_sync else ((lay, []) for lay in layouts()):
        try:
            args = validated(MODEL + extra, lay, WORLD)
        except ConfigError:
            continue
        p = predict(args, lay, cluster)
        measured = statistics.median(spawn(WORLD, _run, MODEL + extra + lay.flags(), a.steps))
        name = lay.describe() + (f" DiLoCo R={extra[3]} H={extra[5]}" if extra else "")
        rows.append((lay, p.step_time_s, measured, name))
        print(f"{name:<55} predicted {p.step_time_s * 1e3:8.1f} ms  measured {measured * 1e3:8.1f} ms",
              flush=True)
    best_measured = min(r[2] for r in rows)
    pick = min(rows, key=lambda r: r[1])
    order = sorted(rows, key=lambda r: r[2])
    print(f"planner's first: {pick[3]} measured {pick[2] * 1e3:.1f} ms = {pick[2] / best_measured:.3f}x "
          f"the fastest measured ({order[0][3]}, {best_measured * 1e3:.1f} ms); "
          f"its measured rank {order.index(pick) + 1} of {len(rows)}")
    errors = [abs(r[1] - r[2]) / r[2] for r in rows]
    print(f"prediction error: mean {100 * statistics.mean(errors):.0f}%, largest {100 * max(errors):.0f}%")


if __name__ == "__main__":
    main()
