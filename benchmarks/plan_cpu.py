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

--offload (issue 66): --optimizer-cpu-offload at fractions 0-1 (one rank, a model whose optimizer step is a
large part of its step): on CPU ranks the "host" is the same memory, so the offloaded part's copies are
memory copies and both halves step at megalite's AdamW rate measured here (a copy's bandwidth is the host
link): each run (the variants taking turns, three times) against the planner's price, step and optimizer step,
the offload's own cost (a run's step less the unoffloaded one's) both ways,
and, with the device memory set between what no offload and half offload need, the planner's pick among the
runs that fit against the fastest of them.

    python benchmarks/plan_cpu.py [--steps 6] [--semi-sync | --offload]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from gloo_ranks import spawn  # noqa: E402
from megalite.config import ConfigError  # noqa: E402
from megalite.planner.cost import FRAGMENTATION, predict  # noqa: E402
from megalite.planner.gpus import GPU, Cluster  # noqa: E402
from megalite.cli.plan import validated  # noqa: E402
from megalite.planner.layout import Layout  # noqa: E402

WORLD = 4
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
         "--max-position-embeddings", "256", "--vocab-size", "2048", "--global-batch-size", "16", "--lr", "1e-4",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--log-interval", "1000",
         "--eval-iters", "0", "--eval-interval", "0", "--num-workers", "0", "--no-fused-kernels", "--train-iters", "6"]


def _calibrate(world=WORLD):
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
    y = torch.empty_like(x)
    copy = x.numel() * 4 / rate(lambda: y.copy_(x), 10) / 1e9  # (bytes carried, as the planner's host link)
    import kernels  # AdamW as megalite steps it on a CPU (torch's ops), in the bytes the planner counts (30 each)
    main, grad, m, v = (torch.rand(4 << 20) for _ in range(4))

    def adamw():
        with kernels.use_backend("torch"):
            kernels.adamw_step(main, grad, m, v, step=3, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    optimizer = 30 * main.numel() / rate(adamw, 5) / 1e9
    buf, one = torch.zeros(1 << 20), torch.zeros(1)
    link = 2 * max(world - 1, 1) / world * buf.numel() * 4 / rate(lambda: dist.all_reduce(buf), 10) / 1e9
    latency = rate(lambda: dist.all_reduce(one), 200) * 1e6
    return gemm, bandwidth, overhead, link, latency, copy, optimizer


def _run(argv, steps, world=WORLD):
    import pretrain_gpt
    from megalite import parallel_state as ps
    from megalite import training
    from megalite.cli.parser import parse_args
    from megalite.optimizer.optimizer import MixedPrecisionOptimizer as Optimizer
    from megalite.training import step
    times, original, updates, update = [], step.train_step, [], Optimizer._update

    def timed(*a, **k):
        t = time.perf_counter()
        out = original(*a, **k)
        times.append(time.perf_counter() - t)
        return out
    def timed_update(*a, **k):
        t = time.perf_counter()
        update(*a, **k)
        updates.append(time.perf_counter() - t)
    step.train_step, Optimizer._update = timed, timed_update
    try:
        args = parse_args(argv + ["--train-iters", str(steps)], world_size=world)
        training.pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
    finally:
        step.train_step, Optimizer._update = original, update
        ps.destroy_model_parallel()
    if "--semi-sync-method" in argv:
        return statistics.mean(times[1:])
    step_s = statistics.median(times[1:])
    return (step_s, statistics.median(updates[1:])) if world == 1 else step_s


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


# a small step's worth of compute (32 tokens a rank) on 13M parameters: the optimizer is a large part of the step
OFFLOAD_MODEL = [v if i == 0 or MODEL[i - 1] not in ("--hidden-size", "--seq-length", "--global-batch-size") else
                 {"--hidden-size": "512", "--seq-length": "32", "--global-batch-size": "4"}[MODEL[i - 1]]
                 for i, v in enumerate(MODEL)]
OFFLOAD = (None, 0.25, 0.5, 1.0)  # fractions of each rank's optimizer on the host (None: no offload)


def offload_variants():
    """(layout, its extra flags): one rank (no gloo traffic to drown the copies in), each offload fraction, and
    all of it with the copies "overlapped" (a CPU rank has no side stream: the planner must not hide them)."""
    lay = Layout(1, 1, 1, 1, None, None, 0, None, 1, False)
    out = [(lay if f is None else dataclasses.replace(lay, offload=(f,)), []) for f in OFFLOAD]
    return out + [(dataclasses.replace(lay, offload=(1.0,)), ["--overlap-cpu-optimizer-d2h-h2d"])]


def _offload_rows(model, cluster, steps, repeats=3):
    """Each offload variant run `repeats` times, the variants taking turns (this machine drifts by some 10% over
    minutes, more than the offload costs): the median of each one's step and optimizer-step times."""
    runs = [(lay, extra, validated(model + extra, lay, 1)) for lay, extra in offload_variants()]
    spawn(1, _run, model + runs[0][0].flags(), 3, 1)  # (a first run warms the machine up)
    got = [[] for _ in runs]
    for _ in range(repeats):
        for (lay, extra, _), out in zip(runs, got):
            out.append(spawn(1, _run, model + extra + lay.flags(), steps, 1)[0])
    rows = []
    for (lay, extra, args), out in zip(runs, got):
        p = predict(args, lay, cluster)
        measured, opt = (statistics.median(v) for v in zip(*out))
        name = lay.describe() + (" overlapped" if extra else "")
        rows.append((lay, p.step_time_s, measured, name, p, args))
        print(f"{name:<55} predicted {p.step_time_s * 1e3:8.1f} ms  measured {measured * 1e3:8.1f} ms; its "
              f"optimizer step predicted {p.time['optimizer'] * 1e3:6.1f} ms  measured {opt * 1e3:6.1f} ms")
    return rows


def _offload_report(rows, rank, cluster):
    """The offload's own cost both ways, and the pick under a device memory that does not hold the whole
    optimizer."""
    base = rows[0]
    for lay, predicted, measured, name, *_ in rows[1:]:
        print(f"{name:<55} offload's cost predicted {(predicted - base[1]) * 1e3:6.1f} ms  measured "
              f"{(measured - base[2]) * 1e3:6.1f} ms")
    cap = (base[4].memory["total"] + rows[2][4].memory["total"]) / 2  # between no offload and half of it on the host
    small = dataclasses.replace(rank, memory_gib=cap / (1 - FRAGMENTATION) / 2 ** 30)  # (the planner's usable part)
    tight = dataclasses.replace(cluster, gpus=(small,) * cluster.size)
    fits = [r for r in rows if predict(r[5], r[0], tight).fits]
    pick, best = min(fits, key=lambda r: r[1]), min(fits, key=lambda r: r[2])
    print(f"with {cap / 2 ** 20:.0f} MiB a rank ({len(fits)} of {len(rows)} runs fit): the planner's first "
          f"{pick[3]} measured {pick[2] * 1e3:.1f} ms = {pick[2] / best[2]:.3f}x the fastest that fits ({best[3]})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--semi-sync", action="store_true", help="price DiLoCo replicas against synchronous DP")
    ap.add_argument("--offload", action="store_true", help="price --optimizer-cpu-offload's fractions")
    a = ap.parse_args()
    if a.semi_sync:
        a.steps = max(a.steps, 17)  # (whole rounds of 8 after the first step)
    world = 1 if a.offload else WORLD
    gemm, bandwidth, overhead, link, latency, copy, optimizer = [statistics.median(v) for v in
                                                                 zip(*spawn(world, _calibrate, world))]
    rank = GPU("CPU-rank", 8, gemm, False, link, "gloo", 1.0, bandwidth, gemm, overhead, asynchronous=False,
               host_gbps=copy, host_step_gbps=optimizer, optimizer_gbps=optimizer)  # (one memory, one AdamW)
    cluster = Cluster((rank,) * world, world, {"CPU-rank": link}, link, {"intra": 1.0, "inter": 1.0}, latency)
    print(f"a CPU rank ({world} at once): {gemm * 1e3:.1f} GFLOP/s fp32 matmul, {bandwidth:.1f} GB/s add, "
          f"{overhead:.1f} us per small op; gloo all-reduce {link:.2f} GB/s, {latency:.0f} us for one element; "
          f"copy {copy:.1f} GB/s, AdamW {optimizer:.1f} GB/s")
    rows, model = [], OFFLOAD_MODEL if a.offload else MODEL
    variants = semi_sync_variants() if a.semi_sync else ((lay, []) for lay in layouts())
    if a.offload:
        rows = _offload_rows(model, cluster, a.steps)
    for lay, extra in () if a.offload else variants:
        try:
            args = validated(model + extra, lay, world)
        except ConfigError:
            continue
        p = predict(args, lay, cluster)
        measured = statistics.median(spawn(world, _run, model + extra + lay.flags(), a.steps, world))
        name = lay.describe() + (f" DiLoCo R={extra[3]} H={extra[5]}" if extra else "")
        rows.append((lay, p.step_time_s, measured, name, p, args))
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
    if a.offload:
        _offload_report(rows, rank, cluster)


if __name__ == "__main__":
    main()
