"""ZeRO memory and communication per rank: plain optimizer vs ZeRO-1 vs ZeRO-2, d = 1, 2, 4, 8.

On d spawned CPU ranks (gloo) a small GPT (bf16 or fp32 parameters) is trained for one
iteration, then for a measured one. Memory: the storage of every tensor the DP wrapper and
the optimizer own (megalite.optimizer.memory.training_state_bytes), at rest after the
step, per parameter; formula beside it (ZeRO paper / Megatron's table). Communication: the
wire bytes of the measured iteration counted by megalite.distributed.comm (ring volume per
rank: all-reduce 2(d-1)/d x payload, reduce-scatter and all-gather (d-1)/d x payload), per
parameter, vs theory: plain 2(d-1)/d x 4 (fp32 grads all-reduced); ZeRO-1 (d-1)/d x (4 +
param bytes) (fp32 grads reduce-scattered, params all-gathered); ZeRO-2 the same with the
reduce-scatter once per micro-batch (M). Goal: measured/formula = 1.00 +- 2%.

    python benchmarks/zero_memory.py [--layers 4 --hidden 128 --micro-batches 1 2]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import pickle
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megalite import parallel_state as ps
from megalite.config import ModelConfig, TrainingConfig
from megalite.distributed import DistributedDataParallel, comm, finalize_model_grads
from megalite.models import GPTModel
from megalite.optimizer import MixedPrecisionOptimizer
from megalite.optimizer.distributed_optimizer import DistributedOptimizer
from megalite.optimizer.memory import expected_bytes_per_param, training_state_bytes
from megalite.tensor_parallel import model_parallel_manual_seed

KINDS = (("plain", 0), ("zero1", 1), ("zero2", 2))


def _iteration(cfg, model, opt, micro, step):
    model.zero_grad_buffer()
    g = torch.Generator().manual_seed(step * 100 + ps.get_data_parallel_rank())
    for k in range(micro):
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
        sync = model.no_sync() if k < micro - 1 else torch.enable_grad()
        with sync:
            loss = model(ids[:, :-1], labels=ids[:, 1:]).float().mean() / micro
            opt.scale_loss(loss).backward()
    finalize_model_grads([model])
    opt.step()
    model.finish_param_sync() if model.zero_stage else None


def _measure(a, dtype, stage, micro):
    cfg = ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, seq_length=a.seq,
                      vocab_size=a.vocab, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype)
    tcfg = TrainingConfig(lr=1e-4, bf16=dtype == torch.bfloat16, global_batch_size=2)
    model = DistributedDataParallel(GPTModel(cfg), bucket_size=a.bucket, use_distributed_optimizer=stage > 0,
                                    zero_stage=stage or 1)
    opt = (DistributedOptimizer if stage else MixedPrecisionOptimizer)([model], tcfg)
    _iteration(cfg, model, opt, micro, 0)  # Adam states exist from the first step on
    comm.reset()
    _iteration(cfg, model, opt, micro, 1)
    counts = comm.counts()
    psi = sum(p.numel() for p in model.module.parameters())
    return {"psi": psi, "bytes": training_state_bytes([model], opt),
            "wire": sum(c["wire_bytes"] for c in counts.values()), "calls": {k: c["calls"] for k, c in counts.items()}}


def _worker(rank, d, port, a, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=d)
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    res = {}
    for dtype in (torch.bfloat16, torch.float32):
        for kind, stage in KINDS:
            for micro in (a.micro_batches if stage == 2 else a.micro_batches[:1]):
                res[(str(dtype).split(".")[-1], kind, micro)] = _measure(a, dtype, stage, micro)
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(res, f)
    dist.destroy_process_group()


def _run(d, a):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(d, port, a, out), nprocs=d)
        ranks = []
        for r in range(d):
            with open(os.path.join(out, f"{r}.pkl"), "rb") as f:
                ranks.append(pickle.load(f))
    return ranks


def _comm_theory(kind, d, pbytes, micro):
    f = (d - 1) / d
    return {"plain": 2 * f * 4, "zero1": f * (4 + pbytes), "zero2": f * (4 * micro + pbytes)}[kind]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--bucket", type=int, default=250_000, help="DP bucket size (elements)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4], help="ZeRO-2: micro-batches per step")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    a = p.parse_args()
    rows, worst = [], 0.0
    for d in a.sizes:
        ranks = _run(d, a)
        for key in ranks[0]:
            dtype, kind, micro = key
            pbytes = 2 if dtype == "bfloat16" else 4
            # every rank: its own bytes/param (padding may differ by a few elements)
            meas = max(r[key]["bytes"] / r[key]["psi"] for r in ranks)
            wire = max(r[key]["wire"] / r[key]["psi"] for r in ranks)
            want, theory = expected_bytes_per_param(kind, d, pbytes), _comm_theory(kind, d, pbytes, micro)
            mem_ratio, comm_ratio = meas / want, (wire / theory if theory else None)
            worst = max(worst, abs(mem_ratio - 1), abs(comm_ratio - 1) if comm_ratio else 0.0)
            rows.append((d, dtype, kind, micro, meas, want, mem_ratio, wire, theory, comm_ratio,
                         ranks[0][key]["calls"], ranks[0][key]["psi"]))
    print(f"model: {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}, seq {a.seq}; "
          f"Ψ = {rows[0][-1]:,} parameters; DP bucket {a.bucket:,} elements; torch {torch.__version__}")
    print("| d | params | optimizer | M | memory B/param (measured) | formula | ratio "
          "| comm B/param/step (measured) | theory | ratio | collectives per step |")
    print("|--:|--|--|--:|--:|--:|--:|--:|--:|--:|--|")
    for d, dtype, kind, micro, meas, want, mr, wire, theory, cr, calls, _ in rows:
        cr_s = f"{cr:.4f}" if cr is not None else "-"
        calls_s = ", ".join(f"{k} x{v}" for k, v in sorted(calls.items())) or "none"
        print(f"| {d} | {dtype} | {kind} | {micro} | {meas:.3f} | {want:.3f} | {mr:.4f} | {wire:.3f} | "
              f"{theory:.3f} | {cr_s} | {calls_s} |")
    print(f"worst deviation from the formulas: {worst * 100:.3f}% (goal <= 2%)")


if __name__ == "__main__":
    main()
