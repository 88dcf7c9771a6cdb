"""Checkpoint figures: save / load time and bytes per rank at two layouts, the time an
--async-save blocks the training loop against a synchronous save, and the converter's peak
memory against the model size.

    python benchmarks/checkpoint.py [--layers 8 --hidden 512] [--out DIR]

Layouts run on spawned gloo ranks (CPU); the same code paths as `pretrain_gpt.py --save`.
"""

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _worker(rank, world, port, flags, out_dir, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import pretrain_gpt
    from megalite.checkpoint import manager as ck
    from megalite import parallel_state as ps
    from megalite.cli.parser import parse_args
    from megalite.tensor_parallel import model_parallel_manual_seed
    from megalite.training.setup import setup
    from megalite.checkpoint.writer import CheckpointIO
    from megalite.config.checkpoint import CheckpointConfig

    args = parse_args(flags + ["--save", out_dir, "--load", out_dir], world_size=world)
    ps.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    model_parallel_manual_seed(args.seed)
    args = args.replace(vocab_size=32000)
    mcfg, _, chunks, opt, sched = setup(args, pretrain_gpt.model_provider)
    row, io = {}, CheckpointIO()
    for mode in ("sync", "async"):
        dist.barrier()
        t0 = time.perf_counter()
        ck.save_checkpoint(1 if mode == "sync" else 2, chunks, opt, sched, mcfg,
                           CheckpointConfig.of(args.replace(async_save=mode == "async")), 0, 0, io=io)
        row[f"{mode}_blocked"] = time.perf_counter() - t0
        io.wait()
        dist.barrier()
        row[f"{mode}_total"] = time.perf_counter() - t0
    d = ck.iteration_dir(out_dir, 2)
    row["bytes"] = os.path.getsize(os.path.join(d, f"__{rank}_0.safetensors")) if \
        os.path.exists(os.path.join(d, f"__{rank}_0.safetensors")) else 0
    dist.barrier()
    t0 = time.perf_counter()
    ck.load_checkpoint(chunks, opt, sched, mcfg, CheckpointConfig.of(args), io=io)
    dist.barrier()
    row["load"] = time.perf_counter() - t0
    row["params"] = sum(p.numel() for c in chunks for p in c.parameters())
    io.close()
    results[rank] = row
    dist.destroy_process_group()


def run_layout(world, flags, out_dir):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").Manager().dict()
    mp.start_processes(_worker, args=(world, port, flags, out_dir, results), nprocs=world, start_method="spawn")
    return [results[r] for r in range(world)]


def converter_peak(ckpt, out):
    """Peak RSS (bytes) of the converter (megalite -> HF) in a fresh process, and of a
    process that only imports what it imports."""
    probe = ("import resource, runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    {body}\nexcept SystemExit:\n    pass\n"
             "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")

    def peak(body, *argv):
        r = subprocess.run([sys.executable, "-c", probe.format(body=body), *argv], check=True,
                           capture_output=True, text=True)
        return int(r.stdout.split()[-1]) * 1024  # ru_maxrss: KiB on Linux
    tool = os.path.join(ROOT, "tools", "convert_checkpoint.py")
    base = peak(f"sys.path.insert(0, {ROOT!r}); import torch, safetensors, megalite.checkpoint.convert  # noqa")
    conv = peak("runpy.run_path(sys.argv[0], run_name='__main__')", tool, "--loader", "megalite", "--saver", "hf",
                "--load-dir", ckpt, "--save-dir", out, "--max-shard-size-mb", "64")
    return base, conv


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    model = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", "8",
             "--seq-length", "128", "--mock-data", "--vocab-size", "32000", "--micro-batch-size", "1", "--lr", "1e-4",
             "--train-iters", "1", "--eval-iters", "0", "--num-workers", "0"]
    root = a.out or tempfile.mkdtemp(prefix="megalite-ckpt-bench-")
    layouts = [("TP1 DP1", 1, []), ("TP2 DP1", 2, ["--tensor-model-parallel-size", "2"]),
               ("DP2 ZeRO-1", 2, ["--use-distributed-optimizer"])]
    print(f"GPT {a.layers} layers, hidden {a.hidden}, vocab 32000, fp32 with Adam state; CPU, gloo ranks")
    print(f"| layout | ranks | params/rank | MB/rank | sync save s | async: loop blocked s | async total s "
          f"| load s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, world, flags in layouts:
        d = os.path.join(root, name.replace(" ", "_"))
        shutil.rmtree(d, ignore_errors=True)
        rows = run_layout(world, model + flags, d)
        mb = max(r["bytes"] for r in rows) / 2 ** 20
        print(f"| {name} | {world} | {rows[0]['params']:,} | {mb:.1f} | {max(r['sync_total'] for r in rows):.2f} | "
              f"{max(r['async_blocked'] for r in rows):.2f} | {max(r['async_total'] for r in rows):.2f} | "
              f"{max(r['load'] for r in rows):.2f} |")
    src = os.path.join(root, "TP2_DP1")
    model_bytes = sum(os.path.getsize(os.path.join(src, "iter_0000002", f)) for f in
                      os.listdir(os.path.join(src, "iter_0000002")) if f.endswith(".safetensors")) / 3
    base, conv = converter_peak(src, os.path.join(root, "hf"))
    print(f"\nconverter megalite -> HF: model weights {model_bytes / 2**20:.0f} MB (a third of the checkpoint: "
          f"weights + Adam m, v); converter peak RSS {conv / 2**20:.0f} MB, of which {base / 2**20:.0f} MB is "
          f"python + torch; above that {(conv - base) / model_bytes:.2f}x the model")
    if a.out is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
