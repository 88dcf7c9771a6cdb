"""Mixed GPUs of different memory, emulated on CPU ranks: a micro-batch size per replica against the
smallest common one, and optimizer CPU offload's memory and step time.

Part 1 (2 ranks, gloo): a GPT (hidden --hidden, --layers layers, seq --seq, global batch --batch)
trains --iters iterations through pretrain_gpt. Replica 0 stands for a GPU whose memory holds
micro-batches of --big samples, replica 1 for one that holds 1. A CPU computes a micro-batch of 4 in
4x the time of 1, but a GPU does not (small micro-batches leave it under-filled and launch-bound):
that fixed cost per micro-batch is emulated by --launch-ms of sleep in each forward (both
replicas; 0 shows the CPU's own behaviour). Median tokens per second after
--warmup iterations (from --log-json): the smallest common micro-batch (1 on both, what one
--micro-batch-size allows), --data-parallel-micro-batch-sizes BIG,1, and the same with
--data-parallel-shares --shares (the bigger replica also takes more of the batch), and
--data-parallel-micro-batch-sizes auto with those shares under --device-memory-budget values derived
from a probe's measured bytes (room for --big samples on replica 0, for 1 on replica 1).
Part 2 (2 ranks, ZeRO-1, fp32): per rank, the training state's bytes on the device and on the host
(megalite.optimizer.memory.state_bytes_by_place), the bytes copied per step and the median step
time, with --optimizer-cpu-offload at fractions 0, 0.5 and 1. On CPU ranks "device" and host are
the same memory: the split and the bytes are what a GPU would hold and move; the time is the
copies' and bookkeeping's cost here, not PCIe's (benchmarks/gpu_checks.sh measures that).

    python benchmarks/mixed_memory.py [--big 4 --shares 3,1 --iters 10]
    python benchmarks/mixed_memory.py --gpu --hidden 768 --layers 12 --seq 1024 --batch 8   # on a GPU
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import statistics
import tempfile
import time

from gloo_ranks import spawn


def _model_flags(a):
    return (f"--num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads 4 --seq-length {a.seq} "
            f"--max-position-embeddings {a.seq} --vocab-size 1024 --mock-data --micro-batch-size 1 "
            f"--global-batch-size {a.batch} --train-iters {a.iters} --lr 1e-4 --log-interval 1 --eval-iters 0 "
            "--num-workers 0 --hidden-dropout 0 --attention-dropout 0").split()


def _runs(a, modes, log_dir):
    """In each rank: one pretrain per mode; median ms per iteration after the warm-up, and (rank's)
    state bytes by place and offload statistics."""
    import pretrain_gpt
    from megalite import parallel_state as ps
    from megalite.cli.parser import parse_args
    from megalite.optimizer.memory import state_bytes_by_place
    from megalite.training import pretrain
    def launch_bound(it, model):
        time.sleep(a.launch_ms / 1e3)
        return pretrain_gpt.forward_step(it, model)
    from megalite.training.memory_budget import GIB
    from megalite.training.record import RunRecord
    out, probed = {}, None
    for name, flags in modes:
        if callable(flags):  # budgets from the probe's measured bytes
            p = probed[0]
            flags = flags(p.states + p.fixed, p.per_sample, GIB)
        path = os.path.join(log_dir, f"{name}.jsonl")
        args = parse_args(_model_flags(a) + flags + ["--log-json", path], world_size=2)
        record = RunRecord()
        _, chunks, opt = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                                  launch_bound if a.launch_ms else pretrain_gpt.forward_step, args, return_state=True,
                                  record=record)
        probed = record.memory or probed
        device, host = state_bytes_by_place(chunks, opt)
        st = opt.offload
        ps.destroy_model_parallel()
        lines = [json.loads(x) for x in open(path)] if os.path.exists(path) else []
        ms = statistics.median(1e3 * x["iteration-time"] for x in lines if x["iteration"] > a.warmup) \
            if lines else None
        out[name] = {"ms": ms, "device": device, "host": host, "host elements": st.host_elements,
                     "d2h": st.d2h_bytes / max(st.steps, 1), "h2d": st.h2d_bytes / max(st.steps, 1),
                     "chosen": list(record.memory[2]) if record.memory and "auto" in name else None}
    return out


def _single(a):
    """--gpu: one process on the device (bf16): what one sample costs (measured as
    --data-parallel-micro-batch-sizes auto measures it: CUDA's peak allocated) and the step time
    with the whole optimizer offloaded, with and without --overlap-cpu-optimizer-d2h-h2d."""
    import pretrain_gpt
    import torch
    from megalite import parallel_state as ps
    from megalite.cli.parser import parse_args
    from megalite.training.memory_budget import GIB
    from megalite.training import pretrain
    from megalite.training.record import RunRecord
    cuda = torch.cuda.is_available()
    budget = [] if cuda else ["--device-memory-budget", "64"]  # (CPU: a dry run of the same path)
    modes = [("sized", ["--data-parallel-micro-batch-sizes", "auto"] + budget),
             ("no offload", []), ("offload 1", ["--optimizer-cpu-offload"]),
             ("offload 1, overlapped", ["--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d"])]
    flags = (f"--num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads {max(4, a.hidden // 64)} "
             f"--seq-length {a.seq} --max-position-embeddings {a.seq} --vocab-size 50304 --mock-data "
             f"--micro-batch-size 1 --global-batch-size {a.batch} --train-iters {a.iters} --lr 1e-4 --bf16 "
             "--log-interval 1 --eval-iters 0 --num-workers 0").split()
    with tempfile.TemporaryDirectory() as d:
        for name, extra in modes:
            path = os.path.join(d, "log.jsonl")
            args = parse_args(flags + extra + ["--log-json", path], world_size=1)
            record = RunRecord()
            pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args,
                     record=record)
            ps.destroy_model_parallel()
            if name == "sized":
                p, budget_bytes, micros, _ = record.memory
                print(f"  {'device' if cuda else 'CPU (dry run)'}: states {p.states / GIB:.3f} GiB, activations "
                      f"{p.fixed / GIB:.3f} GiB + {p.per_sample / GIB:.4f} GiB per sample of {a.seq} tokens; budget "
                      f"{budget_bytes / GIB:.1f} GiB -> micro-batch {micros[0]}")
                continue
            lines = [json.loads(x) for x in open(path)]
            ms = statistics.median(1e3 * x["iteration-time"] for x in lines if x["iteration"] > a.warmup)
            print(f"  {name:<24} {ms:8.1f} ms/iteration")
            os.remove(path)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--big", type=int, default=4, help="replica 0's micro-batch size")
    p.add_argument("--shares", default="3,1")
    p.add_argument("--launch-ms", type=float, default=80.0, help="emulated fixed cost per micro-batch (forward)")
    p.add_argument("--gpu", action="store_true", help="one process on the GPU (benchmarks/gpu_checks.sh "
                   "bench-mixed-memory): per-sample memory, offloaded step time with / without overlap")
    a = p.parse_args()
    if a.gpu:
        print(f"GPT h{a.hidden} L{a.layers} seq {a.seq} bf16, global batch {a.batch}, "
              f"median after iteration {a.warmup}")
        return _single(a)
    sizes = ["--data-parallel-micro-batch-sizes", f"{a.big},1"]
    def budgets(base, per, gib):  # replica 0 holds a.big samples, replica 1 one
        return ["--data-parallel-micro-batch-sizes", "auto", "--data-parallel-shares", a.shares,
                "--device-memory-budget", f"{(base + (a.big + 0.5) * per) / gib!r},{(base + 1.5 * per) / gib!r}"]
    part1 = [("common micro-batch 1", []), (f"sizes {a.big},1", sizes),
             (f"sizes {a.big},1 shares {a.shares}", sizes + ["--data-parallel-shares", a.shares]),
             ("auto probe", ["--data-parallel-micro-batch-sizes", "auto", "--device-memory-budget", "64"]),
             (f"auto sizes shares {a.shares}", budgets)]
    zero1 = ["--use-distributed-optimizer"]
    part2 = [(f"offload {f}", zero1 + (["--optimizer-cpu-offload", "--optimizer-offload-fraction", f] if f != "none"
                                       else [])) for f in ("none", "0.5", "1")]
    with tempfile.TemporaryDirectory() as d:
        ranks = spawn(2, _runs, a, part1 + part2, d)
    tokens = a.batch * a.seq
    print(f"\nPart 1: DP2, GPT h{a.hidden} L{a.layers} seq {a.seq}, global batch {a.batch}; replica 0 holds "
          f"micro-batches of {a.big}, replica 1 of 1; {a.launch_ms:g} ms per micro-batch emulated launch cost; median "
          f"after iteration {a.warmup}")
    base = ranks[0][part1[0][0]]["ms"]
    for name, _ in part1:
        if name == "auto probe":
            continue
        ms, chosen = ranks[0][name]["ms"], ranks[0][name]["chosen"]
        print(f"  {name:<28} {ms:8.1f} ms/iteration  {tokens / ms * 1e3:9.0f} tokens/s   {base / ms:.2f}x"
              + (f"   (chose sizes {','.join(map(str, chosen))} under budgets for {a.big} and 1)" if chosen else ""))
    print("\nPart 2: DP2 ZeRO-1 fp32, rank 0: training state on the device / on the host, copies per step, "
          "median step")
    none = ranks[0]["offload none"]
    for name, _ in part2:
        r = ranks[0][name]
        print(f"  {name:<14} device {r['device'] / 2**20:7.2f} MiB ({r['device'] / none['device']:.2f}x)  host "
              f"{r['host'] / 2**20:7.2f} MiB  down {r['d2h'] / 2**20:6.2f} MiB  up {r['h2d'] / 2**20:6.2f} MiB  "
              f"{r['ms']:8.1f} ms/iteration ({r['ms'] / none['ms']:.2f}x)")


if __name__ == "__main__":
    main()
