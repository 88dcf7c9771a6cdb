"""Per-rank memory of the every-axis layout (issue 38, item 6) against the same model without CP.

A DeepSeek-V3-shaped model (MLA, one dense layer then MoE with a shared expert and group-limited sigmoid
routing, one MTP depth) trains for a few iterations on 8 CPU ranks (gloo), twice, in one run:
  all axes: TP2 + SP x CP2 x PP2 interleaved (`Et|t|t|mL`), EP2 inside each stage, ZeRO-3, full recompute
  no CP:    TP2 + SP x DP2 x PP2 interleaved, the same EP2, ZeRO-3 and recompute
Both shard ZeRO-3 over 2 ranks (DP x CP), so the training state per rank should match; CP halves each rank's
sequence, so what the activations take should fall. Per rank: the training state (every tensor the model
wrapper and optimizer own, megalite.optimizer.memory.training_state_bytes) and the process's peak RSS
(glibc told to mmap large blocks, as benchmarks/zero_memory.py, so transient buffers return to the system).
The tokens per iteration are the same (CP splits each sequence, DP the batch).

    python benchmarks/all_axes_memory.py [--hidden 256 --seq 1024 --iters 3]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import resource
import socket

import torch.multiprocessing as mp

LAYOUTS = {
    "all axes (CP2)": ["--context-parallel-size", "2"],
    "no CP (DP2)": [],
}


def model_flags(a):
    h = a.hidden
    return ["--multi-latent-attention", "--q-lora-rank", str(h // 2), "--kv-lora-rank", str(h // 4), "--qk-head-dim",
            "32", "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32", "--qk-layernorm", "--normalization", "RMSNorm",
            "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--num-experts", "8", "--moe-router-topk", "2",
            "--moe-ffn-hidden-size", str(h), "--moe-shared-expert-intermediate-size", str(h),
            "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-num-groups", "2",
            "--moe-router-group-topk", "1", "--moe-layer-freq", "[0,1,1]", "--moe-aux-loss-coeff", "0",
            "--num-layers", "3", "--mtp-num-layers", "1", "--hidden-size", str(h), "--num-attention-heads", "8",
            "--ffn-hidden-size", str(2 * h), "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq),
            "--vocab-size", "1024", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--train-iters", str(a.iters), "--lr", "1e-4", "--log-interval", "1000", "--eval-interval", "0",
            "--eval-iters", "0",
            "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
            "--pipeline-model-parallel-layout", "Et|t|t|mL", "--expert-model-parallel-size", "2",
            "--moe-token-dispatcher-type", "alltoall", "--use-distributed-optimizer", "--zero-stage", "3",
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


def _rank(rank, world, port, argv, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    torch.set_num_threads(1)
    import pretrain_gpt
    from megalite.cli.parser import parse_args
    from megalite.optimizer.memory import training_state_bytes
    from megalite.training import pretrain
    args = parse_args(argv, world_size=world)
    losses, chunks, opt = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                                   pretrain_gpt.forward_step, args, return_state=True)
    out.put((rank, training_state_bytes(chunks, opt), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
             losses[-1]))


def measure(argv, world=8):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, argv, q)) for r in range(world)]
    for p in procs:
        p.start()
    rows = sorted(q.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--iters", type=int, default=3)
    a = p.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # inherited by the spawned ranks
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(f"DeepSeek-shaped model, hidden {a.hidden}, sequence {a.seq}, 8 ranks, {a.iters} iterations")
    results = {}
    for name, extra in LAYOUTS.items():
        results[name] = measure(model_flags(a) + extra)
        state = [r[1] / 2 ** 20 for r in results[name]]
        rss = [r[2] / 2 ** 20 for r in results[name]]
        print(f"{name:16s} state MiB per rank {' '.join(f'{x:6.1f}' for x in state)} | peak RSS MiB "
              f"{' '.join(f'{x:6.0f}' for x in rss)} | last loss {results[name][-1][3]:.3f}")
    (a_name, cp), (b_name, dp) = results.items()
    print(f"ratio {a_name} / {b_name}: state max {max(r[1] for r in cp) / max(r[1] for r in dp):.2f}, "
          f"peak RSS max {max(r[2] for r in cp) / max(r[2] for r in dp):.2f}")


if __name__ == "__main__":
    main()
