"""FP8 training's step time against bf16, side by side in one run (issue 65): megalite's whole training step
(benchmarks/mfu.py's `run`: setup + train_step, mock data, TP=PP=DP=1) in bf16, then with --fp8-format hybrid
under each recipe (tensorwise, delayed with Megatron's Llama-3 history of 1024 and max, rowwise); prints step
time, TFLOP/s/GPU by Megatron's formula and the ratio to bf16.

    python benchmarks/fp8_training.py                 # on a CUDA GPU (H100/H200: cuBLASLt's FP8 GEMM)
    python benchmarks/fp8_training.py --cpu-smoke     # tiny shapes on CPU: the script runs (FP8 is slower there:
                                                      # its GEMM is a reference implementation)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402

import torch  # noqa: E402

from mfu import CONFIGS, run  # noqa: E402

VARIANTS = [("bf16", "--bf16"),
            ("fp8 hybrid tensorwise", "--bf16 --fp8-format hybrid --fp8-recipe tensorwise"),
            ("fp8 hybrid delayed (1024, max)", "--bf16 --fp8-format hybrid --fp8-amax-history-len 1024 "
                                               "--fp8-amax-compute-algo max"),
            ("fp8 hybrid rowwise", "--bf16 --fp8-format hybrid --fp8-recipe rowwise"),
            ("fp8 e4m3 blockwise (no kernel yet)", "--bf16 --fp8-format e4m3 --fp8-recipe blockwise")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["llama-1.7b"])
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args()
    if a.cpu_smoke:
        a.configs, a.micro, a.steps = ["smoke"], 2, 4
    elif not torch.cuda.is_available():
        print("benchmarks/fp8_training.py needs a CUDA GPU (none here); --cpu-smoke checks the script on CPU")
        return
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (reference FP8 GEMM: no speed)"
    print(f"device: {device} | torch {torch.__version__}")
    print(f"{'config':<12}{'variant':<34}{'step ms':>9}{'TFLOP/s/GPU':>13}{'vs bf16':>9}")
    for name in a.configs:
        base = None
        for label, extra in VARIANTS:
            flops, step = run(CONFIGS[name], a.micro, a.steps, extra)
            base = base or step
            print(f"{name:<12}{label:<34}{step * 1e3:>9.1f}{flops / 1e12:>13.3f}{base / step:>8.2f}x")


if __name__ == "__main__":
    main()
