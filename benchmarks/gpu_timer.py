"""Device time of one call of a function, without the host's dispatch in it (benchmarks/kernels.py's timer).

    ms, how = call_ms(fn)      # how: "graph", "queued" or "wall" (CPU)

A memory-bound kernel runs in 20-80 us; one call timed between two CUDA events on an idle GPU also holds the
host's work for it (the autograd Function, the allocator, Triton's launcher), which is what made rms_norm's
forward measure slower than layer_norm's though it does strictly less. Here, on CUDA:
  1. fn runs once to warm up (builds, self-checks, tuning lookups: none of it is measured);
  2. `calls` calls (enough for ~20 ms) are captured into one CUDA graph, which is replayed `reps` times, each
     between two events, synchronised: the median replay / calls. A replay launches no Python: what it
     measures is the kernels and the gaps between them on the device;
  3. a fn that cannot be captured (a host sync inside, torch.optim's CPU step counter) is timed instead as
     `calls` calls queued behind a GPU sleep long enough for the host to enqueue them all, then the events:
     the same quantity, without a graph.
The L2 is not flushed between calls: every benchmarked tensor is past the L2, so a call evicts its
predecessor's data anyway, and a flush between calls would put a 256 MB memset beside each 30 us kernel.
On CPU (the --cpu-smoke): the median wall time of single calls; it checks the script, it measures nothing.
"""
import time

import torch

TARGET_MS = 20.0  # device time one measurement covers
REPS = 7
MAX_CALLS = 200
MAX_QUEUED = 40  # calls queued behind one sleep: their launches must fit the device's launch queue (~1024)


def call_ms(fn, reps=REPS):
    """(median milliseconds of one call of fn, how it was timed)."""
    if not torch.cuda.is_available():
        return _wall_ms(fn, reps), "wall"
    fn()  # warm-up: compiles, self-checks, allocator pools
    torch.cuda.synchronize()
    per_call, host = _estimate(fn)
    calls = max(1, min(MAX_CALLS, int(TARGET_MS / max(per_call, 1e-3))))
    try:
        return _graph_ms(fn, calls, reps), "graph"
    except Exception:  # noqa: BLE001 - not capturable: queue the calls behind a sleep instead
        torch.cuda.synchronize()
        calls = min(calls, MAX_QUEUED)
        return _queued_ms(fn, calls, reps, host), "queued"


def _wall_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def _estimate(fn, n=3):
    """(device ms a call, host ms to enqueue a call): rough, to size the measurement."""
    a, b = _events()
    a.record()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) * 1e3 / n
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n, host


def _graph_ms(fn, calls, reps):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # torch's capture recipe: warm up on a side stream first
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = _events()
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / calls)
    del graph
    return sorted(times)[len(times) // 2]


def _queued_ms(fn, calls, reps, host_ms):
    cycles = int(2e6 * 1.5 * host_ms * calls) + 200_000  # ~2 GHz: 1.5x the host's enqueue time, and a margin
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)  # the device waits here while the host enqueues every call
        a, b = _events()
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return sorted(times)[len(times) // 2]
