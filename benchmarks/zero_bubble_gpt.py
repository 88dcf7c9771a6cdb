"""A real GPT's step under 1F1B, ZB-H1 and ZB-V (--pipeline-schedule zb-h1|zbv) side by side: `pretrain_gpt.py`
on --pp CPU ranks (gloo, one thread each, torchrun), mock data, the same model and batch; the arms alternate so the
machine's drift falls on all. Prints the median time per iteration of each (the first iterations, warm-up, left
out), its ratio to 1F1B's, and the bubble theory's ratio with F = B = W: 1F1B (m+p-1)(F+B+W) against ZB-H1's 3m+p-1
units and ZB-V's 3m+(p-1)/2 (its units are half a stage's; exact at p = 2, 4 for m >= p).

    python benchmarks/zero_bubble_gpt.py [--pp 2 --micro-batches 8 --hidden 256 --layers 4 --rounds 2]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _iteration_ms(schedule, a):
    flags = (f"--mock-data --num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads 8 "
             f"--seq-length {a.seq} --max-position-embeddings {a.seq} --micro-batch-size {a.micro} "
             f"--global-batch-size {a.micro * a.micro_batches} --train-iters {a.iters} --lr 1e-4 --log-interval 1 "
             f"--eval-iters 0 --num-workers 0 --pipeline-model-parallel-size {a.pp} --pipeline-schedule {schedule} "
             "--vocab-size 4096 --tokenizer-type NullTokenizer")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.pp), "--master-port",
           str(a.port), os.path.join(ROOT, "pretrain_gpt.py")] + flags.split()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    times = [float(t) for t in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out.stdout + out.stderr)]
    if out.returncode or len(times) < a.iters:
        raise SystemExit(f"{schedule}: exit {out.returncode}\n{(out.stdout + out.stderr)[-3000:]}")
    return times[a.warmup:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=29517)
    a = ap.parse_args()
    if a.layers % (2 * a.pp):
        raise SystemExit(f"--layers {a.layers} must divide into 2 x --pp {a.pp} for zbv's two chunks a rank")
    got = {"1f1b": [], "zb-h1": [], "zbv": []}
    for _ in range(a.rounds):
        for schedule in got:
            got[schedule] += _iteration_ms(schedule, a)
    median = {s: statistics.median(t) for s, t in got.items()}
    p, m = a.pp, a.micro_batches
    theory = {"1f1b": 1.0, "zb-h1": (3 * m + p - 1) / (3 * (m + p - 1)),
              "zbv": (3 * m + (p - 1) / 2) / (3 * (m + p - 1))}
    print(f"GPT {a.layers} layers, hidden {a.hidden}, seq {a.seq}, micro-batch {a.micro}, {m} micro-batches, "
          f"PP{p} on {os.cpu_count()} cores (gloo, 1 thread a rank); median of {len(got['1f1b'])} iterations each")
    print(f"{'schedule':<8}{'ms / iteration':>16}{'x 1f1b':>9}{'theory (F = B = W, no overhead)':>34}")
    for s, ms in median.items():
        print(f"{s:<8}{ms:>16.1f}{ms / median['1f1b']:>9.3f}{theory[s]:>34.3f}")


if __name__ == "__main__":
    main()
