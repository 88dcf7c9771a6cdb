"""Does a finished multi-rank job exit 0 every time? Runs the same short torchrun job N times.

    python benchmarks/clean_exit.py [--runs 20] [--nproc 4]

Prints each run's exit code and the count of clean exits. A job that printed "done" and then
lost a rank to SIGABRT at interpreter exit (background communication threads torn down
unordered) shows as a non-zero code here, as it would fail a torchrun launch.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = ("--mock-data --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
       "--train-iters 6 --log-interval 3 --eval-iters 0 --lr 1e-3 --num-workers 0").split()


def run_once(nproc, extra=()):
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               os.path.join(ROOT, "pretrain_gpt.py"), *JOB, *extra]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=d, timeout=300)
        return r.returncode, r.stdout + r.stderr


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--nproc", type=int, default=4)
    a = p.parse_args()
    codes, t0 = [], time.time()
    for i in range(a.runs):
        code, out = run_once(a.nproc)
        codes.append(code)
        tail = "" if code == 0 else " | " + " / ".join(ln for ln in out.splitlines()[-4:])[:300]
        print(f"run {i + 1:2d}: exit {code}{tail}", flush=True)
    print(f"{codes.count(0)} of {a.runs} runs exited 0 ({a.nproc} ranks, {time.time() - t0:.0f} s)")
    return 0 if codes.count(0) == a.runs else 1


if __name__ == "__main__":
    sys.exit(main())
