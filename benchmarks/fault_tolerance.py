"""Fault-tolerant replicas (torchft) against checkpoint-restart, on CPU ranks, under the same seeded failures.

Arms in one run, each training a small GPT for --iters iterations with --replicas data-parallel copies:
  no failures        R torchft replicas (python processes) around torchft_lighthouse, nothing killed;
  megalite FT        the same, replica 1 SIGKILLed when it logs each failure's iteration and restarted at once (as
                     its torchrun would restart it): the survivors go on, the restarted one heals from them. Run
                     at each Lighthouse join timeout of --join-timeout-ms: how long a quorum waits for a replica
                     that still heartbeats but has not asked, so after a death the survivors wait for the shorter
                     of it and the heartbeat timeout (a short one leaves a straggler out: it heals next step);
  checkpoint-restart one torchrun job of R ranks with --max-restarts and --save-interval K, a rank SIGKILLed at
                     the same iterations: the whole job restarts from its last checkpoint. Run at each K of
                     --save-interval; the fastest is the cost-optimal K, measured (the table shows each);
  plain job          the torchrun job without failures or saves: what FT's per-step quorum and vote cost.
Every arm trains the same batches (FT and a resumed run reproduce the uninterrupted trajectory), so the time to
the same loss is the time to the last iteration. It prints wall-clock, goodput (committed iterations per second
relative to the FT replicas without failures), iterations trained more than once (recomputed) or never (samples
lost), failures seen, and for FT each failure's recovery (the kill to the restarted replica's first iteration
with the others) and the survivors' longest stall against the Lighthouse's heartbeat timeout plus one step.

The failures: one every --every iterations, each moved by a seeded draw of up to a quarter of that either way (a
schedule in step with the save interval would always strike just before a save, checkpoint-restart's worst
case), far enough apart that a restarted replica (about 3 s of imports) is back before the next: every kill point
is reached. Every process runs one intra-op thread (torchrun's default for its workers; replicas started alone
would each take a thread per core and fight over the cores).

    python benchmarks/fault_tolerance.py [--iters 480] [--every 80] [--save-interval 5,10,20]
        [--join-timeout-ms 1000,100] [--replicas 3] [--seed 0]
"""

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
         "--vocab-size 512 --micro-batch-size 4 --lr 1e-3 --mock-data --num-workers 0 "
         "--hidden-dropout 0 --attention-dropout 0 --eval-iters 0 --eval-interval 0 --log-interval 1").split()
HEARTBEAT_TIMEOUT_MS = 1000


def model(replicas):
    """The model's flags with a global batch of two micro-batches per replica."""
    return MODEL + ["--global-batch-size", str(8 * replicas)]
ITER = re.compile(r"iteration\s+(\d+)/")
QUORUM = re.compile(r"the quorum took ([0-9.]+) s")  # (a replica's line at each change of the quorum)


def _port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class Proc:
    """A process whose output is read line by line; kill_at: iterations at which to SIGKILL it (its own or a
    torchrun worker's), once each."""

    def __init__(self, cmd, env, log, kill_at=(), victim=None):
        self.p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True)
        self.kill_at, self.victim, self.iters, self.killed = set(kill_at), victim, [], []
        self.times, self.kill_times = [], []  # (when each iteration was logged; when each kill was sent)
        self.waits = []  # how long each new quorum took it (the first: the start)
        self.thread = threading.Thread(target=self._read, args=(log,), daemon=True)
        self.thread.start()

    def _read(self, log):
        for line in self.p.stdout:
            log.write(line)
            q = QUORUM.search(line)
            if q:
                self.waits.append(float(q.group(1)))
            m = ITER.search(line)
            if m:
                it = int(m.group(1))
                self.iters.append(it)
                self.times.append(time.perf_counter())
                if it in self.kill_at:
                    self.kill_at.discard(it)
                    self.killed.append(it)
                    self.kill_times.append(time.perf_counter())
                    os.kill(self.victim() if self.victim else self.p.pid, signal.SIGKILL)

    def wait(self, timeout=900):
        rc = self.p.wait(timeout=timeout)
        self.thread.join(timeout=30)
        return rc


def _env():
    # one intra-op thread a process in every arm, as torchrun gives its workers: an FT replica started alone would
    # take a thread per core, and three of them would fight over two cores where the torchrun job's ranks do not
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    env.pop("TORCHFT_LIGHTHOUSE", None)
    return env


def ft_arm(iters, kill_at, log, replicas, join_ms=1000):
    """R FT replicas; replica 1 killed at kill_at and restarted at once. Returns (wall s, iterations run by replica
    0, failures, each failure's recovery s, replica 0's longest gap between two iterations s, its median step s,
    its longest wait for a new quorum after the first s)."""
    port = _port()
    lh = subprocess.Popen(["torchft_lighthouse", "--min_replicas", "1", "--bind", f"[::]:{port}",
                           "--join_timeout_ms", str(join_ms), "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS),
                           "--quorum_tick_ms", "10"],  # (a quorum is checked for every 10 ms, not torchft's 100)
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = [sys.executable, "pretrain_gpt.py", *model(replicas), "--train-iters", str(iters), "--ft-lighthouse",
            f"localhost:{port}", "--ft-heartbeat-ms", "50", "--ft-timeout", "10"]
    start = time.perf_counter()
    try:
        others = [Proc(base + ["--ft-replica-id", str(r)], _env(), log) for r in range(replicas) if r != 1]
        failures, pending, recovery = [], sorted(kill_at), []
        victim = Proc(base + ["--ft-replica-id", "1"], _env(), log, kill_at=pending[:1])
        victims = [victim]
        while True:  # the victim's supervisor (torchrun's role): restart it whenever it was killed
            rc = victim.wait()
            if recovery and recovery[-1] is None:  # the previous restart's first iteration with the others
                recovery[-1] = victim.times[0] - killed_at if victim.times else float("nan")
            if victim.killed:
                failures += victim.killed
                killed_at = victim.kill_times[-1]
                recovery.append(None)
                pending = [k for k in pending if k > victim.killed[-1]]
                victim = Proc(base + ["--ft-replica-id", "1"], _env(), log, kill_at=pending[:1])
                victims.append(victim)
                continue
            break
        assert all(p.wait() == 0 for p in others) and rc == 0, "an FT replica failed (see the log)"
        gaps = sorted(b - a for a, b in zip(others[0].times, others[0].times[1:]))
        # the iterations some replica completed (one that lagged a commit heals past it: another applied it)
        done = sorted(set(it for p in others + victims for it in p.iters))
        return (time.perf_counter() - start, done, failures, recovery, gaps[-1] if gaps else 0.0,
                gaps[len(gaps) // 2] if gaps else 0.0, max(others[0].waits[1:], default=0.0))
    finally:
        lh.kill()


def restart_arm(iters, kill_at, save_interval, log, tmp, replicas):
    """One torchrun job (DP R) with --max-restarts: a worker killed at each kill_at; the job resumes from --save
    (save_interval None: no saves, no kills)."""
    ckpt = os.path.join(tmp, f"ckpt{save_interval}")
    saves = ["--save", ckpt, "--save-interval", str(save_interval)] if save_interval else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(replicas), "--max-restarts",
           str(len(kill_at)), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{_port()}",
           "pretrain_gpt.py", *model(replicas), "--train-iters", str(iters), *saves]

    def worker():  # the youngest worker process of the job
        out = subprocess.run(["pgrep", "-f", "-n", "pretrain_gpt.py"], capture_output=True, text=True).stdout.split()
        return int(out[0])
    start = time.perf_counter()
    job = Proc(cmd, _env(), log, kill_at=kill_at, victim=worker)
    assert job.wait() == 0, "the checkpoint-restart job failed (see the log)"
    return time.perf_counter() - start, job.iters, job.killed


def schedule(iters, every, seed):
    """The failures' iterations: every-th ones, each moved by up to every/4 either way (seeded)."""
    rng = random.Random(seed)
    return [k + rng.randint(-(every // 4), every // 4) for k in range(every, iters - every // 4, every)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=480)
    ap.add_argument("--every", type=int, default=80, help="a failure about every this many iterations")
    ap.add_argument("--save-interval", default="5,10,20",
                    help="checkpoint-restart's --save-interval values to run (comma-separated); the fastest counts")
    ap.add_argument("--join-timeout-ms", default="1000,100",
                    help="the Lighthouse's --join_timeout_ms values to run FT at (comma-separated)")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="the failure schedule's seed")
    a = ap.parse_args()
    kill_at, R = schedule(a.iters, a.every, a.seed), a.replicas
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "log.txt"), "w") as log:
        calm = ft_arm(a.iters, [], log, R)
        fts = {j: ft_arm(a.iters, kill_at, log, R, join_ms=j) for j in map(int, a.join_timeout_ms.split(","))}
        crs = {k: restart_arm(a.iters, kill_at, k, log, tmp, R) for k in map(int, a.save_interval.split(","))}
        plain = restart_arm(a.iters, [], None, log, tmp, R)
    best = min(crs, key=lambda k: crs[k][0])
    rows = {f"no failures ({R} FT replicas)": calm[:3],
            **{f"megalite FT (join timeout {j / 1000:g} s)": ft[:3] for j, ft in fts.items()},
            **{f"checkpoint-restart (--save-interval {k}){' *' if k == best else ''}": v for k, v in crs.items()},
            "plain torchrun job (no failures, no saves)": plain}
    print(f"{a.iters} iterations, {R} replicas, a SIGKILL at iterations {kill_at} (seed {a.seed}); CPU, "
          f"{os.cpu_count()} cores; the Lighthouse's heartbeat timeout {HEARTBEAT_TIMEOUT_MS / 1000:g} s")
    print(f"{'arm':<46}{'wall s':>8}{'goodput':>9}{'failures':>10}{'re-run its':>11}{'lost its':>9}")
    for name, (wall, its, failures) in rows.items():
        rerun = len(its) - len(set(its))  # (FT: the set of committed iterations; a voted-away step is run again)
        lost = len(set(range(1, a.iters + 1)) - set(its))
        print(f"{name:<46}{wall:>8.1f}{calm[0] / wall:>9.2f}{len(failures):>10}{rerun:>11}{lost:>9}")
    for j, ft in fts.items():
        rec = ", ".join(f"{r:.1f}" for r in ft[3] if r is not None)
        print(f"join timeout {j / 1000:g} s: megalite FT is {crs[best][0] / ft[0]:.2f}x faster to the same loss than "
              f"checkpoint-restart at its fastest save interval (* {best}); recovery per failure (the kill to the "
              f"restarted replica's first iteration) {rec} s; replica 0's longest stall {ft[4]:.2f} s between two "
              f"iterations, of which it waited {ft[6]:.2f} s for the quorum (median step {ft[5]:.3f} s; goal: at "
              f"most the heartbeat timeout {HEARTBEAT_TIMEOUT_MS / 1000:g} s + one step)")


if __name__ == "__main__":
    main()
