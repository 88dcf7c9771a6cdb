"""Pipeline bubble: measured idle fraction per stage vs theory, and peak live activations.

Each stage is a layer of known cost: forward takes t_f, backward t_b = 2 t_f. The cost is
a sleep, not arithmetic, so that p ranks on a 2-core machine do not slow each other down
and the schedule alone decides the idle time. The real megalite schedules and p2p run
underneath (gloo ranks). Idle fraction of a stage = 1 - busy / iteration wall time.
Theory: 1F1B (p-1)/(m+p-1); interleaved with v chunks per stage (p-1)/(v m+p-1); ZB-H1 (--pipeline-schedule
zb-h1: the backward split into B, the input gradient, and W, the weight gradient, t_f each) (p-1)/(3m+p-1) for m >= p;
ZB-V (--pipeline-schedule zbv: two chunks per rank in a V, each half the stage's cost, the backward split) at
p = 2, 4 (p-1)/(6m+p-1) for m >= p (its plan's; a few units more at other p); DualPipeV (--pipeline-schedule
dualpipev: ZB-V's V in DualPipe's order, m >= 2p) its plan's, as ZB-V's at p = 2, 4 (the V schedules' theory is
their plan's unit-cost step, megalite/pipeline/zero_bubble.py).
Also prints the peak number of micro-batches whose activations are alive on each stage,
1F1B and ZB-H1 vs all-forwards-then-all-backwards (GPipe), and ZB-V's and DualPipeV's in chunk-activations (half a
stage's each; 1F1B's first stage holds 2p of them, DualPipeV 2p + 1).

    python benchmarks/pipeline_bubble.py [--p 4 --ms 4 8 16 --v 2 --tf-ms 10]
"""

import os
import sys

# Run as a script, this folder comes first on sys.path and its kernels.py would shadow the
# `kernels` package: put the repository root first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from megalite.pipeline.zero_bubble import make_plan

BUSY = [0.0]
SHAPE = (8, 1, 16)
V_KINDS = {}  # (the schedules of two chunks per rank in a V: kind -> its megalite schedule, set in the ranks)
PLANS = {"ZB-V": "zbv", "DualPipeV": "dualpipev"}


def _sleep(seconds):
    t = time.perf_counter()
    time.sleep(seconds)
    BUSY[0] += time.perf_counter() - t


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tf, tb, w, store):
        ctx.tb, ctx.w, ctx.store = tb, w, store
        _sleep(tf)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.store is None:
            _sleep(ctx.tb)
            return g, None, None, None, None
        _sleep(ctx.tb / 2)  # a split backward: B now, W (the other half) when the schedule says
        w = ctx.w

        def weight_gradient():
            _sleep(ctx.tb / 2)
            return w, torch.zeros_like(w)
        ctx.store.put(weight_gradient)
        return g, None, None, None, None


class SleepStage(nn.Module):
    def __init__(self, tf, tb, first=None):
        super().__init__()
        self.first = first  # whether this chunk is the model's first (None: this rank's stage is)
        self.w = nn.Parameter(torch.ones(1))
        self.tf, self.tb, self.inp = tf, tb, None
        self.config = None  # (no model configuration: the schedules' defaults, e.g. micro-batch groups of PP)

    wgrad_store = None  # set by a zero-bubble schedule (megalite/pipeline/wgrad.py): the backward split
    def set_input_tensor(self, t):
        self.inp = t

    def forward(self, first):
        x = torch.ones(SHAPE) if first else self.inp
        return _Sleep.apply(x * self.w, self.tf, self.tb, self.w, self.wgrad_store)


def _forward_step(_it, model):
    from megalite import parallel_state as ps
    # (an interleaved rank's later chunks receive their input even on the first stage)
    out = model(ps.is_pipeline_first_stage() if model.first is None else model.first)
    return out, lambda o: (o.sum(), {"lm loss": o.sum().detach()})


def _gpipe(chunks, m):
    """All forwards, then all backwards: the baseline that keeps m micro-batches alive."""
    from megalite import parallel_state as ps
    from megalite.pipeline.p2p import P2P
    p2p = P2P(SHAPE, torch.float32, torch.device("cpu"), ps.current_grid())
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    ins, outs, peak = [], [], 0
    for _ in range(m):
        inp = None if first else p2p.recv_forward().requires_grad_(True)
        chunks[0].set_input_tensor(inp)
        out = chunks[0](first)
        if not last:
            p2p.send_forward(out)
        ins.append(inp)
        outs.append(out)
        peak = max(peak, len(outs))
    for _ in range(m):
        inp, out = ins.pop(0), outs.pop(0)
        g = None if last else p2p.recv_backward()
        torch.autograd.backward(out.sum() if last else out, None if last else g)
        if not first:
            p2p.send_backward(inp.grad)
    return peak


def _p2p_latency(n=50):
    """One-way time of a batched p2p message between stages 0 and 1 (ping-pong / 2)."""
    from megalite import parallel_state as ps
    from megalite.pipeline.p2p import P2P
    p2p, r = P2P(SHAPE, torch.float32, torch.device("cpu"), ps.current_grid()), ps.get_pipeline_model_parallel_rank()
    x = torch.ones(SHAPE)
    dist.barrier()
    t = time.perf_counter()
    for _ in range(n):
        if r == 0:
            p2p.send_forward(x)
            p2p.recv_backward()
        elif r == 1:
            p2p.recv_forward()
            p2p.send_backward(x)
    return (time.perf_counter() - t) / (2 * n)


def _rank(rank, p, port, args, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=p)
    from megalite import parallel_state as ps
    from megalite.pipeline import schedules
    from megalite.pipeline.interleaved import forward_backward_pipelining_with_interleaving
    from megalite.pipeline.run import ScheduleTrace
    V_KINDS.update({"ZB-V": schedules.forward_backward_pipelining_zero_bubble_v,
                    "DualPipeV": schedules.forward_backward_pipelining_dualpipe_v})
    tf = args.tf_ms / 1000
    trace = ScheduleTrace()
    rows = []
    for kind, v in (("1F1B", 1), ("ZB-H1", 1), ("ZB-V", 2), ("DualPipeV", 2), ("interleaved", args.v)):
        ps.initialize_model_parallel(1, p, v if v > 1 else None,
                                     pipeline_placement="v" if kind in V_KINDS else "loop")
        # Interleaving (and the V) splits the stage's work into v chunks of 1/v the cost each.
        g = ps.current_grid()
        chunks = [SleepStage(tf / v, 2 * tf / v, g.stage_of(i) == 0) for i in range(v)]
        for m in args.ms:
            if (kind == "interleaved" and m % p) or (kind == "DualPipeV" and m < 2 * p):
                continue
            fracs = []
            for _ in range(args.repeats + 1):  # (the first call is a warm-up: gloo's first messages of a kind)
                dist.barrier()
                BUSY[0] = 0.0
                t0 = time.perf_counter()
                if kind in V_KINDS:
                    V_KINDS[kind](
                        _forward_step, [None] * v, chunks, m, tensor_shape=SHAPE, dtype=torch.float32, trace=trace)
                elif kind == "ZB-H1":
                    schedules.forward_backward_pipelining_zero_bubble(
                        _forward_step, None, chunks[0], m, tensor_shape=SHAPE, dtype=torch.float32, trace=trace)
                elif v == 1:
                    schedules.forward_backward_pipelining_without_interleaving(
                        _forward_step, None, chunks[0], m, tensor_shape=SHAPE, dtype=torch.float32, trace=trace)
                else:
                    forward_backward_pipelining_with_interleaving(
                        _forward_step, [None] * v, chunks, m, tensor_shape=SHAPE, dtype=torch.float32, trace=trace)
                dist.barrier()
                fracs.append(1 - BUSY[0] / (time.perf_counter() - t0))
            rows.append((kind, v, m, statistics.median(fracs[1:]), trace.max_alive))
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, p)
    chunk = SleepStage(0.0, 0.0)
    gpipe = {m: _gpipe([chunk], m) for m in args.ms}
    latency = _p2p_latency()
    ps.destroy_model_parallel()
    q.put((rank, rows, gpipe, latency))
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--ms", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--v", type=int, default=2)
    ap.add_argument("--tf-ms", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.p, port, args, q)) for r in range(args.p)]
    for pr in procs:
        pr.start()
    got = [q.get(timeout=600) for _ in procs]
    results = {r: (rows, gp) for r, rows, gp, _ in got}
    latency = next(lat for r, _, _, lat in got if r == 0)
    for pr in procs:
        pr.join()
    p = args.p
    print(f"pipeline bubble: p={p} stages (gloo CPU ranks), t_f={args.tf_ms} ms, t_b={2 * args.tf_ms} ms "
          f"per stage per micro-batch, median of {args.repeats} after a warm-up")
    print(f"one p2p message between stages (gloo, batched send/recv) takes {latency * 1e3:.2f} ms; the theory "
          "counts none, so each schedule step adds about that to the measured idle time")
    print(f"{'schedule':<13}{'v':>3}{'m':>5}{'theory':>9}{'measured (mean of stages)':>28}{'ratio':>8}"
          f"{'worst stage':>13}")
    for i, (kind, v, m, _, _) in enumerate(results[0][0]):
        work = {"ZB-H1": 3 * m}.get(kind, v * m)  # (ZB-H1's: m >= p)
        theory = 1 - 6 * m / make_plan(PLANS[kind], p, m).makespan if kind in PLANS else (p - 1) / (work + p - 1)
        per_stage = [results[r][0][i][3] for r in range(p)]
        mean = sum(per_stage) / p
        print(f"{kind:<13}{v:>3}{m:>5}{theory:>9.3f}{mean:>28.3f}{mean / theory:>8.3f}{max(per_stage):>13.3f}")
    print("\npeak micro-batches with live activations per stage (1F1B, ZB-H1 vs all-forward-then-backward; ZB-V, "
          "DualPipeV: chunk-activations, half a stage's each; '-': not run at that m):")
    print(f"{'m':>4}  " + "  ".join(f"stage {s}: 1F1B/ZB-H1/GPipe/ZB-V/DualPipeV" for s in range(p)))
    for m in args.ms:
        def alive(kind, s):
            row = [row for row in results[s][0] if row[0] == kind and row[2] == m]
            return str(row[0][4]) if row else "-"
        cells = ["/".join([alive("1F1B", s), alive("ZB-H1", s), str(results[s][1][m]), alive("ZB-V", s),
                           alive("DualPipeV", s)]) for s in range(p)]
        print(f"{m:>4}  " + "  ".join(f"{c:>35}" for c in cells))


if __name__ == "__main__":
    main()
