"""Start-up cost of building a 7B-shaped (Llama-2-7B) transformer layer stack at TP 1/2/4/8:
wall time of the parameter initialisation and peak host memory (max RSS) of one rank.

    python benchmarks/startup.py [--layers 2] [--tp 1 2 4 8] [--device cpu]

Each (scheme, TP) runs in a fresh process that builds rank 0's layers of a TP group of that
size: the four tensor-parallel linears of every layer (QKV 4096 -> 12288, proj 4096 -> 4096,
SwiGLU fc1 4096 -> 2 x 11008, fc2 11008 -> 4096), with per-parameter seeds as the model uses.
Initialisation talks to no other rank, so rank 0 is built alone (its TP rank/size are set,
no process group is needed). Schemes, side by side:
  sharded  megalite's init: each rank generates only the tiles of its own shard
  full     the previous scheme (still the fallback for custom init methods): the whole
           weight is generated, then sliced
Both give every rank the same slices of the same TP-independent weights.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN, FFN, HEADS = 4096, 11008, 32


def build(tp, scheme, layers, device):
    import torch
    from megalite import parallel_state as ps
    from megalite.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megalite.tensor_parallel.layers import init_normal

    ps.get_tensor_model_parallel_world_size = lambda: tp
    ps.get_tensor_model_parallel_rank = lambda: 0
    dev = torch.device(device)
    ps.get_device = lambda: dev
    std = 0.02

    def init(s):
        if scheme == "sharded":
            return init_normal(s)
        return lambda t: torch.nn.init.normal_(t, 0.0, s)  # a plain callable: full weight, then slice

    t0 = time.perf_counter()
    mods, n = [], 0
    for i in range(layers):
        seed = 1000 * i
        mods += [ColumnParallelLinear(HIDDEN, 3 * HIDDEN, bias=False, init_method=init(std), init_seed=seed + 1),
                 RowParallelLinear(HIDDEN, HIDDEN, bias=False, init_method=init(std), init_seed=seed + 2),
                 ColumnParallelLinear(HIDDEN, 2 * FFN, bias=False, init_method=init(std), init_seed=seed + 3,
                                      shard_chunks=2),
                 RowParallelLinear(FFN, HIDDEN, bias=False, init_method=init(std), init_seed=seed + 4)]
    if dev.type == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    n = sum(p.numel() for m in mods for p in m.parameters())
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"tp": tp, "scheme": scheme, "seconds": secs, "peak_rss_mb": rss_mb, "params": n}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2, help="layers in the stack (Llama-2-7B has 32)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per row; the median time is shown")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(build(int(a.child[0]), a.child[1], a.layers, a.device)))
        return 0
    base = subprocess.run([sys.executable, "-c", "import torch, megalite, resource; "
                           "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"],
                          capture_output=True, text=True, check=True)
    base_mb = float(base.stdout.split()[-1])
    print(f"# {a.layers} Llama-2-7B-shaped layers (hidden {HIDDEN}, ffn {FFN}, {HEADS} heads; linears only), "
          f"fp32 init on {a.device}, rank 0 of each TP size, median of {a.repeat} fresh processes per row")
    print(f"# peak RSS of a process that only imports torch and megalite: {base_mb:.0f} MB")
    print("| TP | scheme | params on rank | init s | peak RSS MB | RSS over import MB | time vs TP=1 | mem vs TP=1 |")
    print("|--:|---|--:|--:|--:|--:|--:|--:|")
    first = {}
    for tp in a.tp:
        for scheme in ("sharded", "full"):
            runs = []
            for _ in range(a.repeat):
                out = subprocess.run([sys.executable, __file__, "--layers", str(a.layers), "--device", a.device,
                                      "--child", str(tp), scheme], capture_output=True, text=True, check=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = sorted(runs, key=lambda x: x["seconds"])[len(runs) // 2]
            extra = r["peak_rss_mb"] - base_mb
            f = first.setdefault(scheme, (r["seconds"], extra))
            print(f"| {tp} | {scheme} | {r['params'] / 1e6:.1f} M | {r['seconds']:.2f} | {r['peak_rss_mb']:.0f} | "
                  f"{extra:.0f} | {r['seconds'] / f[0]:.2f} | {extra / f[1]:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
