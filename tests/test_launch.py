"""megalite.parallel.launch: the job's process groups. gloo's event-loop threads run at the lowest CPU priority
(a spinning loop would take the cores CPU ranks compute on); nothing else in the rank is lowered."""

import os

from dist_util import run_on_ranks


def _priorities():
    from megalite import parallel_state as ps
    from megalite.parallel.launch import GLOO_LOOP_NICE
    ps.initialize_model_parallel(2, 1)  # a TP group and a DP group per rank, besides the world's
    ps.new_group(backend="gloo")  # as checkpointing's side group
    got = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            got.append((f.read().strip(), os.getpriority(os.PRIO_PROCESS, int(tid))))
    return GLOO_LOOP_NICE, got


def test_gloo_event_loops_yield_and_nothing_else_does():
    for nice, threads in run_on_ranks(_priorities, 2, timeout=60, backend="gloo"):  # (what megalite runs)
        loops = [p for name, p in threads if name == "gloo_tcp_loop"]
        # the world's group, every group of the grid (TP, PP, DP, ...; at least 3), the extra one
        assert len(loops) >= 5 and set(loops) == {nice}, threads
        assert nice == 19
        assert all(p == 0 for name, p in threads if name != "gloo_tcp_loop"), threads


def test_a_loop_that_names_itself_late_is_still_lowered():
    """A new thread carries its creator's name until it first runs; on busy cores gloo's loop can name
    itself after its group is made (seen in the suite): the block waits for the names."""
    import ctypes
    import threading
    import time

    from megalite.parallel.launch import GLOO_LOOP_NICE, gloo_loops_yielding
    done, tid = threading.Event(), []

    def late_loop():
        time.sleep(0.05)  # gloo's loop, not yet scheduled when the group is made
        tid.append(threading.get_native_id())  # (before the name: the block may return the moment it is set)
        ctypes.CDLL(None).prctl(15, b"gloo_tcp_loop", 0, 0, 0)  # PR_SET_NAME, as the loop names itself
        done.wait(10)

    with gloo_loops_yielding():
        t = threading.Thread(target=late_loop)
        t.start()
    try:
        assert tid, "the block returned before the new thread named itself"
        assert os.getpriority(os.PRIO_PROCESS, tid[0]) == GLOO_LOOP_NICE
        assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # this thread keeps its priority
    finally:
        done.set()
        t.join()
