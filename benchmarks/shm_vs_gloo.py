"""The test suite's shared-memory groups (tests/support/shm_group.py) against gloo, side by side: N CPU ranks on this
machine's cores. Three patterns of the suite's worlds, each arm best of two alternated runs:
- steps: five 64x64 layers and one 4 KB all-reduce per step (a tiny layer's work between collectives);
- all-gather: bare 1 KB all-gathers into one tensor;
- messages: 4 KB isend / irecv ping-pong between rank pairs (a pipeline's boundary);
and the making of a group (a layout makes 10-40 per rank). gloo's loops are lowered as megalite does
(megalite.parallel.launch.new_group), as the suite ran them.

    python benchmarks/shm_vs_gloo.py [--steps 500] [--worlds 2 4 8]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_ranks import spawn  # noqa: E402

SHM = "megalite_shm"


def _group():
    import torch.distributed as dist

    from megalite.parallel.launch import new_group
    return new_group(list(range(dist.get_world_size())))


def _timed(body, steps):
    import torch.distributed as dist
    group = _group()
    body(group)  # (connections, first touches)
    dist.barrier(group=group)
    t = time.perf_counter()
    for _ in range(steps):
        body(group)
    return (time.perf_counter() - t) / steps * 1e3


def _steps(steps):
    import torch
    import torch.distributed as dist
    x, a, layer = torch.ones(1000), torch.randn(64, 64), torch.nn.Linear(64, 64)

    def body(group):
        nonlocal a
        with torch.no_grad():
            for _ in range(5):
                a = torch.tanh(layer(a))
        dist.all_reduce(x, group=group)
    return _timed(body, steps)


def _gathers(steps):
    import torch
    import torch.distributed as dist
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (as megalite.parallel_state)
    mine, out = torch.ones(256), torch.empty(256 * dist.get_world_size())
    return _timed(lambda group: gather(out, mine, group=group), steps)


def _messages(steps):
    import torch
    import torch.distributed as dist
    rank, x = dist.get_rank(), torch.ones(1024)
    peer = rank ^ 1

    def body(group):
        first, second = (dist.send, dist.recv) if rank % 2 == 0 else (dist.recv, dist.send)
        first(x, peer, group=group)
        second(x, peer, group=group)
    return _timed(body, steps)


def _making(n):
    t = time.perf_counter()
    groups = [_group() for _ in range(n)]
    return (time.perf_counter() - t) / len(groups) * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--groups", type=int, default=40)
    a = p.parse_args()
    print(f"{os.cpu_count()} cores; ms per step / call / group, slowest rank, best of 2 alternated runs per arm")
    print(f"{'pattern':<11} {'ranks':>5} {'gloo ms':>9} {'shm ms':>9} {'gloo / shm':>11}")
    for name, fn, arg in (("steps", _steps, a.steps), ("all-gather", _gathers, a.steps),
                          ("messages", _messages, a.steps), ("new group", _making, a.groups)):
        for world in a.worlds:
            best = {}
            for _ in range(2):  # alternate the arms: the machine's drift falls on both
                for backend in ("gloo", SHM):
                    t = max(spawn(world, fn, arg, backend=backend))
                    best[backend] = min(best.get(backend, t), t)
            print(f"{name:<11} {world:>5} {best['gloo']:>9.3f} {best[SHM]:>9.3f} {best['gloo'] / best[SHM]:>10.1f}x")


if __name__ == "__main__":
    main()
