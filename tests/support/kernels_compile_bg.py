"""The sm_80/sm_90 build of every Triton kernel (tests/kernels/gpu_compile.py) as a background
process of the lowest CPU priority, started when the suite starts (tests/conftest.py) and
waited for by tests/kernels/test_gpu_compile.py and tests/kernels/test_sm90_report.py, which
read the one build (its SASS statistics included)."""

import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/


def command(out_json):
    # one process per arch, side by side (a process reports one target)
    return [sys.executable, os.path.join(HERE, "kernels", "gpu_compile.py"), "--arch", "90", "80", "--json", out_json]


def start():
    """(process or None, results path, start time); None when this triton has no NVIDIA backend."""
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        return None, None, time.time()
    d = tempfile.mkdtemp(prefix="megalite_gpu_compile_")
    out = os.path.join(d, "results.json")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real build, not the interpreter
    # the checkout's kernels, installed or not (a GPU machine runs the suite from a bare copy)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(HERE), env.get("PYTHONPATH")) if p)
    # output to a file, not a pipe nobody reads until the end (a full pipe would stall the build)
    with open(os.path.join(d, "log.txt"), "w") as log:
        proc = subprocess.Popen(command(out), env=env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.nice(19))
    return proc, out, time.time()


def log_of(out_json):
    with open(os.path.join(os.path.dirname(out_json), "log.txt")) as f:
        return f.read()


def results(config):
    """(gpu_compile.py's results, seconds since the build started): the suite's build, or one started
    here and kept on the pytest config for the next caller (a test module run alone). Results None when
    this triton has no NVIDIA backend."""
    if getattr(config, "megalite_gpu_compile", None) is None:
        config.megalite_gpu_compile = start()
    proc, out, t0 = config.megalite_gpu_compile
    if proc is None:
        return None, 0.0
    try:
        proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if not os.path.exists(out):
        raise RuntimeError(f"compile driver failed (exit {proc.returncode}):\n{log_of(out)[-6000:]}")
    with open(out) as f:
        return json.load(f), time.time() - t0
