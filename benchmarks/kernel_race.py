"""The kernels' race on this GPU (kernels/choice.py): for a model's flags, the shape classes training setup decides
(megalite/training/kernel_choice.py), each Triton kernel's and its fallback's forward+backward time
(triton.testing.do_bench's median), the decision, and the line a training run prints.

    python benchmarks/kernel_race.py [--fresh] [--tp N] [MODEL FLAGS ...]
        default flags: the 1.7B config of benchmarks/mfu.py, bf16, micro-batch 1
        --fresh: time everything again (a scratch cache), not read $MEGALITE_KERNEL_CACHE
        --tp N: the classes of one rank of TP = N (with --sequence-parallel among the flags: its norm rows)

Without CUDA it says so and measures nothing.
"""

import os
import sys

# Run as a script, this folder comes first on sys.path and its kernels.py would shadow the `kernels` package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

DEFAULT = ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 --vocab-size 131072 "
           "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
           "--untie-embeddings-and-output-weights --bf16 --micro-batch-size 1").split()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--tp", type=int, default=1)
    ours, flags = p.parse_known_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernel_race.py needs a CUDA GPU (none found); nothing measured.")
        return
    if ours.fresh:
        os.environ["MEGALITE_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="kernel-race-")
    import kernels
    from kernels import choice, choice_cache
    from megalite.cli.parser import model_config, parse_args
    from megalite.training.kernel_choice import kernel_shapes
    flags = flags or DEFAULT
    args = parse_args(flags + ["--mock-data", "--lr", "1e-4", "--train-iters", "1", "--tensor-model-parallel-size",
                               str(ours.tp)], world_size=ours.tp)
    mcfg = model_config(args, args.vocab_size)
    shapes = kernel_shapes(mcfg, args.micro_batch_size, ours.tp, 1, torch.device("cuda", 0))
    kernels.set_kernel_choice("auto")
    start = time.perf_counter()
    decided = choice.decide(shapes)
    took = time.perf_counter() - start
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {__import__('triton').__version__}; "
          f"cache {choice_cache.path('cuda:0')}; decided in {took:.1f} s (self-checks and builds included)")
    print(f"{'class':<44}{'triton ms':>11}{'fallback ms':>13}{'ratio':>8}  choice")
    for cls, (tt, tf) in choice.times().items():
        if cls in decided:
            print(f"{cls.label():<44}{tt:>11.4f}{tf:>13.4f}{tf / tt:>7.2f}x  {decided[cls]}")
    print(choice.summary())


if __name__ == "__main__":
    main()
