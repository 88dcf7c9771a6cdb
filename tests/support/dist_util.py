"""Run a test body on N CPU ranks.

`run_on_ranks(fn, world_size, *args)` starts N processes, each with torch.distributed
initialised (shared-memory groups, see BACKEND; one thread), calls `fn(*args)` and returns the list of the
ranks' return values. A rank's exception surfaces with its traceback; a run that exceeds
`timeout` is killed and reported (with where each hung rank waited) instead of hanging the suite.
`start_on_ranks` (same arguments) starts the world and returns at once; its `.result()` is
run_on_ranks' return value, so worlds that do not depend on each other run side by side.

The ranks are forked from the test process: a spawned rank re-imports torch, megalite and the
test module (seconds per rank on the 2-core machine, most of the suite's time). Each rank then
starts as a spawned one would: its own parallel state torn down, kernel backend "auto", freshly
seeded random streams, one thread. Where the test process has initialised CUDA (the GPU machine), a fork
could not use it, so the ranks are spawned.

The worlds' groups live in shared memory (tests/support/shm_group.py) unless `backend="gloo"` or
MEGALITE_TEST_BACKEND=gloo
says otherwise: a world's time is its collectives' latency, and gloo's is 6-25x the shared-memory groups' with 4-8
ranks on 2 cores (benchmarks/shm_vs_gloo.py). gloo stays where megalite names it (its checkpoint writer's group, the
asynchronous outer optimizer's), in the torchrun jobs, and in the tests of gloo itself.

Where gloo runs, the ranks connect their gloo pairs lazily (TORCH_GLOO_LAZY_INIT: a group's pair at its first use).
Each rank creates every group of a layout's grid and a world runs many layouts: eager connections cost 0.29 s per
grid at 8 ranks on the 2-core machine (0.10 s lazily), about a quarter of a short layout's time; the collectives and
what they compute are the same. A lazy pair exchanges addresses through the store at first use, possibly after the
rank that would hold an env:// store has ended, and a store served by a thread of the test process would make every
later fork unsafe (a rank forked while that thread holds a lock hangs). So one store process serves the whole
session, as torchrun's agent does a job, and each world keys into it under its own prefix. torchrun jobs (users',
and the tests of the launcher) connect eagerly as before.

`capability=` runs the ranks on another machine than the test process. Machines of the CI kind round
differently on two axes: ATen's vectorised kernels by its CPU capability (AVX-512 on some, AVX2 on others), and
torch's half-precision matrix products by oneDNN's instruction set (AMX, AVX-512 with BF16, AVX-512, AVX2),
whatever ATen's capability is. Such ranks emulate the whole machine, both axes as it would set them
(OTHER_MACHINE: ATEN_CPU_CAPABILITY=<capability> with ONEDNN_MAX_CPU_ISA=AVX2; one axis alone is a machine
that does not exist, and torch can crash in it). Each axis is fixed at a process's first use (ATen's at its
first operation, oneDNN's at its first primitive), so such ranks are forked from a fork server started once
under both variables, with torch and megalite already imported (no oneDNN primitive yet); `fn` and its
arguments then travel pickled (module-level functions only). `OTHER_CAPABILITY` is the next capability below
this process's (AVX512 -> avx2: an AVX2 machine; AVX2 -> default: the portable extreme; None where there is
none below), which the parity harness uses for every fp32 world and for its half-precision layouts made
`elsewhere`, so each run of the suite checks two machines' rounding.
Which axis each comparison is robust to: tests/support/parity_check.py (fp32: both, the later steps by the measured
spread; half precision: the layout and its reference share both axes, the later steps held to rounding twins
measured on that machine).
"""

import atexit
import faulthandler
import itertools
import os
import pickle
import random
import shutil
import signal
import socket
import tempfile
import time
import traceback

import numpy as np
import shm_group
import torch
import torch._dynamo  # noqa: F401  torch.optim's first optimizer imports it (3.5 s here): once, before the forks
import torch.distributed as dist
import torch.multiprocessing as mp

_BELOW = {"AVX512": "avx2", "AVX2": "default"}
OTHER_CAPABILITY = _BELOW.get(torch.backends.cpu.get_cpu_capability())
ONEDNN_ISA = {"avx2": "AVX2", "default": "AVX2"}  # oneDNN's instruction set on the machine of each capability
OTHER_MACHINE = None if OTHER_CAPABILITY is None else {"ATEN_CPU_CAPABILITY": OTHER_CAPABILITY,
                                                       "ONEDNN_MAX_CPU_ISA": ONEDNN_ISA[OTHER_CAPABILITY]}
# what the fork server imports before it forks ranks (the parity harness's world)
_PRELOAD = ["torch", "torch._dynamo", "numpy", "kernels", "megalite.training", "dist_util", "parity"]
_forkserver_capability = None
_IN_FORKSERVER = "DIST_UTIL_IN_FORKSERVER"  # set in the fork server's environment, so its ranks' too
# the worlds' backend: shared memory (tests/support/shm_group.py: collectives ~10x faster than gloo's at 4-8 ranks on 2
# cores); MEGALITE_TEST_BACKEND=gloo runs every world on gloo instead
BACKEND = os.environ.get("MEGALITE_TEST_BACKEND") or (shm_group.NAME if shm_group.available() else "gloo")
atexit.register(shm_group.remove_leftovers)  # (forked ranks leave through os._exit: only the test process runs it)
STACKS_SIGNAL = signal.SIGUSR1  # a rank past its world's timeout writes its Python stacks, then is killed


def _forkserver_context(capability):
    """The fork server's context, its server started under ATEN_CPU_CAPABILITY=capability (once:
    multiprocessing keeps one fork server per process)."""
    global _forkserver_capability
    from multiprocessing import forkserver
    ctx = mp.get_context("forkserver")
    if _forkserver_capability is None:
        ctx.set_forkserver_preload(_PRELOAD)
        machine = {"ATEN_CPU_CAPABILITY": capability, "ONEDNN_MAX_CPU_ISA": ONEDNN_ISA[capability], _IN_FORKSERVER: "1"}
        old = {k: os.environ.get(k) for k in machine}
        os.environ.update(machine)  # the server inherits the environment as it starts
        try:
            forkserver.ensure_running()
        finally:
            for k, v in old.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
        _forkserver_capability = capability
    assert _forkserver_capability == capability, \
        f"one fork server per process: it runs {_forkserver_capability}, not {capability}"
    return ctx


def scratch_dir(prefix):
    """A directory for the test process's lifetime (a module's layouts name it at import): removed at its exit,
    not left in the temporary directory by every suite run. A rank that imports the module (a fork server's,
    unpickling its function) gets a name only: it leaves through os._exit, which skips atexit, and the layouts it
    runs carry the test process's path."""
    if os.environ.get(_IN_FORKSERVER):
        return os.path.join(tempfile.gettempdir(), f"{prefix}rank-{os.getpid()}-unused")
    d = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, d, True)
    return d


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_store_port = None
_world_ids = itertools.count()


def _serve_store(parent, conn):
    """The session's store process (see the module's text): serves until the test process is gone."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    conn.send(store.port)
    while os.getppid() == parent:  # a killed test process runs no atexit: the store still ends with it
        time.sleep(1.0)


def _session_store_port():
    global _store_port
    if _store_port is None:
        ctx = mp.get_context("fork")  # no threads here to inherit a held lock from: the store's are its own
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_serve_store, args=(os.getpid(), send), daemon=True)
        proc.start()
        _store_port = recv.recv()
    return _store_port


def _worker(rank, world_size, store_at, fn, args, out_dir, capability=None, backend="gloo"):
    if capability is not None:  # (a fork server's rank) check that ATen really rounds as asked; oneDNN's set below
        got = torch.backends.cpu.get_cpu_capability()
        assert got == capability.upper(), f"rank {rank} runs ATen capability {got}, not {capability}"
        isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
        assert isa == ONEDNN_ISA[capability], f"rank {rank} runs oneDNN's {isa}, not {ONEDNN_ISA[capability]}"
    stacks = open(os.path.join(out_dir, f"{rank}.stacks"), "w")  # (kept open: faulthandler writes it at a signal)
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True)
    port, prefix = store_at
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), TORCH_GLOO_LAZY_INIT="1")
    torch.set_num_threads(1)
    torch.seed()  # fresh, as a new process: a fork would share the test process's streams
    np.random.seed()
    random.seed()

    import kernels
    from megalite import parallel_state as ps
    from megalite.parallel.launch import gloo_loops_yielding
    kernels.set_backend("auto")
    result = None
    try:
        if dist.is_initialized():
            raise RuntimeError("the test process left torch.distributed initialised: a forked rank cannot start "
                               "its own group; destroy it in the test that made it")
        ps.destroy_model_parallel()
        store = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False))
        with gloo_loops_yielding():  # as megalite's own initialisation does (megalite.parallel.launch)
            shm_group.register()
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        result = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        result = ("error", traceback.format_exc())
    finally:
        ps.destroy_model_parallel()
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        if dist.is_initialized():
            dist.destroy_process_group()


class Ranks:
    """A world started by start_on_ranks; result() waits for it (run_on_ranks' return value or error)."""

    def __init__(self, fn, world_size, args, timeout, capability, backend):
        if torch.cuda.is_initialized():
            ctx, capability = mp.get_context("spawn"), None
        elif capability is not None:
            ctx = _forkserver_context(capability)
        else:
            ctx = mp.get_context("fork")
        store_at = (_session_store_port(), f"world{next(_world_ids)}/")
        self.world_size, self.timeout = world_size, timeout
        self.out_dir = tempfile.mkdtemp()
        self.procs = [ctx.Process(target=_worker,
                                  args=(r, world_size, store_at, fn, args, self.out_dir, capability, backend))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.deadline = time.monotonic() + timeout

    def result(self):
        try:
            return self._collect()
        finally:
            shutil.rmtree(self.out_dir, ignore_errors=True)

    def _collect(self):
        procs, world_size, out_dir, timeout = self.procs, self.world_size, self.out_dir, self.timeout
        for p in procs:
            p.join(max(0.0, self.deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        deadline_hit = bool(hung)
        if deadline_hit:
            for r in hung:
                os.kill(procs[r].pid, STACKS_SIGNAL)
            dumps, until = [os.path.join(out_dir, f"{r}.stacks") for r in hung], time.monotonic() + 2.0
            while time.monotonic() < until and not all(os.path.getsize(d) for d in dumps):
                time.sleep(0.05)
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join()
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(out_dir, f"{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {r} raised:\n{value}")
            results.append(value)
        if deadline_hit:
            where = [f"rank {r} waited in:\n{own_stacks(os.path.join(out_dir, f'{r}.stacks'))}" for r in hung]
            errors[:0] = [f"timed out after {timeout}s (a hang?)"] + where
        if errors:
            raise AssertionError("\n".join(errors))
        return results


def own_stacks(path):
    """A faulthandler dump (a file) cut to the threads in megalite or the tests (not idle helper threads)."""
    blocks = open(path).read().split("\n\n") if os.path.exists(path) else ["(no dump)"]
    return "\n".join(b for b in blocks if "/megalite/" in b or "/tests/" in b) or blocks[0]


def start_on_ranks(fn, world_size, *args, timeout=180, capability=None, backend=None):
    """run_on_ranks without the wait: the world starts now, `.result()` waits for it and returns
    (or raises) what run_on_ranks would. Worlds that do not depend on each other can so run side
    by side (a world whose ranks wait on each other leaves a core idle on the 2-core machine)."""
    return Ranks(fn, world_size, args, timeout, capability, backend or BACKEND)


def run_on_ranks(fn, world_size, *args, timeout=180, capability=None, backend=None):
    return start_on_ranks(fn, world_size, *args, timeout=timeout, capability=capability, backend=backend).result()


def rel_err(a, b):
    """max |a - b| / max |b|: the error relative to the reference tensor's scale (DESIGN's
    "relative error"); an element much smaller than the largest is judged on that scale."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
