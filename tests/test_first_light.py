"""benchmarks/first_light.py, the command a lent GPU runs first, rehearsed here: without CUDA it stops at
once naming the missing GPU, and each of its steps' scripts runs on CPU shapes (what they measure needs
the GPU; that they run, import and parse their own output does not)."""

import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _py(*argv, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: first-light would run")
def test_without_a_gpu_it_stops_at_once(tmp_path):
    start = time.time()
    r = _py("benchmarks/first_light.py", "--out", str(tmp_path / "report"))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "first-light needs a CUDA GPU" in r.stderr and "nothing was run" in r.stderr
    assert time.time() - start < 30 and not (tmp_path / "report").exists()


def test_its_steps_run_on_cpu_shapes():
    for argv in (["benchmarks/first_light_kernels.py", "attention", "--cpu-smoke"],
                 ["benchmarks/first_light_kernels.py", "fp8", "--cpu-smoke"],
                 ["benchmarks/first_light_mfu.py", "--cpu-smoke"], ["benchmarks/first_light.py", "--step", "selfcheck"]):
        r = _py(*argv)
        assert r.returncode == 0, r.stdout + r.stderr
        summary = [ln for ln in r.stdout.splitlines() if ln.startswith("SUMMARY ")]
        assert len(summary) == 1 and "nothing ran" not in summary[0], r.stdout
