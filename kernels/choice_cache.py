"""The race's measurements on disk, kept as Triton keeps its builds, so a later process on the same kind of device
with the same torch and triton reads them instead of timing again (choice.py).

Where: $MEGALITE_KERNEL_CACHE, else ~/.cache/megalite/kernels; one JSON file per (device name, torch version,
triton version), named choice-<device>-torch<version>-triton<version>.json (characters other than letters,
digits, '.', '+' and '-' become '_'):
    {"format": 1, "device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0",
     "times": {"rms_norm bfloat16 8192x4096": [0.41, 0.58], ...}}    (milliseconds: [Triton, fallback])
Only measured times are kept (a path that failed to run is timed again by the next process). A write re-reads the
file, adds its entries and replaces the file atomically (a temporary file in the same directory, then
os.replace): a reader never sees half a file, and ranks of one node writing at once lose at most each other's
newest entries, which a later process times again. A file that is not that (truncated, corrupt, another format)
is ignored with one line on stderr and replaced at the next write; an unwritable directory is one line too, and
the run goes on with its decisions in memory.
"""
import json
import math
import os
import re
import sys
import tempfile

import torch
import triton

ENV = "MEGALITE_KERNEL_CACHE"
FORMAT = 1
_memo = {}  # path -> {label: (triton_ms, torch_ms)}, read once per process
_warned = set()  # (path, 'read' or 'write') already said: one line each per process


def directory():
    return os.environ.get(ENV) or os.path.join(os.path.expanduser("~"), ".cache", "megalite", "kernels")


def device_name(device):
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def path(device):
    name = f"choice-{device_name(device)}-torch{torch.__version__}-triton{triton.__version__}.json"
    return os.path.join(directory(), re.sub(r"[^A-Za-z0-9.+-]", "_", name))


def lookup(device, label):
    """(triton_ms, torch_ms) measured for this class on this kind of device, or None."""
    return _entries(path(device)).get(label)


def store(device, label, times):
    """Keep a class's measured times (both finite) in memory and on disk."""
    if not all(math.isfinite(t) for t in times):
        return
    p = path(device)
    _entries(p)[label] = tuple(times)
    try:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        on_disk = _read(p, quiet=True) or {}
        on_disk.update(_memo[p])
        body = {"format": FORMAT, "device": device_name(device), "torch": torch.__version__,
                "triton": triton.__version__, "times": {k: list(v) for k, v in sorted(on_disk.items())}}
        fd, tmp = tempfile.mkstemp(prefix=".choice-", suffix=".tmp", dir=os.path.dirname(p))
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(body, f, indent=1)
            os.replace(tmp, p)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        _say(p, "write", f"megalite kernels: cannot write the kernel-choice cache {p} ({e.strerror or e}); "
                "this run's decisions are kept in memory only")


def forget():
    """Drop what was read (tests: the next lookup reads the file again)."""
    _memo.clear()
    _warned.clear()


def _entries(p):
    if p not in _memo:
        _memo[p] = _read(p) or {}
    return _memo[p]


def _read(p, quiet=False):
    """The file's times, or None for no file; a bad file is one line on stderr (unless quiet) and None."""
    try:
        with open(p) as f:
            body = json.load(f)
        if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(body.get("times"), dict):
            raise ValueError("not a kernel-choice cache of format 1")
        times = {}
        for label, pair in body["times"].items():
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, (int, float)) for t in pair)):
                raise ValueError(f"entry {label!r} is not [triton_ms, torch_ms]")
            times[label] = (float(pair[0]), float(pair[1]))
        return times
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnicodeDecodeError) as e:  # (json's decode error is a ValueError)
        if not quiet:
            why = (str(e).splitlines() or [type(e).__name__])[0][:120]
            _say(p, "read", f"megalite kernels: ignoring the kernel-choice cache {p} ({why}); "
                            "its classes are timed again")
        return None


def _say(p, kind, line):
    if (p, kind) not in _warned:
        _warned.add((p, kind))
        sys.stderr.write(line + "\n")
