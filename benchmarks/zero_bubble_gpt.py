"""A real GPT's step under 1F1B, ZB-H1, ZB-V and DualPipeV (--pipeline-schedule zb-h1|zbv|dualpipev; DualPipeV
where the micro-batches are at least 2 x --pp) side by side: `pretrain_gpt.py`
on --pp CPU ranks (gloo, one thread each, torchrun), mock data, the same model and batch; the arms alternate so the
machine's drift falls on all. Prints per schedule the median time per iteration (warm-up left out) and its ratio to
1F1B's, the measured F / B / W of each rank's chunks (ms; 1F1B's B is its whole backward), each rank's busy share,
and two predictions of the ratio: the bubble theory's with F = B = W (1F1B (m+p-1)(F+B+W) against ZB-H1's 3m+p-1
units and the V's plans' steps, their units half a stage's: ZB-V's and DualPipeV's 3m+(p-1)/2 at p = 2, 4 for
m >= p), and the plan replayed with
the measured costs (each rank's actions in the plan's order, each waiting for the message it needs; messages
free), which tells the schedule's share of a gap from the machine's.

    python benchmarks/zero_bubble_gpt.py [--pp 2 --micro-batches 8 --hidden 256 --layers 4 --rounds 2]
"""

import argparse
import atexit
import collections
import json
import os
import re
import runpy
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULES = ("1f1b", "zb-h1", "zbv", "dualpipev")
OPS = {"forward": "F", "backward": "B", "backward_input": "B", "backward_weight": "W"}


def _rank_entry(out_dir, argv):
    """Run pretrain_gpt.py with megalite's Run actions timed; at exit write {chunk: {op: mean ms}} per rank."""
    sys.path[0] = ROOT  # (as `python pretrain_gpt.py` has it: benchmarks/kernels.py is not the kernels package)
    from megalite.pipeline import run as R
    total, count = collections.defaultdict(float), collections.Counter()

    def timed(name, op):
        f = getattr(R.Run, name)

        def g(self, chunk, *a, **k):
            t = time.perf_counter()
            out = f(self, chunk, *a, **k)
            total[(chunk, op)] += time.perf_counter() - t
            count[(chunk, op)] += 1
            return out
        setattr(R.Run, name, g)
    for name, op in OPS.items():
        timed(name, op)

    def write():
        costs = collections.defaultdict(dict)
        for (chunk, op), t in total.items():
            costs[chunk][op] = 1e3 * t / count[(chunk, op)]
        with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(costs, f)
    atexit.register(write)
    sys.argv = [os.path.join(ROOT, "pretrain_gpt.py")] + argv
    runpy.run_path(sys.argv[0], run_name="__main__")


def _run(schedule, a):
    """(iteration ms after the warm-up, per rank {chunk: {op: ms}})."""
    flags = (f"--mock-data --num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads 8 "
             f"--seq-length {a.seq} --max-position-embeddings {a.seq} --micro-batch-size {a.micro} "
             f"--global-batch-size {a.micro * a.micro_batches} --train-iters {a.iters} --lr 1e-4 --log-interval 1 "
             f"--eval-iters 0 --num-workers 0 --pipeline-model-parallel-size {a.pp} --pipeline-schedule {schedule} "
             "--vocab-size 4096 --tokenizer-type NullTokenizer")
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.pp), "--master-port",
               str(a.port), os.path.abspath(__file__), "--rank-entry", d] + flags.split()
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        log = out.stdout + out.stderr
        times = [float(t) for t in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", log)]
        if out.returncode or len(times) < a.iters:
            raise SystemExit(f"{schedule}: exit {out.returncode}\n{log[-3000:]}")
        costs = []
        for r in range(a.pp):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                costs.append({int(c): ops for c, ops in json.load(f).items()})
    return times[a.warmup:], costs


def replay(schedule, p, m, costs):
    """The plan's step (ms) with measured costs: costs[rank][chunk][op]. 1F1B's B is its whole backward, and its
    gradient leaves after it (as 1F1B's one backward sends it)."""
    from megalite.pipeline.zero_bubble import B, F, make_plan
    plan = make_plan(schedule, p, m)
    st, last, whole = plan.stages, plan.stages.count - 1, schedule == "1f1b"
    done, pos, free = {}, [0] * p, [0.0] * p
    while any(pos[r] < len(plan.actions[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(plan.actions[r]):
                act = plan.actions[r][pos[r]]
                s = st.stage(r, act.chunk)
                need = (F, s - 1, act.mb) if act.op == F and s > 0 else \
                    (B, s + 1, act.mb) if act.op == B and s < last else None
                if need is not None and need not in done:
                    break
                cost = 0.0 if whole and act.op not in (F, B) else costs[r][act.chunk][act.op]
                free[r] = done[(act.op, s, act.mb)] = max(free[r], done.get(need, 0.0)) + cost
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"{schedule}: the replay stalls")
    return max(free)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-entry":
        return _rank_entry(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=29517)
    a = ap.parse_args()
    if a.layers % (2 * a.pp):
        raise SystemExit(f"--layers {a.layers} must divide into 2 x --pp {a.pp} for zbv's two chunks a rank")
    schedules = [s for s in SCHEDULES if s != "dualpipev" or a.micro_batches >= 2 * a.pp]
    got, costs = {s: [] for s in schedules}, {}
    for _ in range(a.rounds):
        for schedule in schedules:
            times, costs[schedule] = _run(schedule, a)  # (the last round's costs)
            got[schedule] += times
    median = {s: statistics.median(t) for s, t in got.items()}
    p, m = a.pp, a.micro_batches
    from megalite.pipeline.zero_bubble import make_plan
    theory = {s: make_plan(s, p, m).makespan / (2 if s in ("zbv", "dualpipev") else 1) / (3 * (m + p - 1))
              for s in schedules}  # (1F1B's plan: 3 (m + p - 1) units)
    replayed = {s: replay(s, p, m, costs[s]) for s in schedules}
    print(f"GPT {a.layers} layers, hidden {a.hidden}, seq {a.seq}, micro-batch {a.micro}, {m} micro-batches, "
          f"PP{p} on {os.cpu_count()} cores (gloo, 1 thread a rank); median of {len(got['1f1b'])} iterations each")
    print(f"{'schedule':<10}{'ms / iter':>11}{'x 1f1b':>8}{'theory F=B=W':>14}{'replayed':>10}{'x 1f1b':>8}"
          f"{'busy by rank':>16}   F / B / W ms by rank and chunk")
    for s in schedules:
        busy = [m * sum(sum(ops.values()) for ops in costs[s][r].values()) / median[s] for r in range(p)]
        fbw = "  ".join(f"r{r}c{c} " + "/".join(f"{ops.get(op, 0.0):.1f}" for op in "FBW")
                        for r in range(p) for c, ops in sorted(costs[s][r].items()))
        print(f"{s:<10}{median[s]:>11.1f}{median[s] / median['1f1b']:>8.3f}{theory[s]:>14.3f}{replayed[s]:>10.1f}"
              f"{replayed[s] / replayed['1f1b']:>8.3f}{' '.join(f'{b:.2f}' for b in busy):>16}   {fbw}")


if __name__ == "__main__":
    main()
