"""Benchmarks' multi-rank runs: `spawn(world, fn, *args, env=None, backend="gloo")` forks `world` CPU ranks with
torch.distributed initialised (one thread each; env: extra environment, e.g. LOCAL_WORLD_SIZE for "nodes"; backend:
gloo, or the test suite's shared-memory groups, tests/support/shm_group.py), calls `fn(*args)` in each and returns their
results. A failed rank stops the others and the script."""

import os
import pickle
import socket
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, fn, args, out_dir, env, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank % int(env.get("LOCAL_WORLD_SIZE", world))), **env)
    torch.set_num_threads(1)
    import torch.distributed as dist
    if backend != "gloo":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                        "tests", "support"))
        import shm_group
        shm_group.register()
    dist.init_process_group(backend, rank=rank, world_size=world)
    result = fn(*args)
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.barrier()  # (rank 0 holds the store: it stays until every rank is done with it)
    dist.destroy_process_group()


def spawn(world, fn, *args, env=None, backend="gloo"):
    port = _port()
    with tempfile.TemporaryDirectory() as d:
        procs = [mp.get_context("fork").Process(target=_rank, args=(r, world, port, fn, args, d, env or {}, backend))
                 for r in range(world)]
        for p in procs:
            p.start()
        while all(p.exitcode in (None, 0) for p in procs) and any(p.is_alive() for p in procs):
            time.sleep(0.2)
        for p in procs:  # a failed rank leaves its peers waiting in a collective
            if p.is_alive() and any(q.exitcode for q in procs):
                p.kill()
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        return [pickle.load(open(os.path.join(d, f"{r}.pkl"), "rb")) for r in range(world)]
