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


def test_its_steps_run_on_cpu_shapes(capsys):
    """Each step's code on CPU shapes, in this process (the command's own processes are the first test's), printing
    its one summary line."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import first_light
        import first_light_kernels
        import first_light_mfu
        steps = (lambda: first_light_kernels.attention(True), lambda: first_light_kernels.fp8(True),
                 lambda: first_light_mfu.run_all(["--cpu-smoke"]), first_light.step_selfcheck)
        for step in steps:
            assert step() == 0
            summary = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("SUMMARY ")]
            assert len(summary) == 1 and "nothing ran" not in summary[0], summary
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
