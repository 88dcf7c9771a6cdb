"""gloo's event-loop threads at the lowest CPU priority (megalite.parallel.launch.gloo_loops_yielding) against their
default priority, side by side: N CPU ranks on this machine's cores, each step a few small matmuls (a tiny
layer's work) and one 4 KB all-reduce, the pattern of the test suite's worlds. Prints seconds per arm and the ratio.
Then what the lowering adds to the making of a group: milliseconds per group with and without it, each rank making
--groups groups (a rank of the suite's worlds makes 10-40 per layout; the threads it already has are not read).

    python benchmarks/gloo_loop.py [--steps 500] [--worlds 2 4 8] [--groups 60]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_ranks import spawn  # noqa: E402


def _steps(lowered, steps):
    import torch
    import torch.distributed as dist

    from megalite.parallel.launch import new_group
    group = new_group(list(range(dist.get_world_size()))) if lowered else dist.new_group()
    x, a, layer = torch.ones(1000), torch.randn(64, 64), torch.nn.Linear(64, 64)
    dist.all_reduce(x, group=group)
    dist.barrier(group=group)
    t = time.perf_counter()
    for _ in range(steps):
        for _ in range(5):
            a = torch.tanh(layer(a))
        dist.all_reduce(x, group=group)
    return time.perf_counter() - t


def _making(lowered, n):
    import torch.distributed as dist

    from megalite.parallel.launch import new_group
    make = new_group if lowered else dist.new_group
    groups, t = [], time.perf_counter()
    for _ in range(n):
        groups.append(make(list(range(dist.get_world_size()))))
    return (time.perf_counter() - t) / n * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--groups", type=int, default=60)
    a = p.parse_args()
    print(f"{os.cpu_count()} cores, {a.steps} steps of 5 64x64 layers + one 4 KB all-reduce; best of 2 runs per arm")
    print(f"{'ranks':>5} {'default s':>10} {'lowered s':>10} {'speed-up':>9}")
    for world in a.worlds:
        best = {}
        for _ in range(2):  # alternate the arms: the machine's drift falls on both
            for lowered in (False, True):
                t = max(spawn(world, _steps, lowered, a.steps))
                best[lowered] = min(best.get(lowered, t), t)
        print(f"{world:>5} {best[False]:>10.2f} {best[True]:>10.2f} {best[False] / best[True]:>8.2f}x")
    print(f"making {a.groups} groups per rank, ms per group (slowest rank, best of 2 runs per arm)")
    print(f"{'ranks':>5} {'plain':>10} {'lowered':>10} {'added':>9}")
    for world in a.worlds:
        best = {}
        for _ in range(2):
            for lowered in (False, True):
                t = max(spawn(world, _making, lowered, a.groups))
                best[lowered] = min(best.get(lowered, t), t)
        print(f"{world:>5} {best[False]:>10.2f} {best[True]:>10.2f} {best[True] - best[False]:>8.2f}")


if __name__ == "__main__":
    main()
