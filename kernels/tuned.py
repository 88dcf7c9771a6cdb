"""Launch configurations from a committed table; no autotuning at run time unless asked.

A kernel with a choice of launch parameters (rows per program, warps, pipeline stages; for attention
BLOCK_M, BLOCK_N, warps, stages) asks at each launch

    cfg = tuned.config(kernel, device, dtype, bucket, default)

and gets the entry of tuned_configs.json for (device name, dtype, kernel, bucket) merged over `default`,
or `default` itself when the table has none: always on CPU and under the interpreter, and on any GPU
model nobody has tuned. The table is data in the wheel (setup.py's package_data), rewritten on a GPU by
`benchmarks/tune_kernels.py`; a lookup is one dict access after the first (cached per key). Every
rank reads the same file, so every rank of a job launches the same configurations.

MEGALITE_AUTOTUNE=1 (read at each miss, so it may be set before or after import) makes a miss on a CUDA
device tune that key there and then: each valid configuration of the kernel's registered space is timed
with triton.testing.do_bench on the space's representative inputs and the fastest is kept for the rest of
the process (not written to the table: run tune_kernels.py for that). Its choice may differ between
ranks, and a norm's weight gradient rounds differently under different configurations, so TP replicas of
a norm weight could drift: use it for one-process experiments, the table for jobs.

How a kernel plugs in (benchmarks/tune_kernels.py and the autotune path read nothing else):

    SPACE = tuned.register(tuned.Space(
        kernel="rms_norm.bwd",                  # the table's key; one per launch whose config is chosen
        params={"ROWS": (1, 2, 4), "num_warps": (4, 8, 16), "num_stages": (2, 3, 4)},  # the grid searched
        buckets=(1024, 2048, 4096, 8192),       # what tune_kernels.py measures (head dims for attention)
        default=lambda bucket, dtype: {...},    # the built-in config: what config() falls back to
        make=make_runner,                       # make(bucket, dtype, device, small=False) -> run(cfg): runs
                                                # the kernel once with cfg on representative inputs it
                                                # allocated (small: a few rows, for the interpreter)
        valid=lambda bucket, dtype, cfg: True,  # optional: prunes configurations that cannot build or fit
        dtypes=(torch.bfloat16,),               # optional: the dtypes tune_kernels.py measures by default
    ))

`make` allocates once per (bucket, dtype) and returns a closure, so the timing sees only the kernel; its
inputs should be the size the kernel meets in training (past L2 for the memory-bound ones).
Configurations are plain dicts of JSON scalars; the kernel's launch code interprets them (so a config
may carry any name the kernel understands: BLOCK_M, PROGRAMS_PER_SM, ...). Entries of the table with
names the default does not have are dropped with one line (a stale table never crashes a run).
"""
import itertools
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned_configs.json")
ENV_AUTOTUNE = "MEGALITE_AUTOTUNE"


@dataclass(frozen=True)
class Space:
    kernel: str
    params: dict
    buckets: tuple
    default: Callable
    make: Callable
    valid: Callable = None
    dtypes: tuple = (torch.bfloat16,)
    notes: str = field(default="", compare=False)

    def candidates(self, bucket, dtype):
        """Every valid configuration of the grid: the default first (the baseline a search must beat), then
        the rest by how many parameters they change, so a search cut short by its budget has looked around
        the default first."""
        base = dict(self.default(bucket, dtype))
        out = []
        names = list(self.params)
        for values in itertools.product(*(self.params[n] for n in names)):
            cfg = {**base, **dict(zip(names, values))}
            if cfg != base and cfg not in out and (self.valid is None or self.valid(bucket, dtype, cfg)):
                out.append(cfg)
        out.sort(key=lambda c: sum(c[n] != base.get(n) for n in names))  # stable: grid order within a distance
        return [base] + out


_spaces = {}
_cache = {}  # (kernel, device key, dtype name, bucket) -> config
_table = None
_forced = threading.local()
_lock = threading.Lock()


def register(space):
    """Declare a kernel's search space (at its module's import); returns it."""
    _spaces[space.kernel] = space
    return space


def spaces():
    """{kernel: Space} of every registered kernel (the kernel modules must have been imported)."""
    return dict(_spaces)


def dtype_key(dtype):
    return str(dtype).replace("torch.", "")


def device_name(device):
    """The table's device key: torch's CUDA device name ("NVIDIA H200"); None for anything else."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device.index if device.index is not None else torch.cuda.current_device())


def load_table(path=None):
    """The table as stored: {"devices": {name: {"configs": {dtype: {kernel: {bucket: cfg}}}, ...}}}."""
    path = path or TABLE_PATH
    try:
        with open(path) as f:
            table = json.load(f)
        if not isinstance(table.get("devices"), dict):
            raise ValueError("no 'devices' object")
        return table
    except FileNotFoundError:
        return {"devices": {}}
    except (ValueError, AttributeError) as e:  # a broken table must not stop training: defaults everywhere
        print(f"kernels.tuned: ignoring {path} ({e}); using the built-in configurations", file=sys.stderr)
        return {"devices": {}}


def reset(table=None):
    """Forget cached lookups; `table` (a dict as load_table returns) replaces the file's (tests, the tuner)."""
    global _table
    with _lock:
        _cache.clear()
        _table = table


def lookup(table, device, dtype, kernel, bucket):
    entry = table["devices"].get(device, {}).get("configs", {}).get(dtype_key(dtype), {}).get(kernel, {})
    return entry.get(str(bucket))


class forced:
    """`with tuned.forced(kernel, cfg):` makes config() answer cfg for that kernel (the tuner's runs)."""

    def __init__(self, kernel, cfg):
        self.kernel, self.cfg = kernel, cfg

    def __enter__(self):
        if not hasattr(_forced, "map"):
            _forced.map = {}
        self.old = _forced.map.get(self.kernel)
        _forced.map[self.kernel] = self.cfg
        return self.cfg

    def __exit__(self, *exc):
        if self.old is None:
            _forced.map.pop(self.kernel, None)
        else:
            _forced.map[self.kernel] = self.old


def config(kernel, device, dtype, bucket, default):
    """The launch configuration of `kernel` for this device, dtype and bucket (see the module docstring)."""
    over = getattr(_forced, "map", {}).get(kernel)
    if over is not None:
        return over
    dev = torch.device(device)
    if dev.type != "cuda":  # CPU, meta (the sm_90 builds), the interpreter: never in the table
        return default
    key = (kernel, str(dev), dtype_key(dtype), bucket)
    cfg = _cache.get(key)
    if cfg is None:
        cfg = _resolve(kernel, dev, dtype, bucket, default)
        _cache[key] = cfg
    return cfg


def _resolve(kernel, dev, dtype, bucket, default):
    global _table
    with _lock:
        if _table is None:
            _table = load_table()
        table = _table
    row = lookup(table, device_name(dev), dtype, kernel, bucket)
    if row is not None:
        unknown = sorted(set(row) - set(default))
        if unknown:
            print(f"kernels.tuned: {kernel} {dtype_key(dtype)} bucket {bucket}: table entry names {unknown}, "
                  f"which this kernel does not take; using the built-in configuration", file=sys.stderr)
            return default
        return {**default, **row}
    if os.environ.get(ENV_AUTOTUNE, "0") not in ("", "0") and kernel in _spaces:
        return autotune(_spaces[kernel], bucket, dtype, dev)[0]
    return default


def autotune(space, bucket, dtype, device, budget_s=None, timer=None, small=False, limit=None):
    """(best config, its ms, default's ms, configs timed) for one key: each of space.candidates timed by
    `timer(fn) -> ms` (default: triton.testing.do_bench, 20 ms of calls after 5 of warm-up, the L2 flushed
    between calls as training's neighbours would). Stops after budget_s seconds or `limit` configurations,
    keeping the best so far (the default is always timed: it comes first)."""
    import time

    if timer is None:
        from triton.testing import do_bench

        def timer(fn):
            return do_bench(fn, warmup=5, rep=20)
    start = time.perf_counter()
    run = space.make(bucket, dtype, device, small=small)
    best, best_ms, default_ms, timed = None, float("inf"), float("nan"), 0
    for i, cfg in enumerate(space.candidates(bucket, dtype)[:limit]):
        if budget_s is not None and i and time.perf_counter() - start > budget_s:
            break
        try:
            ms = timer(lambda: run(cfg))
        except Exception as e:  # a configuration that fails to build or launch here is skipped
            print(f"kernels.tuned: {space.kernel} bucket {bucket} {cfg}: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:160] if str(e) else ''}", file=sys.stderr)
            continue
        timed += 1
        if i == 0:
            default_ms = ms
        if ms < best_ms:
            best, best_ms = cfg, ms
    return (best or space.candidates(bucket, dtype)[0]), best_ms, default_ms, timed
