"""A real GPT's step under 1F1B and ZB-H1 (--pipeline-schedule zb-h1) side by side: `pretrain_gpt.py` on
--pp CPU ranks (gloo, one thread each, torchrun), mock data, the same model and batch; the arms alternate so the
machine's drift falls on both. Prints the median time per iteration of each (the first iterations, warm-up, left
out), the ratio, and the bubble theory's ratio (1F1B (m+p-1)(F+B+W) against ZB-H1's 3m+p-1 units; F = B = W).

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
    got = {"1f1b": [], "zb-h1": []}
    for _ in range(a.rounds):
        for schedule in got:
            got[schedule] += _iteration_ms(schedule, a)
    one, zb = (statistics.median(got[s]) for s in ("1f1b", "zb-h1"))
    p, m = a.pp, a.micro_batches
    print(f"GPT {a.layers} layers, hidden {a.hidden}, seq {a.seq}, micro-batch {a.micro}, {m} micro-batches, "
          f"PP{p} on {os.cpu_count()} cores (gloo, 1 thread a rank); median of {len(got['1f1b'])} iterations each")
    print(f"{'schedule':<8}{'ms / iteration':>16}")
    print(f"{'1f1b':<8}{one:>16.1f}\n{'zb-h1':<8}{zb:>16.1f}")
    print(f"speed-up zb-h1 / 1f1b: {one / zb:.3f} (theory with F = B = W and no overhead: "
          f"{3 * (m + p - 1) / (3 * m + p - 1):.3f})")


if __name__ == "__main__":
    main()
