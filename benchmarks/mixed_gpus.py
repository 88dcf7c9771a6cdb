"""Mixed GPUs, emulated on CPU ranks: iteration time with equal data-parallel shares against
--data-parallel-shares (given and auto) when one replica is slower, and the gradient bytes
per iteration of the flat DP all-reduce against --hierarchical-grad-reduce and
--grad-compression.

Part 1 (2 ranks, gloo): a GPT (hidden --hidden, --layers layers, seq --seq, micro-batch 1,
global batch --batch) trains --iters iterations through pretrain_gpt; DP rank 1 emulates a
slower GPU by sleeping --slow-ms per micro-batch (forward). Median time per iteration over the
iterations after --warmup (from --log-json), per mode: equal shares (Megatron), the given
--shares, and auto (profiled over 2 iterations, then balanced).
Part 2 (4 ranks = 2 "nodes" of 2, LOCAL_WORLD_SIZE=2): bytes rank 0 sends per iteration in
the DP gradient reduction (megalite.distributed.comm's ring volume), and the bytes each
cross-node link of a ring carries: flat (a ring over all 4 ranks: every link, the two
cross-node ones too, carries the full ring volume), hierarchical (only the all-reduce of each
node's shard crosses), topk and powersgd at --ratio (flat rings of their smaller messages).

    python benchmarks/mixed_gpus.py [--slow-ms 200 --shares 3,1 --iters 10]
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


def _model_flags(a, iters):
    return (f"--num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads 4 --seq-length {a.seq} "
            f"--max-position-embeddings {a.seq} --vocab-size 1024 --mock-data --micro-batch-size 1 "
            f"--global-batch-size {a.batch} --train-iters {iters} --lr 1e-4 --log-interval 1 --eval-iters 0 "
            "--num-workers 0 --hidden-dropout 0 --attention-dropout 0").split()


def _timed_runs(a, modes, log_dir):
    """In each rank: one pretrain per mode; rank 1 sleeps per micro-batch. Median ms/iteration."""
    import pretrain_gpt
    from megalite import parallel_state as ps
    from megalite.cli.parser import parse_args
    from megalite.training import pretrain
    original = pretrain_gpt.forward_step

    def slow(it, model):
        if ps.get_data_parallel_rank() == 1:
            time.sleep(a.slow_ms / 1e3)
        return original(it, model)
    from megalite.training.record import RunRecord
    out, record = {}, RunRecord()
    for name, flags in modes:
        path = os.path.join(log_dir, f"{name}.jsonl")
        args = parse_args(_model_flags(a, a.iters) + flags + ["--log-json", path], world_size=2)
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, slow, args, record=record)
        ps.destroy_model_parallel()
        if ps.global_rank() == 1:
            lines = [json.loads(x) for x in open(path)]
            out[name] = statistics.median(1e3 * x["iteration-time"] for x in lines if x["iteration"] > a.warmup)
    out["auto counts"] = record.shares  # (the runs' one RunRecord: the auto mode's choice)
    return out


def _counted_runs(a, modes):
    """In each rank: bytes per iteration of the DP reduction, total and crossing nodes."""
    import pretrain_gpt
    from megalite.cli.parser import parse_args
    from megalite.distributed import comm
    from megalite import parallel_state as ps
    from megalite.training import pretrain
    out = {}
    for name, flags in modes:
        comm.reset()
        args = parse_args(_model_flags(a, 2) + flags, world_size=4)
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
        ps.destroy_model_parallel()
        c = comm.counts()
        total = sum(v["wire_bytes"] for v in c.values()) / 2
        if name == "hierarchical":  # only the all-reduce of the node shards leaves the node
            cross = c["all_reduce"]["wire_bytes"] / 2
        else:
            cross = total
        out[name] = (total, cross)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--slow-ms", type=float, default=200.0)
    p.add_argument("--shares", default="3,1")
    p.add_argument("--ratio", type=float, default=0.01)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        modes = [("equal shares", []), (f"shares {a.shares}", ["--data-parallel-shares", a.shares]),
                 ("auto", ["--data-parallel-shares", "auto", "--data-parallel-shares-profile-iters", "2"])]
        times = spawn(2, _timed_runs, a, modes, d)[1]
    print(f"\nPart 1: DP2, replica 1 sleeps {a.slow_ms:g} ms per micro-batch; GPT h{a.hidden} L{a.layers} seq {a.seq}, "
          f"global batch {a.batch}; median ms/iteration after iteration {a.warmup}")
    base = times["equal shares"]
    for name, _ in modes:
        print(f"  {name:<16} {times[name]:8.1f} ms   speed-up vs equal shares {base / times[name]:.2f}x")
    secs, counts = times["auto counts"]
    print(f"  auto measured {', '.join(f'{1e3 * s:.0f}' for s in secs)} ms per micro-batch by replica and chose "
          f"micro-batches {','.join(map(str, counts))}")
    comp = [("flat", []), ("hierarchical", ["--hierarchical-grad-reduce"]),
            (f"topk {a.ratio:g}", ["--grad-compression", "topk", "--grad-compression-ratio", str(a.ratio)]),
            (f"powersgd {a.ratio:g}", ["--grad-compression", "powersgd", "--grad-compression-ratio", str(a.ratio)])]
    counts = spawn(4, _counted_runs, a, comp, env={"LOCAL_WORLD_SIZE": "2"})[0]
    flat_cross = counts["flat"][1]
    print("\nPart 2: DP4 as 2 nodes x 2 ranks; bytes per iteration of the gradient reduction (ring volume): "
          "sent by rank 0, and over each cross-node link")
    for name, _ in comp:
        total, cross = counts[name]
        print(f"  {name:<16} sent {total / 1e6:8.3f} MB   per cross-node link {cross / 1e6:8.3f} MB   "
              f"({cross / flat_cross:.3f} of flat)")


if __name__ == "__main__":
    main()
