"""FP8 training's convergence against bf16 (issue 65): the README's main job (GPT, TP=2 x PP=2 on four ranks, the
built-in corpus) for 300 iterations in bf16 and under each FP8 recipe, one after the other in one run; prints each
run's validation loss at iterations 100, 200 and 300 and its final one relative to bf16's.

    python benchmarks/fp8_convergence.py [--iters 300] [--nproc 4]

On the 2-core CPU machine the FP8 GEMM is the fp32 product of the dequantized operands (tensor_parallel/fp8.py's
scaled_mm): the numerics, not the speed. (Measured at 5 minutes a run on oneDNN's FP8 primitive, before
2026-12-04.)"""

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN_JOB = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 256 "
            "--num-attention-heads 4 --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --lr 1e-3 "
            "--min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10 --log-interval 10 --eval-interval 100 "
            "--eval-iters 5 --bf16")
VARIANTS = [("bf16", ""),
            ("fp8 hybrid tensorwise", "--fp8-format hybrid --fp8-recipe tensorwise"),
            ("fp8 hybrid delayed (1024, max)", "--fp8-format hybrid --fp8-amax-history-len 1024 "
                                               "--fp8-amax-compute-algo max"),
            ("fp8 hybrid rowwise", "--fp8-format hybrid --fp8-recipe rowwise"),
            ("fp8 e4m3 blockwise", "--fp8-format e4m3 --fp8-recipe blockwise")]
VALID = re.compile(r"validation loss at (?:iteration\s+(\d+)|the end of training for val data) \| lm loss value: "
                   r"([0-9.E+-]+)")


def run(extra, iters, nproc):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           os.path.join(ROOT, "pretrain_gpt.py"), *MAIN_JOB.split(), "--train-iters", str(iters), *extra.split()]
    t0 = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    losses = {int(it) if it else "end": float(v) for it, v in VALID.findall(out.stdout)}
    return losses, time.time() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--nproc", type=int, default=4)
    a = ap.parse_args()
    marks = [i for i in range(100, a.iters + 1, 100)]
    print(f"# the README's main job, {a.iters} iterations, TP=2 x PP=2 on {a.nproc} ranks: validation lm loss")
    print("| run | " + " | ".join(f"it {i}" for i in marks) + " | end | end vs bf16 | minutes |")
    print("|---" * (len(marks) + 4) + "|")
    base = None
    for name, extra in VARIANTS:
        losses, secs = run(extra, a.iters, a.nproc)
        base = base or losses["end"]
        print(f"| {name} | " + " | ".join(f"{losses.get(i, float('nan')):.4f}" for i in marks) +
              f" | {losses['end']:.4f} | {100 * (losses['end'] / base - 1):+.2f}% | {secs / 60:.1f} |", flush=True)


if __name__ == "__main__":
    main()
