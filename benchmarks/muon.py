"""Muon vs AdamW on 4 CPU ranks at DP4 ZeRO-1: step time and optimizer-step time, the Newton-Schulz work
per rank (balanced over the DP ranks: each matrix has one owner), and the bytes the Muon step moves vs
the formula.

One spawn of 4 gloo ranks builds a Llama-shaped GPT twice (AdamW; Muon with Adam for the rest), trains
each a warm-up step and then --steps steps alternating between the two, timing each step and its
optimizer step (median). Per rank: Newton-Schulz FLOPs of one step (megalite/optimizer/newton_schulz.py
flops(): per matrix 5 x (4 s^2 l + 2 s^3), s x l its smaller x larger side) and its share of the mean;
the bytes the two all-to-alls of the Muon step send (comm counters) vs the formula: a rank sends the
pieces of the momentum it holds of matrices other ranks own, and the update of its own matrices' pieces
that other ranks hold back to them, 4 bytes an element.

    python benchmarks/muon.py [--layers 4 --hidden 256 --seq 128 --steps 5]
    python benchmarks/muon.py --gpu-ns [--size 4096]   (benchmarks/gpu_checks.sh bench-muon: one
        Newton-Schulz orthogonalisation of a size x size matrix on the GPU, bf16 steps (Megatron's default)
        and fp32, median time and TFLOP/s)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import statistics
import time

import torch

from benchmarks.gloo_ranks import spawn
from megalite import parallel_state as ps
from megalite.config import ModelConfig, TrainingConfig
from megalite.distributed import DistributedDataParallel, comm, finalize_model_grads
from megalite.distributed import DistributedDataParallelConfig as DDPConfig
from megalite.models import GPTModel
from megalite.optimizer.distributed_optimizer import DistributedOptimizer
from megalite.optimizer.newton_schulz import flops
from megalite.tensor_parallel import model_parallel_manual_seed


def _build(a, kind):
    cfg = ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=8, num_query_groups=4,
                      seq_length=a.seq, vocab_size=a.vocab, hidden_dropout=0.0, attention_dropout=0.0,
                      position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                      untie_embeddings_and_output_weights=True)
    tcfg = TrainingConfig(lr=1e-3, global_batch_size=8, optimizer=kind, muon_fp32_matmul_prec="high")
    model = DistributedDataParallel(GPTModel(cfg), DDPConfig(bucket_size=a.bucket, use_distributed_optimizer=True))
    return cfg, model, DistributedOptimizer([model], tcfg)


def _step(cfg, model, opt, step):
    model.zero_grad_buffer()
    g = torch.Generator().manual_seed(step * 100 + ps.get_data_parallel_rank())
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    t0 = time.perf_counter()
    model(ids[:, :-1], labels=ids[:, 1:]).float().mean().backward()
    finalize_model_grads([model])
    t1 = time.perf_counter()
    comm.reset()
    opt.step()
    model.finish_param_sync()
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def _job(a):
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    runs = {k: _build(a, k) for k in ("adam", "muon")}
    times = {k: [] for k in runs}
    for step in range(a.steps + 1):
        for k, (cfg, model, opt) in runs.items():
            t = _step(cfg, model, opt, step)
            if step:  # the first: warm-up
                times[k].append(t)
    muon = runs["muon"][2]
    before = dict(muon._muon.stats)
    _step(*runs["muon"], a.steps + 1)
    work = {k: muon._muon.stats[k] - before[k] for k in before}
    sent = comm.counts().get("muon_all_to_all", {}).get("wire_bytes", 0)
    formula = 0  # this rank's pieces of others' matrices (there), the others' pieces of its own (back)
    for group, d, me, hs, owner in muon._muon.plans:
        for h, o in zip(hs, owner):
            held = h.mine[1] - h.mine[0]
            formula += 4 * (held if o != me else h.param.numel() - held)
    return {"times": {k: (statistics.median(t for t, _ in v), statistics.median(o for _, o in v))
                      for k, v in times.items()}, "work": work, "sent": sent, "formula": formula,
            "total_flops": sum(muon._muon.cost(h.param) for h in muon._muon.holdings)}


def _gpu_ns(size):
    from megalite.optimizer.newton_schulz import newton_schulz
    x = torch.randn(size, size, device="cuda")
    work = flops(size, size, 5)
    for prec in ("medium", "high"):
        for _ in range(3):
            newton_schulz(x, 5, "quintic", prec)
        times = []
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            newton_schulz(x, 5, "quintic", prec)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        print(f"Newton-Schulz {size}x{size}, 5 quintic steps, {'bf16' if prec == 'medium' else 'fp32'} "
              f"(--muon-fp32-matmul-prec {prec}): {t * 1e3:.2f} ms, {work / t / 1e12:.1f} TFLOP/s "
              f"({torch.cuda.get_device_name()})")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu-ns", action="store_true", help="Newton-Schulz alone on the GPU")
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--bucket", type=int, default=1_000_000)
    a = p.parse_args()
    if a.gpu_ns:
        return _gpu_ns(a.size)
    ranks = spawn(4, _job, a)
    print(f"Muon vs AdamW, DP4 ZeRO-1, 4 CPU ranks (gloo), Llama-shaped GPT {a.layers} layers, hidden {a.hidden}, "
          f"seq {a.seq}; median of {a.steps} steps")
    print(f"{'rank':>4} {'step adam s':>12} {'step muon s':>12} {'ratio':>6} {'opt adam s':>11} {'opt muon s':>11} "
          f"{'ratio':>6} {'NS GFLOP':>9} {'of mean':>8} {'matrices':>8} {'sent KiB':>9} {'formula':>8}")
    mean = statistics.mean(r["work"]["ns_flops"] for r in ranks)
    for i, r in enumerate(ranks):
        (sa, oa), (sm, om) = r["times"]["adam"], r["times"]["muon"]
        print(f"{i:>4} {sa:>12.4f} {sm:>12.4f} {sm / sa:>6.2f} {oa:>11.4f} {om:>11.4f} {om / oa:>6.2f} "
              f"{r['work']['ns_flops'] / 1e9:>9.3f} {r['work']['ns_flops'] / mean:>8.3f} {r['work']['matrices']:>8} "
              f"{r['sent'] / 1024:>9.1f} {r['formula'] / 1024:>8.1f}")
    total = sum(r["work"]["ns_flops"] for r in ranks)
    one = ranks[0]["total_flops"]
    print(f"Newton-Schulz FLOPs over the ranks {total / 1e9:.3f} G = one process's {one / 1e9:.3f} G "
          f"(each matrix once); largest rank {max(r['work']['ns_flops'] for r in ranks) / mean:.3f} x the mean; "
          f"bytes sent / formula {sum(r['sent'] for r in ranks) / max(1, sum(r['formula'] for r in ranks)):.3f}")


if __name__ == "__main__":
    main()
