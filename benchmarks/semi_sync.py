"""Semi-synchronous replicas on an uneven, distant cluster, emulated on 4 CPU ranks (gloo): synchronous
DP (equal shares, --data-parallel-shares auto) against Local SGD, DiLoCo and Streaming DiLoCo (equal, uneven
and auto inner steps) and asynchronous outer updates (Local SGD, DiLoCo; staleness 1).

The cluster: 2 "nodes" of 2 ranks (ranks 0-1, 2-3). The GPUs are emulated by a sleep per micro-batch
(forward) of --fast-ms on node 0 and --slow-ms on node 1 (2x slower), so that the 2 CPU cores' own
compute, shared by the 4 ranks, is a small part of a step. The link between the nodes is slow: this
script wraps torch.distributed's collectives (not megalite's) and, for every collective whose group spans
both nodes, sleeps the bytes a ring puts on the cross-node link (all-reduce 2(n-1)/n x payload,
all-gather / reduce-scatter (n-1)/n x, broadcast and point-to-point send 1x) at --link-gbit Gbit/s, and counts
them. With
replicas (R = 2) each node is one replica.

Every mode trains the same GPT (default corpus, its 8192-token vocabulary) for --iters iterations of
global batch --batch, evaluating every --eval-interval iterations (Streaming DiLoCo and the asynchronous modes: at
the end only).
Printed per mode: validation loss against wall-clock (evaluation time excluded) and tokens trained, the
wall-clock to reach the target (synchronous DP's validation loss at 3/4 of its run), bytes over the slow
link per token trained, and the loss at the end relative to synchronous DP's.

    python benchmarks/semi_sync.py [--iters 120 --fast-ms 50 --slow-ms 100 --link-gbit 1]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import tempfile
import time

import torch

from gloo_ranks import spawn


class SlowLink:
    """Wraps torch.distributed's collectives: a group spanning both nodes pays its cross-node bytes at
    `gbit` Gbit/s (a sleep) and counts them."""
    RING = {"all_reduce": 2.0, "broadcast": None, "all_gather_into_tensor": 1.0, "reduce_scatter_tensor": 1.0,
            "all_gather_single": 1.0, "reduce_scatter_single": 1.0, "send": None}  # (send: the asynchronous mode)

    def __init__(self, gbit, ranks_per_node):
        import torch.distributed as dist
        self.dist, self.rate, self.per_node, self.bytes = dist, gbit * 1e9 / 8, ranks_per_node, 0.0
        self.originals = {}
        for name, factor in self.RING.items():
            if hasattr(dist, name):
                self.originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self.originals[name], factor))
        from megalite import parallel_state as ps
        from megalite.distributed import comm
        from megalite.tensor_parallel import mappings
        ps.all_gather_tensor = comm._all_gather = mappings._all_gather_tensor = self._pick("all_gather")
        ps.reduce_scatter_tensor = comm._reduce_scatter = mappings._reduce_scatter_tensor = self._pick("reduce_scatter")

    def _pick(self, kind):
        name = f"{kind}_single" if f"{kind}_single" in self.originals else \
            ("all_gather_into_tensor" if kind == "all_gather" else "reduce_scatter_tensor")
        return getattr(self.dist, name)

    def _wrap(self, name, fn, factor):
        def wrapped(*args, **kw):
            group = kw.get("group")
            ranks = self.dist.get_process_group_ranks(group) if group is not None else \
                list(range(self.dist.get_world_size()))
            if min(ranks) // self.per_node != max(ranks) // self.per_node:
                payload = max(a.numel() * a.element_size() for a in args[:2] if torch.is_tensor(a))
                n = len(ranks)
                link = payload if factor is None else factor * (n - 1) / n * payload
                self.bytes += link
                time.sleep(link / self.rate)
            return fn(*args, **kw)
        return wrapped


def _modes(a):
    h1, h2, only = a.h, 2 * a.h, [o for o in (a.only or "").split(",") if o]
    modes = [("sync DP, equal shares", []),
            ("sync DP, shares auto", ["--data-parallel-shares", "auto", "--data-parallel-shares-profile-iters", "2"]),
            (f"Local SGD H={h1}", ["--semi-sync-method", "local_sgd", "--semi-sync-replicas", "2",
                                   "--semi-sync-steps", str(h1)]),
            (f"Local SGD H={h2},{h1} (uneven)", ["--semi-sync-method", "local_sgd", "--semi-sync-replicas", "2",
                                                 "--semi-sync-steps", f"{h2},{h1}"]),
            (f"Local SGD H=auto:{h2}", ["--semi-sync-method", "local_sgd", "--semi-sync-replicas", "2",
                                        "--semi-sync-steps", f"auto:{h2}"]),
            (f"DiLoCo H={h1}", ["--semi-sync-method", "diloco", "--semi-sync-replicas", "2",
                                "--semi-sync-steps", str(h1)]),
            (f"DiLoCo H={h2}", ["--semi-sync-method", "diloco", "--semi-sync-replicas", "2",
                                "--semi-sync-steps", str(h2)]),
            (f"DiLoCo H={h2},{h1} (uneven)", ["--semi-sync-method", "diloco", "--semi-sync-replicas", "2",
                                              "--semi-sync-steps", f"{h2},{h1}"]),
            (f"Streaming DiLoCo H={h2} K=2", ["--semi-sync-method", "diloco", "--semi-sync-replicas", "2",
                                              "--semi-sync-steps", str(h2), "--semi-sync-fragments", "2",
                                              "--semi-sync-fragment-delay", "1", "--semi-sync-fragment-alpha", "0.5",
                                              "--eval-interval", "0"]),
            # asynchronous: no periodic evaluation (replicas hold the same weights at the end only)
            (f"async Local SGD H={h1} S=1", ["--semi-sync-method", "local_sgd", "--semi-sync-replicas", "2",
                                             "--semi-sync-steps", str(h1), "--semi-sync-async",
                                             "--semi-sync-max-staleness", "1", "--eval-interval", "0"]),
            (f"async DiLoCo H={h1} S=1", ["--semi-sync-method", "diloco", "--semi-sync-replicas", "2",
                                          "--semi-sync-steps", str(h1), "--semi-sync-async",
                                          "--semi-sync-max-staleness", "1", "--eval-interval", "0"])]
    return [m for m in modes if not only or m[0] == modes[0][0] or any(o in m[0] for o in only)]


def _flags(a, cache):
    return (f"--num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads 4 --seq-length {a.seq} "
            f"--max-position-embeddings {a.seq} --micro-batch-size {a.micro} --global-batch-size {a.batch} "
            f"--train-iters {a.iters} --lr {a.lr} --lr-warmup-iters 10 --lr-decay-style constant --log-interval 1000 "
            f"--eval-interval {a.eval_interval} --eval-iters {a.eval_iters} --num-workers 0 --hidden-dropout 0 "
            f"--attention-dropout 0 --data-cache-path {cache} --seed 1234").split()


def _runs(a, cache):
    """In each rank: one pretrain per mode, node 1 slowed, the link slowed; the last rank returns
    {mode: (evaluations [(iteration, seconds, validation loss)], bytes over the link, seconds)}."""
    import pretrain_gpt
    from megalite import parallel_state as ps
    from megalite import training
    from megalite.training import parts
    from megalite.cli.parser import parse_args
    from megalite.logger import MetricsLogger
    link = SlowLink(a.link_gbit, 2)
    original = pretrain_gpt.forward_step
    device_ms = a.slow_ms if ps.global_rank() >= 2 else a.fast_ms

    def forward_step(it, model):
        time.sleep(device_ms / 1e3)
        return original(it, model)
    evals, clock = [], {}
    evaluate = parts.evaluate

    def timed_evaluate(*args, **kw):
        t = time.perf_counter()
        try:
            return evaluate(*args, **kw)
        finally:
            clock["eval"] += time.perf_counter() - t

    def evaluation(self, it, split, losses, final=False):
        if split == "validation" and (not final or not evals or evals[-1][0] != it):  # (streaming: the end only)
            evals.append((it, time.perf_counter() - clock["t0"] - clock["eval"], losses["lm loss"]))
    parts.evaluate, MetricsLogger.evaluation = timed_evaluate, evaluation
    clock.update(t0=time.perf_counter(), eval=0.0)  # untimed warm-up: builds the default corpus, fills caches
    warm = _flags(a, cache)
    warm[warm.index("--train-iters") + 1] = "2"
    warm[warm.index("--lr-warmup-iters") + 1] = "0"
    training.pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, forward_step,
                      parse_args(warm + ["--eval-interval", "2"], world_size=4))
    ps.destroy_model_parallel()
    out = {}
    for name, flags in _modes(a):
        evals.clear()
        clock.update(t0=time.perf_counter(), eval=0.0)
        link.bytes = 0.0
        args = parse_args(_flags(a, cache) + flags, world_size=4)
        _, _, opt = training.pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, forward_step, args,
                                      return_state=True)
        chosen = [getattr(opt, "semi_sync", None) and opt.semi_sync.steps]
        ps.destroy_model_parallel()
        out[name] = (list(evals), link.bytes, time.perf_counter() - clock["t0"] - clock["eval"])
        if any(f.startswith("auto:") for f in flags):  # --semi-sync-steps auto's choice
            out["auto counts"] = ",".join(map(str, chosen[0]))
    return out


def _tokens(a, flags, it):
    """Tokens trained by iteration `it`: all of every global batch, except the shares of the ticks a
    replica of fewer inner steps idles through."""
    if "--semi-sync-steps" not in flags:
        return it * a.batch * a.seq
    text = flags[flags.index("--semi-sync-steps") + 1]
    if text.startswith("auto"):  # (the chosen counts, recorded by the run)
        text = a.auto_counts
    steps = [int(h) for h in text.split(",")]
    steps = steps * (2 // len(steps))
    rnd = max(steps)
    samples = sum(min(h, rnd) * (it // rnd) + min(h, it % rnd) for h in steps) * a.batch // 2
    return samples * a.seq


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--iters", type=int, default=120)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--h", type=int, default=10, help="DiLoCo / Local SGD inner steps (and 2x that)")
    p.add_argument("--eval-interval", type=int, default=20)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--fast-ms", type=float, default=50.0, help="node 0's emulated GPU time per micro-batch")
    p.add_argument("--slow-ms", type=float, default=100.0, help="node 1's")
    p.add_argument("--link-gbit", type=float, default=1.0)
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--log-dir", default=None, help="write each mode's validation losses against wall-clock seconds "
                   "as DIR/<mode>.jsonl (plot them: tools/plot_metrics.py DIR/*.jsonl --x seconds)")
    p.add_argument("--only", default=None, help="comma-separated parts of mode names to run (sync DP, equal shares "
                                                "always runs: it sets the target)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        res = spawn(4, _runs, a, cache)[3]
    modes = dict(_modes(a))
    a.auto_counts = res.pop("auto counts", f"{2 * a.h},{a.h}")
    base_name = "sync DP, equal shares"
    base = res[base_name][0]
    target = base[max(0, (3 * len(base)) // 4 - 1)][2]
    print(f"\n4 gloo ranks = 2 nodes x 2; emulated GPU time per micro-batch {a.fast_ms:g} ms on node 0, "
          f"{a.slow_ms:g} ms on node 1; the cross-node link "
          f"{a.link_gbit:g} Gbit/s (emulated); GPT L{a.layers} h{a.hidden} seq {a.seq}, global batch {a.batch}, "
          f"{a.iters} iterations; target: sync DP's validation loss at 3/4 of its run, {target:.4f}")
    print(f"Local SGD auto chose inner steps {a.auto_counts} per round (fast node, slow node)")
    print(f"{'mode':<28}{'wall s':>8}{'to target s':>13}{'vs sync':>9}{'link MB':>10}{'B/token':>9}"
          f"{'vs sync':>9}{'final loss':>12}{'vs sync':>9}")
    rows = {}
    for name, flags in modes.items():
        evals, nbytes, wall = res[name]
        reach = next((t for it, t, loss in evals if loss <= target), None)
        tokens = _tokens(a, flags, a.iters)
        rows[name] = dict(wall=wall, reach=reach, bytes=nbytes, per_token=nbytes / tokens, final=evals[-1][2],
                          evals=[(it, t, loss, _tokens(a, flags, it)) for it, t, loss in evals])
    b = rows[base_name]
    for name, r in rows.items():
        reach = f"{r['reach']:.1f}" if r["reach"] is not None else "not reached"
        ratio = f"{r['reach'] / b['reach']:.2f}x" if r["reach"] is not None and b["reach"] else "-"
        print(f"{name:<28}{r['wall']:8.1f}{reach:>13}{ratio:>9}{r['bytes'] / 1e6:10.2f}{r['per_token']:9.1f}"
              f"{b['per_token'] / max(r['per_token'], 1e-9):8.1f}x{r['final']:12.4f}{r['final'] / b['final']:8.3f}x")
    print("\nvalidation loss by (iteration, wall s, tokens):")
    for name, r in rows.items():
        print(f"  {name:<28}" + "  ".join(f"({it}, {t:.1f}s, {tok // 1000}k) {loss:.3f}"
                                          for it, t, loss, tok in r["evals"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "target": target, "rows": rows}, f, indent=1)
    if a.log_dir:  # megalite's --log-json rows, one file per mode, for tools/plot_metrics.py --x seconds
        os.makedirs(a.log_dir, exist_ok=True)
        for name, r in rows.items():
            slug = "".join(c if c.isalnum() else "_" for c in name).strip("_")
            with open(os.path.join(a.log_dir, f"{slug}.jsonl"), "w") as f:
                for it, t, loss, _ in r["evals"]:
                    f.write(json.dumps({"iteration": it, "seconds": round(t, 3), "validation lm loss": loss}) + "\n")


if __name__ == "__main__":
    main()
