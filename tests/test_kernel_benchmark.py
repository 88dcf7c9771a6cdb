"""benchmarks/kernels.py, whose table first-light's bandwidth step parses, on CPU shapes: it runs, its rows carry the
columns that step reads (kernel, pass, % of copy, x eager) and say how they were timed; the timer on CPU is the wall
clock (on a GPU: CUDA-graph replays, benchmarks/gpu_timer.py), and nothing but the call is timed."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_kernel_table_on_cpu_shapes():
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "benchmarks/kernels.py", "--cpu-smoke", "--only", "layer_norm", "rms_norm",
                        "cross_entropy"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    table = [ln.split("|") for ln in r.stdout.splitlines() if ln.startswith("| ")]
    rows = [c for c in table if c[6].strip().endswith("%")]  # as first_light.step_bandwidth picks them
    got = {(c[1].strip(), c[3].strip()) for c in rows}
    assert got == {(k, p) for k in ("layer_norm", "rms_norm", "cross_entropy") for p in ("fwd", "fwd+bwd")}, r.stdout
    assert all(c[12].strip() == "wall" and float(c[4]) > 0 and float(c[8]) >= 0 for c in rows), r.stdout
    assert "Traceback" not in r.stderr and "#   " not in r.stdout, r.stdout + r.stderr  # no case failed


def test_the_timer_on_cpu_times_the_call():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from gpu_timer import call_ms
        calls = []
        ms, how = call_ms(lambda: calls.append(1), reps=5)
        assert how == "wall" and ms >= 0 and len(calls) == 6  # one warm-up, then the five timed
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
