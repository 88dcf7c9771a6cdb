"""Whole-training-step throughput on one GPU: TFLOP/s/GPU and MFU, fused kernels vs not.

For each config (GPT-2 124M at seq 1024; the 1.7B config of Megatron's H100 table: hidden
2048, 24 layers, 16 heads, seq 4096, vocab 131072), TP=PP=DP=1, bf16, it runs megalite's
real training step (setup + train_step from megalite.training, mock data) and prints
TFLOP/s/GPU by Megatron's FLOP formula, MFU against 989 TFLOP/s (H100/H200 dense bf16) and
against the bf16 matmul ceiling measured in the same run, and the ratio to the same model
with --no-fused-kernels.

    python benchmarks/mfu.py [--configs gpt2-124m llama-1.7b] [--steps 10]
    python benchmarks/mfu.py --cpu-smoke     # tiny shapes on CPU: checks the script runs
"""

import os
import sys

# Run as a script, this folder comes first on sys.path and its kernels.py would shadow the
# `kernels` package: put the repository root first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import time

import torch

from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.data.mock_dataset import MockGPTDataset
from megalite.planner.flops import num_floating_point_operations
from megalite.pipeline.schedules import pipeline_tensor_shape
from megalite.tensor_parallel import model_parallel_manual_seed
from megalite.batching.data_iterators import build_data_iterator, chunk_iterators
from megalite.config.data import LoaderConfig
from megalite.training.setup import setup
from megalite.training.step import train_step

import pretrain_gpt

PEAK = 989e12
CONFIGS = {
    "gpt2-124m": "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --vocab-size 50257",
    "llama-1.7b": "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 "
                  "--vocab-size 131072 --position-embedding-type rope --normalization RMSNorm --swiglu "
                  "--disable-bias-linear --untie-embeddings-and-output-weights",
    "smoke": "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 1000",
}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_ceiling(n=8192, reps=20):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n ** 3 * reps / (time.perf_counter() - t)


def run(config_flags, micro, steps, extra, profile=False, model_out=None):
    """(FLOP/s, median step seconds) of `steps` training steps; with profile=True, also the torch
    profiler's top kernels of one more step (a list of (name, self device ms) lines)."""
    argv = (config_flags + f" --mock-data --micro-batch-size {micro} --global-batch-size {micro} "
            f"--hidden-dropout 0 --attention-dropout 0 --train-iters {steps} --lr 1e-4 --eval-iters 0 --num-workers 0 "
            + extra).split()
    args = parse_args(argv, world_size=1)
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(args.seed)
    try:
        mcfg, tcfg, chunks, opt, sched = setup(args, pretrain_gpt.model_provider)
        ds = MockGPTDataset(steps * micro + micro, args.seq_length, args.vocab_size, args.seed)
        grid = ps.current_grid()
        its = chunk_iterators(build_data_iterator(ds, 0, LoaderConfig.of(args), grid=grid), 1, grid)
        shape = pipeline_tensor_shape(mcfg, micro, ps.current_grid())
        times = []
        for i in range(steps):
            sync()
            t = time.perf_counter()
            train_step(pretrain_gpt.forward_step, its, chunks, opt, 1, shape, mcfg.params_dtype)
            sched.step()
            sync()
            times.append(time.perf_counter() - t)
        if model_out is not None:
            model_out.update(mcfg=mcfg, vocab=chunks[0].module.padded_vocab_size)
        step = sorted(times[2:])[len(times[2:]) // 2] if len(times) > 3 else min(times)
        flops = num_floating_point_operations(mcfg, micro, chunks[0].module.padded_vocab_size)
        if profile:
            from torch.profiler import ProfilerActivity, profile as torch_profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with torch_profile(activities=acts) as prof:
                sync()
                t = time.perf_counter()
                train_step(pretrain_gpt.forward_step, its, chunks, opt, 1, shape, mcfg.params_dtype)
                sync()
                wall = time.perf_counter() - t
            return flops / step, step, [step_device_time(prof, wall, step)] + top_kernels(prof)
        return flops / step, step
    finally:
        ps.destroy_model_parallel()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _on_device(e):
    """A profiler event that ran on the GPU (a kernel, memcpy, memset), not a host op that launched some."""
    from torch.autograd import DeviceType
    return getattr(e, "device_type", None) == DeviceType.CUDA


def step_device_time(prof, wall_s, median_s):
    """One line: the profiled step's time on the device (every kernel, copy and fill it ran, from the profiler),
    against its wall time; the device's time is the step without the host's gaps in it."""
    if not torch.cuda.is_available():
        return f"device time of one step: n/a on CPU (wall {wall_s * 1e3:.1f} ms under the profiler)"
    dev_us = sum(e.device_time_total for e in prof.events() if _on_device(e))
    return (f"device time of one step (profiler, all kernels): {dev_us / 1e3:.1f} ms = {dev_us / 1e4 / median_s:.0f}% "
            f"of the median step's {median_s * 1e3:.1f} ms wall ({wall_s * 1e3:.1f} ms under the profiler)")


def top_kernels(prof, n=5):
    """The n kernels with the most device time (host ops' CPU time where no device ran), as text lines; shares of
    the step's total device time (a host op's time is not counted again beside the kernels it launched)."""
    rows = []
    for e in prof.key_averages():
        if torch.cuda.is_available():
            if not _on_device(e):
                continue
            t = e.device_time_total
        else:
            t = e.self_cpu_time_total
        rows.append((t, e.key))
    total = sum(t for t, _ in rows) or 1
    rows.sort(reverse=True)
    return [f"{t / 1e3:9.2f} ms {100 * t / total:5.1f}%  {k[:90]}" for t, k in rows[:n]]


def fit_micro(flags, start, extra):
    """Largest micro-batch (halving from `start`) whose step fits in memory."""
    m = start
    while m >= 1:
        try:
            run(flags, m, 2, extra)
            return m
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            m //= 2
    raise SystemExit("even micro-batch 1 does not fit")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["gpt2-124m", "llama-1.7b"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--micro", type=int, default=16, help="largest micro-batch to try")
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args()
    if a.cpu_smoke:
        for fused in ("", "--no-fused-kernels"):
            f, s = run(CONFIGS["smoke"], 2, 4, fused)
            print(f"smoke {fused or 'fused'}: {f / 1e9:.2f} GFLOP/s, step {s * 1e3:.1f} ms")
        return
    if not torch.cuda.is_available():
        print("benchmarks/mfu.py needs a CUDA GPU (none here); use --cpu-smoke to check the script on CPU")
        return
    ceiling = matmul_ceiling()
    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | bf16 matmul ceiling "
          f"{ceiling / 1e12:.0f} TFLOP/s (8192^3, same run) | peak used for MFU {PEAK / 1e12:.0f}")
    print(f"{'config':<12}{'variant':<26}{'micro':>6}{'step ms':>9}{'TFLOP/s/GPU':>13}{'MFU':>7}"
          f"{'of ceiling':>12}{'vs unfused':>12}")
    for name in a.configs:
        flags = CONFIGS[name]
        micro = fit_micro(flags, a.micro, "--bf16 --no-fused-kernels")
        variants = [("fused", "--bf16"), ("fused + dist. optimizer", "--bf16 --use-distributed-optimizer"),
                    ("unfused (--no-fused-kernels)", "--bf16 --no-fused-kernels")]
        res = {}
        for label, extra in variants:
            try:
                res[label] = run(flags, micro, a.steps, extra)
            except SystemExit as e:  # e.g. a flag this build does not implement
                print(f"{name:<12}{label:<26} skipped: {e}")
        base = res.get("unfused (--no-fused-kernels)")
        for label, (f, s) in res.items():
            ratio = f / base[0] if base else float("nan")
            print(f"{name:<12}{label:<26}{micro:>6}{s * 1e3:>9.1f}{f / 1e12:>13.1f}{f / PEAK:>7.1%}"
                  f"{f / ceiling:>12.1%}{ratio:>12.2f}")


if __name__ == "__main__":
    main()
