"""FP8 training on CPU ranks (issue 65): what `--fp8-param-gather` moves and what FP8 keeps per rank.

On d spawned CPU ranks (gloo, data-parallel, ZeRO-1 with bf16 parameters) a small Llama-shaped GPT trains three
iterations in each variant: bf16; FP8 (hybrid, tensorwise) with the weights all-gathered in bf16; FP8 with
`--fp8-param-gather`. Then one more parameter all-gather is counted (megalite.distributed.comm): its payload
bytes against the formula (FP8 weights one byte an element, every other parameter two, each rank's part padded to
the longest) and against bf16's (two bytes an element); and each rank's training state (parameters, gradients,
fp32 main weights, Adam's moments: megalite.optimizer.memory) plus the FP8 copies it holds, per parameter.

    python benchmarks/fp8.py [--dp 2] [--layers 4] [--hidden 256]
"""

import argparse
import os
import pickle
import socket
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

VARIANTS = [("bf16", ""), ("fp8, bf16 gather", "--fp8-format hybrid --fp8-recipe tensorwise"),
            ("fp8, --fp8-param-gather", "--fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather")]


def _flags(a):
    return (f"--num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads 4 --seq-length 64 "
            "--max-position-embeddings 64 --vocab-size 512 --micro-batch-size 2 "
            f"--global-batch-size {2 * a.dp} --lr 1e-3 --mock-data --num-workers 0 --train-iters 3 --eval-iters 0 "
            "--log-interval 100 --position-embedding-type rope --normalization RMSNorm --swiglu "
            "--disable-bias-linear --untie-embeddings-and-output-weights --bf16 --use-distributed-optimizer").split()


def _measure(a, extra):
    import pretrain_gpt
    from megalite import parallel_state as ps
    from megalite.cli.parser import parse_args
    from megalite.distributed import comm
    from megalite.optimizer.memory import training_state_bytes
    from megalite.training import pretrain
    args = parse_args(_flags(a) + extra.split(), world_size=a.dp)
    try:
        _, chunks, opt = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                                  pretrain_gpt.forward_step, args, return_state=True)
        params = [p for c in chunks for p in c.module.parameters()]
        fp8 = [p for p in params if getattr(p, "fp8_weight", None) is not None]
        comm.reset()
        opt.publish_main_params()  # one parameter all-gather, as after a step
        gathered = comm.counts().get("all_gather", {}).get("payload_bytes", 0)
        n_fp8, n_all = sum(p.numel() for p in fp8), sum(p.numel() for p in params)
        copies = sum(p.fp8_weight[0].untyped_storage().nbytes() for p in fp8)
        return {"gathered": gathered, "n_fp8": n_fp8, "n_all": n_all, "state": training_state_bytes(chunks, opt),
                "copies": copies, "longest": max((b.wire.longest for b in opt.fp8_gather.buckets), default=0)
                if getattr(opt, "fp8_gather", None) else 0}
    finally:
        ps.destroy_model_parallel()


def _worker(rank, a, port, out):
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(a.dp),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=a.dp)
    got = [_measure(a, extra) for _, extra in VARIANTS]
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump(got, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "fp8.pkl")
    mp.spawn(_worker, args=(a, port, out), nprocs=a.dp)
    with open(out, "rb") as f:
        res = pickle.load(f)
    print(f"# {a.layers} layers, hidden {a.hidden}, DP={a.dp} ZeRO-1, bf16 parameters; one parameter all-gather "
          "(payload bytes) and rank 0's training state")
    print("| variant | gathered bytes | formula | vs bf16 gather | state B/param | FP8 copies B/param |")
    print("|---|---|---|---|---|---|")
    bf16 = res[0]["gathered"]
    for (name, extra), r in zip(VARIANTS, res):
        n_fp8 = res[2]["n_fp8"]  # (the FP8 layers' weights: the same in every variant)
        formula = 2 * r["n_all"] if "param-gather" not in extra else r["longest"] * a.dp
        plain = n_fp8 + 2 * (r["n_all"] - n_fp8)
        print(f"| {name} | {r['gathered']:,} | {formula:,}" + (f" (unpadded {plain:,})" if "param-gather" in extra
                                                               else "") +
              f" | {r['gathered'] / bf16:.3f} | {r['state'] / r['n_all']:.2f} | {r['copies'] / r['n_all']:.2f} |")


if __name__ == "__main__":
    main()
