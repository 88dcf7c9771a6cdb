"""ZeRO memory and communication per rank: plain optimizer vs ZeRO-1 / 2 / 3, d = 1, 2, 4, 8.

On d spawned CPU ranks (gloo) a small GPT (bf16 or fp32 parameters) is trained for one
iteration, then for a measured one. Memory: the storage of every tensor the DP wrapper and
the optimizer own (megalite.optimizer.memory.training_state_bytes), at rest after the
step, per parameter; formula beside it (ZeRO paper / Megatron's table). Communication: the
wire bytes of the measured iteration counted by megalite.distributed.comm (ring volume per
rank: all-reduce 2(d-1)/d x payload, reduce-scatter and all-gather (d-1)/d x payload), per
parameter, vs theory: plain 2(d-1)/d x 4 (fp32 grads all-reduced); ZeRO-1 (d-1)/d x (4 +
param bytes) (fp32 grads reduce-scattered, params all-gathered); ZeRO-2 the same with the
reduce-scatter once per micro-batch (M); ZeRO-3 (d-1)/d x (4M + 2M x param bytes): every
unit gathered once in the forward and once in the backward of each micro-batch (the model's
output layer is untied here; a tied one is gathered once more, see tests/test_distributed_optimizer.py).
ZeRO-3's high-water mark of gathered parameters is printed in units of the largest layer unit
(goal <= 1 + prefetch = 2). Goal: measured/formula = 1.00 +- 2%.

Then (--big-hidden): a model whose fp32 weights + Adam states are >= 3x what one rank keeps
under ZeRO-3 trains at DP4 (built on the meta device: each rank makes only its shard): state
per rank, its peak with the gathered units, and the process's peak RSS, vs one process
training it with the plain optimizer. And step times at DP2, same run: ZeRO-3 with prefetch
vs without, and vs ZeRO-2.

    python benchmarks/zero_memory.py [--layers 4 --hidden 128 --micro-batches 1 2]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import contextlib
import pickle
import resource
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megalite import parallel_state as ps
from megalite.config import ModelConfig, TrainingConfig
from megalite.distributed import DistributedDataParallel, comm, finalize_model_grads
from megalite.distributed import DistributedDataParallelConfig as DDPConfig
from megalite.models import GPTModel
from megalite.optimizer import MixedPrecisionOptimizer
from megalite.optimizer.distributed_optimizer import DistributedOptimizer
from megalite.optimizer.memory import expected_bytes_per_param, training_state_bytes
from megalite.tensor_parallel import model_parallel_manual_seed

KINDS = (("plain", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3))


def _iteration(cfg, model, opt, micro, step):
    """One step (opt None: forward and backward only)."""
    model.zero_grad_buffer()
    g = torch.Generator().manual_seed(step * 100 + ps.get_data_parallel_rank())
    for k in range(micro):
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
        sync = model.no_sync() if k < micro - 1 else torch.enable_grad()
        with sync:
            loss = model(ids[:, :-1], labels=ids[:, 1:]).float().mean() / micro
            (opt.scale_loss(loss) if opt is not None else loss).backward()
    finalize_model_grads([model])
    if opt is not None:
        opt.step()
    model.finish_param_sync() if model.zero_stage else None


def _measure(a, dtype, stage, micro):
    cfg = ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, seq_length=a.seq,
                      vocab_size=a.vocab, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
                      untie_embeddings_and_output_weights=True)
    tcfg = TrainingConfig(lr=1e-4, bf16=dtype == torch.bfloat16, global_batch_size=2)
    model = DistributedDataParallel(GPTModel(cfg), DDPConfig(bucket_size=a.bucket, use_distributed_optimizer=stage > 0,
                                    zero_stage=stage or 1))
    opt = (DistributedOptimizer if stage else MixedPrecisionOptimizer)([model], tcfg)
    _iteration(cfg, model, opt, micro, 0)  # Adam states exist from the first step on
    comm.reset()
    _iteration(cfg, model, opt, micro, 1)
    counts = comm.counts()
    psi = sum(p.numel() for p in model.module.parameters())
    peak = None
    if model.units is not None:  # high-water of gathered parameters, in largest-unit sizes
        peak = model.units.stats["peak_bytes"] / max(sum(b.param_bytes() for b in u.buckets) for u in model.units.units)
    return {"psi": psi, "bytes": training_state_bytes([model], opt), "peak_units": peak,
            "wire": sum(c["wire_bytes"] for c in counts.values()), "calls": {k: c["calls"] for k, c in counts.items()}}


def _worker(rank, d, port, a, out_dir, job):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=d)
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    res = job(a)
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(res, f)
    dist.destroy_process_group()


def _table_job(a):
    res = {}
    for dtype in (torch.bfloat16, torch.float32):
        for kind, stage in KINDS:
            for micro in (a.micro_batches if stage >= 2 else a.micro_batches[:1]):
                res[(str(dtype).split(".")[-1], kind, micro)] = _measure(a, dtype, stage, micro)
    return res


def _big_cfg(a):
    return ModelConfig(num_layers=a.big_layers, hidden_size=a.big_hidden, num_attention_heads=8, seq_length=a.seq,
                       vocab_size=a.vocab, hidden_dropout=0.0, attention_dropout=0.0,
                       untie_embeddings_and_output_weights=True)


def _big_job(a):
    """The big model at this world's DP: ZeRO-3 when d > 1 (built on the meta device), the
    plain optimizer on one process."""
    d = ps.get_data_parallel_world_size()
    cfg, tcfg = _big_cfg(a), TrainingConfig(lr=1e-4, global_batch_size=2)
    stage = 3 if d > 1 else 0
    tiny = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=a.seq, vocab_size=a.vocab)
    _iteration(tiny, DistributedDataParallel(GPTModel(tiny)), None, 1, 0)  # lazy imports, warm-up
    base = _rss_mib()
    with ps.meta_init() if stage else contextlib.nullcontext():
        module = GPTModel(cfg)
    model = DistributedDataParallel(module, DDPConfig(use_distributed_optimizer=stage > 0, zero_stage=stage or 1))
    opt = (DistributedOptimizer if stage else MixedPrecisionOptimizer)([model], tcfg)
    for step in range(2):
        _iteration(cfg, model, opt, 1, step)
    at_rest = training_state_bytes([model], opt)
    gathered = model.units.stats["peak_bytes"] if stage else 0
    # gradients in flight: stage 3 keeps at most two units' fp32 buckets full size
    grads = 2 * 4 * max(b.padded for b in model.buckets) if stage else 0
    psi = sum(p.numel() for p in model.module.parameters())
    return {"psi": psi, "rest": at_rest, "peak": at_rest + gathered + grads, "rss_mb": _rss_mib() - base}


def _rss_mib():
    """Peak resident set of this process (MiB); large blocks are mmap'd (MALLOC_MMAP_THRESHOLD_,
    set in main), so a freed buffer leaves the process and the peak counts live memory."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _time_job(a):
    """ms per iteration (median of a.iters after a warm-up) at this DP: ZeRO-3 with and without
    prefetch, and ZeRO-2, interleaved so that machine noise hits each alike."""
    cfg, tcfg = _big_cfg(a), TrainingConfig(lr=1e-4, global_batch_size=2)
    runs = {}
    for name, stage, prefetch in (("zero3", 3, True), ("zero3-no-prefetch", 3, False), ("zero2", 2, True)):
        model = DistributedDataParallel(GPTModel(cfg), DDPConfig(use_distributed_optimizer=True, zero_stage=stage,
                                        prefetch=prefetch))
        runs[name] = (model, DistributedOptimizer([model], tcfg), [])
        _iteration(cfg, model, runs[name][1], a.time_micro, 0)
    for step in range(a.iters):
        for name, (model, opt, times) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            _iteration(cfg, model, opt, a.time_micro, step + 1)
            times.append(time.perf_counter() - t0)
    return {name: 1000 * statistics.median(t) for name, (_, _, t) in runs.items()}


def _run(d, a, job=_table_job):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(d, port, a, out, job), nprocs=d)
        ranks = []
        for r in range(d):
            with open(os.path.join(out, f"{r}.pkl"), "rb") as f:
                ranks.append(pickle.load(f))
    return ranks


def _comm_theory(kind, d, pbytes, micro):
    f = (d - 1) / d
    return {"plain": 2 * f * 4, "zero1": f * (4 + pbytes), "zero2": f * (4 * micro + pbytes),
            "zero3": f * (4 * micro + 2 * micro * pbytes)}[kind]


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
    p.add_argument("--big-layers", type=int, default=8)
    p.add_argument("--big-hidden", type=int, default=512, help="0: skip the big-model and timing parts")
    p.add_argument("--big-dp", type=int, default=4)
    p.add_argument("--time-dp", type=int, default=2)
    p.add_argument("--time-micro", type=int, default=2, help="micro-batches per timed iteration")
    p.add_argument("--iters", type=int, default=5)
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
            peak = max((r[key]["peak_units"] for r in ranks if r[key]["peak_units"] is not None), default=None)
            rows.append((d, dtype, kind, micro, meas, want, mem_ratio, wire, theory, comm_ratio,
                         ranks[0][key]["calls"], peak, ranks[0][key]["psi"]))
    print(f"model: {a.layers} layers, hidden {a.hidden}, vocab {a.vocab} (untied output layer), seq {a.seq}; "
          f"Ψ = {rows[0][-1]:,} parameters; DP bucket {a.bucket:,} elements; torch {torch.__version__}")
    print("| d | params | optimizer | M | memory B/param (measured) | formula | ratio "
          "| comm B/param/step (measured) | theory | ratio | gathered peak (units) | collectives per step |")
    print("|--:|--|--|--:|--:|--:|--:|--:|--:|--:|--:|--|")
    for d, dtype, kind, micro, meas, want, mr, wire, theory, cr, calls, peak, _ in rows:
        cr_s = f"{cr:.4f}" if cr is not None else "-"
        calls_s = ", ".join(f"{k} x{v}" for k, v in sorted(calls.items())) or "none"
        peak_s = f"{peak:.2f}" if peak is not None else "-"
        print(f"| {d} | {dtype} | {kind} | {micro} | {meas:.3f} | {want:.3f} | {mr:.4f} | {wire:.3f} | "
              f"{theory:.3f} | {cr_s} | {peak_s} | {calls_s} |")
    print(f"worst deviation from the formulas: {worst * 100:.3f}% (goal <= 2%)")
    if a.big_hidden:
        _big(a)


def _big(a):
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 17)  # the memory runs' ranks inherit it (not the timed ones)
    try:
        (one,), ranks = _run(1, a, _big_job), _run(a.big_dp, a, _big_job)
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
    worst = max(ranks, key=lambda r: r["peak"])
    print(f"\nbig model: {a.big_layers} layers, hidden {a.big_hidden}, fp32, Ψ = {one['psi']:,}; "
          f"fp32 weights + Adam = {16 * one['psi'] / 2**20:.0f} MiB")
    print("| run | training state per rank (MiB, at rest) | peak with gathered units + grads in flight (MiB) "
          "| peak RSS over the idle process (MiB) |")
    print("|--|--:|--:|--:|")
    print(f"| one process, plain optimizer | {one['rest'] / 2**20:.1f} | {one['rest'] / 2**20:.1f} | "
          f"{one['rss_mb']:.0f} |")
    print(f"| DP{a.big_dp} ZeRO-3 (worst rank) | {worst['rest'] / 2**20:.1f} | {worst['peak'] / 2**20:.1f} | "
          f"{max(r['rss_mb'] for r in ranks):.0f} |")
    print(f"fp32 weights + Adam / ZeRO-3 state per rank: {16 * one['psi'] / worst['rest']:.2f}x; "
          f"peak per rank / one process: {worst['peak'] / one['rest']:.3f}")
    times = _run(a.time_dp, a, _time_job)
    t = {k: max(r[k] for r in times) for k in times[0]}
    print(f"\nstep time, DP{a.time_dp}, {a.time_micro} micro-batches of 2 x {a.seq} tokens, median of {a.iters} "
          "(slowest rank):")
    print("| ZeRO-3 prefetch (ms) | ZeRO-3 no prefetch (ms) | ZeRO-2 (ms) | prefetch / none | ZeRO-3 / ZeRO-2 |")
    print("|--:|--:|--:|--:|--:|")
    print(f"| {t['zero3']:.1f} | {t['zero3-no-prefetch']:.1f} | {t['zero2']:.1f} | "
          f"{t['zero3'] / t['zero3-no-prefetch']:.3f} | {t['zero3'] / t['zero2']:.3f} |")


if __name__ == "__main__":
    main()
