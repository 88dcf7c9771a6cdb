"""Context parallelism on one long sequence: activation memory and step time per rank at
CP = 1, 2, 4 (each comm type), and the attention work per rank with the 2 x CP chunking
against a contiguous split.

On CP spawned CPU ranks (gloo) a small GPT (hidden 64, 4 heads, 2 layers) runs forward and
backward on one sequence of --seq tokens (default 8192), each rank on its part.
- Activation memory: the bytes autograd saves for the backward during the forward (every
  saved tensor counted once, by storage), per rank; goal: <= 1.15 / CP of CP=1's.
- Step time: forward + backward of the model (median of --repeats), per rank (max over ranks).
- Load balance: causal attention work of a rank = the (query, key) pairs it scores, for the
  balanced chunks (rank r keeps chunks r and 2CP-1-r) and for a contiguous split; max/mean.

    python benchmarks/context_parallel.py [--seq 8192 --cp 1 2 4 --comm p2p a2a allgather]
    python benchmarks/context_parallel.py --gpu-blocks [--seq 32768]   # on a CUDA GPU

--gpu-blocks (one GPU): a CP rank's ring-attention compute on megalite's Triton kernels (its
sub-blocks and LSE merges, forward + backward; the blocks come from one gathered K/V, so no
communication is timed) at CP 2 and 4, against kernels.flash_attention over the whole sequence
(CP 1): time per rank and the ratio to the ideal CP-1 time / CP.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import pickle
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megalite import parallel_state as ps
from megalite.config import ModelConfig
from megalite.distributed.cp_comm import local_token_index, slice_for_cp_rank
from megalite.models import GPTModel
from megalite.tensor_parallel import model_parallel_manual_seed


def _saved_bytes(fn):
    """Run fn() and return (its result, bytes autograd saved for the backward, each storage once)."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _rank(rank, cp, port, args, comm, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, args.threads // cp))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    ps.initialize_model_parallel(1, 1, context_parallel_size=cp)
    model_parallel_manual_seed(0)
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=args.seq, vocab_size=256,
                      make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0,
                      position_embedding_type="rope", cp_comm_type=[comm] if cp > 1 else None)
    model = GPTModel(cfg)
    ids = torch.randint(0, 256, (1, args.seq + 1), generator=torch.Generator().manual_seed(1))
    tokens, labels = (slice_for_cp_rank(t, 1, grid=ps.current_grid()) for t in (ids[:, :-1], ids[:, 1:]))
    times, saved = [], 0
    for _ in range(args.repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        loss, saved = _saved_bytes(lambda: model(tokens, labels=labels).sum())
        loss.backward()
        times.append(time.perf_counter() - t0)
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump((saved, statistics.median(times[1:])), f)
    dist.destroy_process_group()


def _run(cp, comm, args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_rank, args=(cp, port, args, comm, d), nprocs=cp, start_method="fork")
        res = [pickle.load(open(os.path.join(d, f"{r}.pkl"), "rb")) for r in range(cp)]
    return max(r[0] for r in res), max(r[1] for r in res)


def attention_pairs(seq, cp, balanced):
    """Per rank: the causal (query, key) pairs its queries score."""
    if balanced:
        return [int((local_token_index(seq // cp, r, cp) + 1).sum()) for r in range(cp)]
    c = seq // cp
    return [sum(range(r * c + 1, (r + 1) * c + 1)) for r in range(cp)]


def gpu_blocks(args):
    import kernels
    from megalite.transformer.cp_attention import _OneBlock, _global_index, ring_attention
    s, h, hk, d = args.seq, 16, 4, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, s, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for n in (h, hk, hk))

    def timed(fn):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / args.repeats

    def full():
        x = [t.detach().requires_grad_() for t in (q, k, v)]
        kernels.flash_attention(*x, causal=True).sum().backward()
    base = timed(full)
    print(f"{torch.cuda.get_device_name()}, one sequence of {s} tokens, {h} heads ({hk} KV), d {d}, bf16 inputs")
    print("| CP | ring compute per rank, fwd+bwd (ms) | CP-1 time / CP (ms) | ratio |")
    print("|--:|--:|--:|--:|")
    print(f"| 1 | {base * 1e3:.1f} (flash_attention) | {base * 1e3:.1f} | 1.00 |")
    for n in (c for c in args.cp if c > 1):
        gi = _global_index(s // n, n, q.device)
        qi = local_token_index(s // n, 0, n, q.device)
        gi_host, qi_host = gi.cpu(), qi.cpu()  # the ring plans on the host

        def ring():
            x = [q[:, qi].detach().requires_grad_(), k[:, gi].detach().requires_grad_(),
                 v[:, gi].detach().requires_grad_()]
            ring_attention(*x, ring=_OneBlock(), index_of=lambda j: gi_host, q_index=qi_host).sum().backward()
        t = timed(ring)
        print(f"| {n} | {t * 1e3:.1f} | {base / n * 1e3:.1f} | {t / (base / n):.2f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--comm", nargs="+", default=["p2p", "a2a", "allgather"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=max(1, torch.get_num_threads()))
    ap.add_argument("--gpu-blocks", action="store_true", help="the ring's compute on one CUDA GPU (see above)")
    args = ap.parse_args()
    if args.gpu_blocks:
        if not torch.cuda.is_available():
            sys.exit("context_parallel.py --gpu-blocks needs a CUDA GPU")
        return gpu_blocks(args)
    print(f"one sequence of {args.seq} tokens, GPT h64 x 2 layers, CPU ranks (gloo), torch {torch.__version__}")
    base_mem, base_t = _run(1, "p2p", args)
    print("| CP | comm | saved activations / rank (MiB) | x CP=1 | goal <= 1.15/CP | step time / rank (s) | x CP=1 |")
    print("|--:|---|--:|--:|--:|--:|--:|")
    print(f"| 1 | - | {base_mem / 2**20:.1f} | 1.00 | 1.00 | {base_t:.3f} | 1.00 |")
    for cp in (c for c in args.cp if c > 1):
        for comm in args.comm:
            mem, t = _run(cp, comm, args)
            print(f"| {cp} | {comm} | {mem / 2**20:.1f} | {mem / base_mem:.3f} | {1.15 / cp:.3f} | {t:.3f} | "
                  f"{t / base_t:.2f} |")
    print("\n| CP | attention pairs per rank, balanced chunks (max/mean) | contiguous split (max/mean) |")
    print("|--:|--:|--:|")
    for cp in (c for c in args.cp if c > 1):
        b, c = attention_pairs(args.seq, cp, True), attention_pairs(args.seq, cp, False)
        print(f"| {cp} | {max(b) / statistics.mean(b):.4f} | {max(c) / statistics.mean(c):.4f} |")


if __name__ == "__main__":
    main()
