"""The job's torch.distributed process: initialised from torchrun's environment, with one timeout for
every group (--distributed-timeout-minutes) and a store that survives torchrun's restarts. Process
groups themselves are made by megalite.parallel_state through new_group."""

import os
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

_TIMEOUT = None  # --distributed-timeout-minutes, for every group


def initialize_distributed(backend=None, timeout_s=600):
    """Initialise torch.distributed from torchrun's environment if it is not yet; returns
    whether this call did (and so owns the teardown, see shutdown_distributed).

    NCCL when CUDA is present, gloo otherwise, unless `backend` says. `timeout_s` bounds
    every collective of every group: a dead or hung peer fails the survivors after it.
    """
    global _TIMEOUT
    _TIMEOUT = timedelta(seconds=timeout_s)
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ:
        return False  # plain `python script.py`: single process, no groups
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    with gloo_loops_yielding():
        dist.init_process_group(backend=backend, timeout=_TIMEOUT, **_restart_safe_store())
    return True


def _restart_safe_store():
    """Under torchrun the agent's store outlives a restart (--max-restarts), and the groups'
    keys are not per attempt: restarted ranks would read a dead peer's address and fail to
    connect. A prefix per attempt gives each restart clean keys."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=_TIMEOUT)
    return {"store": dist.PrefixStore(f"megalite/attempt_{attempt}/", store), "rank": rank, "world_size": world}


def new_group(ranks=None, backend=None):
    """A process group with the job's timeout (Megatron's --distributed-timeout-minutes)."""
    kw = {"timeout": _TIMEOUT} if _TIMEOUT is not None else {}
    with gloo_loops_yielding():
        return dist.new_group(ranks, backend=backend, **kw)


GLOO_LOOP_NICE = 19
_NAMING_WAIT_S = 1.0  # a thread names itself once it first runs: on busy cores that can take a while


def _thread_ids():
    """This process's thread ids; None where /proc is not there (not Linux)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return None


def _name(tid):
    """A thread's name, or None where it has ended."""
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


@contextmanager
def gloo_loops_yielding():
    """Around the making of a gloo group: its event-loop thread (named gloo_tcp_loop) gets the lowest
    CPU priority; nothing else in the process changes.

    During a collective that loop polls its sockets without sleeping (measured: about 400 wake-ups per
    4 KB all-reduce between 2 ranks). Where ranks share cores (CPU jobs with more ranks than cores: the
    test suite, a laptop), the spin takes the cores the ranks compute on: 2, 4 and 8 gloo ranks on 2 cores
    ran their steps 1.4x, 2.3x and 1.3x faster with it lowered (benchmarks/gloo_loop.py). At the lowest
    priority it still runs whenever a core is free. Linux only; elsewhere nothing changes.

    A new thread carries its creator's name until it first runs and names itself, which can be after the
    group is made; so the threads made inside the block are awaited (a bounded wait) until named."""
    before = _thread_ids()
    yield
    if before is None:
        return  # no /proc: nothing to lower
    unnamed = _name(threading.get_native_id())  # a new thread's name before it names itself
    # only the new threads' names are read: a rank with many groups has as many loop threads, and reading
    # every one's name for every group made cost more than making the groups (some 50 reads per group)
    new = {tid: None for tid in _thread_ids() - before}
    deadline = time.monotonic() + _NAMING_WAIT_S
    while True:
        new = {tid: _name(tid) for tid in new}
        if unnamed not in new.values() or time.monotonic() > deadline:
            break
        time.sleep(0.0002)
    for tid, name in new.items():
        if name == "gloo_tcp_loop":
            try:
                os.setpriority(os.PRIO_PROCESS, tid, GLOO_LOOP_NICE)
            except OSError:
                pass  # the thread ended, or this system refuses: the loop keeps its priority
