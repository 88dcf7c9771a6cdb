"""Mixture of Experts: what each token dispatcher sends, step time with experts split over ranks, and
(on a GPU) the grouped GEMM against a per-expert loop.

1. Bytes (4 spawned CPU ranks, gloo): one MoE layer (E experts, top-k, fp32) forward and backward on
   T tokens per rank at EP = 2 and 4. Each collective's wire bytes are counted by
   megalite.distributed.comm, per rank, against the formula (rows of h fp32, R = EP):
     allgather: tokens, probabilities [T, E] and the routing map [T, E] (1 byte) gathered, outputs
       reduce-scattered; backward: token and probability gradients reduce-scattered, output gradients
       gathered: (R-1)·T·(4h·4 + 4E·2 + E) bytes, whatever the routing;
     alltoall: the routed rows this rank sends to other EP ranks (s) and receives from them (r), each
       way in the forward and again in the backward: 2·(s + r)·4h, from the actual routing, and the
       expectation with a uniform router, s = r = T·k·(R-1)/R.
   (The counts exchange, E integers, is not counted.) Also at CP 2 x EP 2 (the T tokens are a CP rank's
   part of longer sequences; the EP group spans the CP ranks): the same formulas hold.
2. Step time (2 spawned ranks, the same run): a small MoE GPT trained at DP2 with every rank holding
   every expert (EP1) and with the experts split (EP2, both dispatchers): tokens/s and ratios.
3. --gpu: grouped GEMM (kernels.grouped_gemm) vs the per-expert loop of torch GEMMs, bf16, Mixtral-like
   expert shapes: TFLOP/s and ratio (forward, forward + backward).

    python benchmarks/moe.py [--tokens 512 --hidden 256 --experts 8 --topk 2] [--gpu]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import pickle
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megalite import parallel_state as ps
from megalite.config import ModelConfig
from megalite.distributed import comm
from megalite.moe.layer import MoELayer
from megalite.tensor_parallel import model_parallel_manual_seed
from megalite.transformer.mlp import MLP


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, job, a, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = job(a)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)


def _spawn(world, job, a):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, _free_port(), job, a, d), nprocs=world)
        return [pickle.load(open(os.path.join(d, f"{r}.pkl"), "rb")) for r in range(world)]


# -- 1. bytes -------------------------------------------------------------------------------------
LAYOUTS = ((1, 2), (1, 4), (2, 2))  # (CP, EP) on 4 ranks


def _bytes_job(a):
    out = {}
    for cp, ep in LAYOUTS:
        for kind in ("allgather", "alltoall"):
            ps.initialize_model_parallel(1, 1, context_parallel_size=cp, expert_model_parallel_size=ep)
            model_parallel_manual_seed(0)
            cfg = ModelConfig(num_layers=1, hidden_size=a.hidden, num_attention_heads=4, seq_length=a.tokens,
                              vocab_size=64, num_moe_experts=a.experts, moe_router_topk=a.topk, add_bias_linear=False,
                              moe_ffn_hidden_size=a.hidden, moe_token_dispatcher_type=kind)
            layer = MoELayer(cfg, "decoder.layers.0.mlp", 1, MLP)
            g = torch.Generator().manual_seed(ps.global_rank())
            x = torch.randn(a.tokens, 1, a.hidden, generator=g, requires_grad=True)
            comm.reset()
            y, _ = layer(x)
            y.square().sum().backward()
            c = comm.counts()
            wire = sum(v["wire_bytes"] for v in c.values())
            d = layer.dispatcher
            sent = received = None
            if kind == "alltoall":
                me = ps.get_expert_model_parallel_rank()
                sent, received = sum(d.send) - d.send[me], sum(d.recv) - d.recv[me]
            out[(cp, ep, kind)] = {"wire": wire, "sent": sent, "received": received}
            ps.destroy_model_parallel()
    return out


def _bytes_formula(a, ep, kind, sent, received):
    t, h, e = a.tokens, a.hidden, a.experts
    if kind == "allgather":
        return (ep - 1) * t * (4 * h * 4 + 4 * e * 2 + e)
    return 2 * (sent + received) * 4 * h


def _bytes(a):
    ranks = _spawn(4, _bytes_job, a)
    print(f"\n1. Wire bytes per rank, one MoE layer forward + backward: T={a.tokens} tokens/rank, h={a.hidden}, "
          f"E={a.experts}, k={a.topk}, fp32, 4 CPU ranks")
    print(f"{'CP':>3} {'EP':>3} {'dispatcher':>10} {'rank':>4} {'measured KiB':>13} {'formula KiB':>12} {'ratio':>6} "
          f"{'uniform-router KiB':>19}")
    for cp, ep in LAYOUTS:
        for kind in ("allgather", "alltoall"):
            for r, res in enumerate(ranks):
                m = res[(cp, ep, kind)]
                f = _bytes_formula(a, ep, kind, m["sent"], m["received"])
                uni = 2 * 2 * a.tokens * a.topk * (ep - 1) / ep * 4 * a.hidden if kind == "alltoall" else f
                print(f"{cp:>3} {ep:>3} {kind:>10} {r:>4} {m['wire'] / 1024:>13.1f} {f / 1024:>12.1f} "
                      f"{m['wire'] / f:>6.3f} {uni / 1024:>19.1f}")


# -- 2. step time ---------------------------------------------------------------------------------
def _time_job(a):
    import pretrain_gpt
    from megalite.cli.parser import parse_args
    from megalite.training import pretrain
    base = (f"--num-layers 2 --hidden-size {a.hidden} --num-attention-heads 4 --seq-length 128 "
            f"--max-position-embeddings 128 --vocab-size 512 --micro-batch-size 2 --global-batch-size 8 --lr 1e-4 "
            f"--mock-data --num-experts {a.experts} --moe-router-topk {a.topk} --disable-bias-linear "
            f"--moe-ffn-hidden-size {2 * a.hidden} --log-interval 1000 --eval-iters 0 --hidden-dropout 0 "
            "--attention-dropout 0 --swiglu").split()
    out = {}
    for name, extra in (("EP1", []), ("EP2 allgather", ["--expert-model-parallel-size", "2"]),
                        ("EP2 alltoall", ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                          "alltoall"])):
        times = []
        for iters in (2, 2 + a.iters):  # the difference: steady iterations without start-up
            args = parse_args(base + extra + ["--train-iters", str(iters)], world_size=2)
            dist.barrier()
            t0 = time.perf_counter()
            pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
            times.append(time.perf_counter() - t0)
            ps.destroy_model_parallel()
        out[name] = (times[1] - times[0]) / a.iters
    return out


def _timing(a):
    ranks = _spawn(2, _time_job, a)
    per = {k: max(r[k] for r in ranks) for k in ranks[0]}
    tokens = 8 * 128
    print(f"\n2. Step time, MoE GPT (2 layers, h={a.hidden}, {a.experts} experts top-{a.topk}, SwiGLU experts of "
          f"{2 * a.hidden}), DP2 on 2 CPU ranks, {tokens} tokens/step, mean of {a.iters} steps")
    print(f"{'layout':>15} {'ms/step':>9} {'tokens/s':>9} {'vs EP1':>7}")
    for k, t in per.items():
        print(f"{k:>15} {1e3 * t:>9.1f} {tokens / t:>9.0f} {per['EP1'] / t:>7.3f}")


# -- 3. GPU: grouped GEMM -------------------------------------------------------------------------
def _gpu(a):
    import kernels.grouped_gemm as gg
    dev, dt = torch.device("cuda"), torch.bfloat16
    h, ffn, e, rows = 4096, 14336, 8, 16384
    g = torch.Generator(device=dev).manual_seed(0)
    counts = torch.multinomial(torch.ones(e, device=dev), rows, replacement=True, generator=g).bincount(minlength=e)
    counts = counts.tolist()
    x = torch.randn(rows, h, device=dev, dtype=dt, requires_grad=True)
    w = (torch.randn(e, 2 * ffn, h, device=dev, dtype=dt) * 0.02).requires_grad_(True)

    def loop():
        return torch.cat([xi @ wi.t() for xi, wi in zip(torch.split(x, counts), w.unbind(0))])

    def grouped():
        return gg.grouped_gemm(x, w, counts)

    def bench(fn, backward):
        for _ in range(3):
            y = fn()
            if backward:
                y.backward(torch.ones_like(y))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = 10
        for _ in range(n):
            y = fn()
            if backward:
                y.backward(torch.ones_like(y))
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n
    flops = 2 * rows * h * 2 * ffn
    print(f"\n3. Grouped GEMM, bf16, {e} experts, {rows} rows (uneven: {counts}), "
          f"[{rows}, {h}] x [{e}, {2 * ffn}, {h}]^T")
    print(f"{'pass':>18} {'loop TFLOP/s':>13} {'grouped TFLOP/s':>16} {'ratio':>6}")
    for backward in (False, True):
        f = flops * (3 if backward else 1)
        tl, tg = bench(loop, backward), bench(grouped, backward)
        print(f"{'fwd+bwd' if backward else 'fwd':>18} {f / tl / 1e12:>13.1f} {f / tg / 1e12:>16.1f} {tl / tg:>6.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--gpu", action="store_true", help="only the grouped GEMM part (needs CUDA)")
    a = p.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    if a.gpu:
        _gpu(a)
        return
    _bytes(a)
    _timing(a)


if __name__ == "__main__":
    main()
