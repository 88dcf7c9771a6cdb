"""Fault-tolerant replicas for the tests (tests/test_ft.py): torchft's Lighthouse in the test process and each
replica a process of its own (spawned: a fresh interpreter, as a torchrun job would be), training megalite's
parity model on learnable data; what each returns comes back through a queue."""

import glob
import multiprocessing as mp
import os
import pickle
import time
import traceback

from parity_models import BASE

_SCHEDULER = [None]
# torchft's timeouts, short: a dead replica is noticed within a second
FAST = ["--ft-timeout", "10", "--ft-quorum-timeout", "30", "--ft-connect-timeout", "10", "--ft-heartbeat-ms", "50"]


def lighthouse(min_replicas):
    """torchft's Lighthouse: a replica unheard of for 1 s is dead; a quorum waits up to 2 s for heartbeating
    replicas that have not asked yet (the replicas of a test start together)."""
    from torchft._torchft import LighthouseServer
    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=2000, heartbeat_timeout_ms=1000,
                            quorum_tick_ms=10)  # (a quorum looked for every 10 ms: torchft's 100 is a step's time here)


def _replica(argv, out, die_at=None, hold=(), announce=None, start=None, reach=(), env=None, key=None, tmp=None,
             dies_sending=False, slow=0.0, refuse_at=None):
    """One replica's run. die_at: (iteration, where): the process ends (as SIGKILL would: no goodbye) in the middle
    of that iteration, after its forward-backward: "before" the cross-replica reduction, or "during" it (its part
    sent, the result not awaited). hold: [(iteration, paths)]: before that iteration the replica waits for those
    files (its peers' announces: they heartbeat to the Lighthouse). announce: the file written once this replica
    heartbeats. start: a barrier the first replicas pass together. reach: [(iteration, path)]: the file written when
    the replica is about to run that iteration. env: a rank's torchrun variables (a replica of several ranks);
    key: what names its results. tmp: where each outer step of semi-synchronous replicas is recorded as it happens
    (outer_records reads them). dies_sending: the process ends when a healing peer asks for its state. slow: seconds
    this replica sleeps in each micro-batch's forward step (a slower GPU). refuse_at: the iteration whose cross-replica
    reduction fails on this replica's side (reported before it reduces: the peers wait inside the reduction for it)
    and nowhere else: it lives on."""
    import time
    os.environ.update(env or {})
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from megalite.training import ft, ft_rounds
    init, quorum = ft.FaultTolerance.__init__, ft.FaultTolerance._quorum
    votes = {cls: cls.vote for cls in (ft.FaultTolerance, ft_rounds.FaultTolerantRounds)}

    def dying(self, chunks, *amaxes):
        vote = votes[type(self)]
        if refuse_at is not None and self.done + 1 == refuse_at and not refused:
            refused.append(refuse_at)
            self.manager.report_error(RuntimeError("injected: this replica's reduction failed"))
        if die_at is not None and self.done + 1 == die_at[0]:
            if die_at[1] == "before":
                os._exit(17)
            send = self.manager.allreduce

            def sending_then_dying(t, **k):
                send(t, **k)
                time.sleep(0.05)
                os._exit(17)
            self.manager.allreduce = sending_then_dying
        return vote(self, chunks, *amaxes)

    def announcing(self, *a, **k):
        init(self, *a, **k)
        if announce:
            open(announce, "w").close()

    def holding(self, *a, **k):
        for it, path in reach:
            if self.done + 1 == it:
                open(path, "w").close()
        for it, paths in hold:
            while self.done + 1 == it and not all(os.path.exists(p) for p in paths):
                time.sleep(0.05)
        return quorum(self, *a, **k)
    ft.FaultTolerance.__init__, ft.FaultTolerance._quorum = announcing, holding
    if tmp is not None:  # a wait below --ft-min-replicas is announced (the test restarts a replica only then)
        import types
        real = ft.time

        def waiting(seconds):
            open(os.path.join(str(tmp), "waiting"), "w").close()
            real.sleep(seconds)
        ft.time = types.SimpleNamespace(**{**vars(real), "sleep": waiting})  # (the rest of time as it is)
    if dies_sending:
        def sending(self):
            os._exit(17)
        ft.FaultTolerance._state = sending
    refused = []  # (once: the iteration's second attempt goes through)
    for cls in votes:
        cls.vote = dying
    from megalite.training import parts
    save, saves = parts.save_checkpoint, []

    def recording(it, *a, **k):  # which iterations this replica wrote
        saves.append(it)
        return save(it, *a, **k)
    parts.save_checkpoint = recording
    from megalite.distributed import semi_sync
    outer, rounds = semi_sync.SemiSync.outer_step, []

    def recording_outer(self):  # each outer step: the local and global weights before, the global ones after
        import numpy as np
        before = ([m.detach().double().numpy().copy() for m in self.optimizer.main_params],
                  [g.double().numpy().copy() for g in self.glob], self.samples)
        buf = None if self.buf is None else [b.double().numpy().copy() for b in self.buf]
        outer(self)
        rounds.append(dict(local=before[0], glob=before[1], samples=before[2], buf=buf,
                           after=[np.array(g.double().numpy()) for g in self.glob]))
        if tmp is not None:  # as it happens: a replica that dies later takes its memory with it
            name = "-".join(map(str, key)) if isinstance(key, tuple) else key
            with open(os.path.join(str(tmp), f"outer_{name}_{started_ns}.pkl"), "wb") as f:
                pickle.dump(rounds, f)
    started_ns = time.time_ns()
    semi_sync.SemiSync.outer_step = recording_outer
    if start is not None:
        start.wait(timeout=120)
    try:
        import torch
        import pretrain_gpt
        from megalite import parallel_state as ps
        from megalite.cli.parser import parse_args
        from megalite.training import pretrain
        from parity_models import learnable_datasets
        args = parse_args(argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        from megalite.training import trainer as trainer_module
        build = trainer_module.Trainer.__init__

        def keeping(self, *a, **k):  # the run's LR schedule, to compare after a heal
            build(self, *a, **k)
            _SCHEDULER[:] = [self.scheduler]
        trainer_module.Trainer.__init__ = keeping
        def forward_step(it, model):
            time.sleep(slow)
            return pretrain_gpt.forward_step(it, model)
        losses, chunks, optimizer = pretrain(learnable_datasets, pretrain_gpt.model_provider,
                                             forward_step if slow else pretrain_gpt.forward_step, args,
                                             return_state=True)
        # numpy, not tensors: a tensor crosses the queue as a shared-memory handle that dies with this process
        weights = {}
        for c in chunks:
            with c.gathered():  # (ZeRO-3: whole parameters while read)
                weights.update({n: p.detach().clone().numpy() for n, p in c.module.named_parameters()})
        sd = optimizer.state_dict()
        if "shards" in sd:  # ZeRO: this rank's shard of every parameter's state
            moments = {e["name"]: {k: e[k].numpy().copy() for k in ("main_param", *e["keys"])} for e in sd["shards"]}
        else:
            moments = {k: {n: v.numpy().copy() for n, v in st.items() if torch.is_tensor(v)}
                       for k, st in sd["optimizer"]["state"].items()}
        from megalite.checkpoint.state import fp8_state
        out.put((args.ft_replica_id if key is None else key, losses, weights, moments, _SCHEDULER[0].state_dict(),
                 saves, rounds, fp8_state(chunks)))
        ps.destroy_model_parallel()
        del torch
    except BaseException:  # noqa: BLE001 - the test prints it
        out.put(("error", traceback.format_exc()))


def outer_records(tmp):
    """{replica (with ranks: (replica, rank)): [each of its processes' outer-step records, in the order they
    started]}."""
    got = {}
    for path in sorted(glob.glob(os.path.join(str(tmp), "outer_*.pkl")), key=lambda p: int(p[:-4].split("_")[-1])):
        name = os.path.basename(path).split("_")[1]
        key = tuple(map(int, name.split("-"))) if "-" in name else int(name)
        with open(path, "rb") as f:
            got.setdefault(key, []).append(pickle.load(f))
    return got


def _launcher(conn, out, barrier):
    """A spawned process (a fresh interpreter) that imports what a replica needs once, then forks each replica
    process the test asks for (a replica's start costs a fork, not an interpreter's imports: about 3 s of CPU
    each on the 2-core machine); it reaps them and reports their exit codes."""
    import signal
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (as each replica sets it, before anything imports triton)
    import torch
    torch.set_num_threads(1)  # (each forked replica one thread, as torchrun's workers: more replicas than cores)
    import pretrain_gpt  # noqa: F401 - (the imports every replica makes, made once)
    import torchft  # noqa: F401
    from megalite.training import ft_rounds, pretrain  # noqa: F401
    done = {}

    def reap(pid, block):
        if pid not in done:
            got, status = os.waitpid(pid, 0 if block else os.WNOHANG)
            if got:
                done[pid] = os.waitstatus_to_exitcode(status)
        return done.get(pid)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        op, arg = msg
        if op == "start":
            argv, kwargs = arg
            pid = os.fork()
            if pid == 0:  # the replica: its own process, the warm modules already imported
                conn.close()
                try:
                    _replica(argv, out, start=barrier if kwargs.pop("barrier") else None, **kwargs)
                finally:
                    out.close()
                    out.join_thread()  # (what it put reaches the test before the process ends)
                    os._exit(0)
            conn.send(pid)
        elif op == "wait":
            pid, timeout = arg
            end = time.monotonic() + timeout
            while reap(pid, False) is None and time.monotonic() < end:
                time.sleep(0.02)
            conn.send(done.get(pid))
        elif op == "kill":
            if reap(arg, False) is None:
                os.kill(arg, signal.SIGKILL)
                reap(arg, True)
            conn.send(done.get(arg))


class _Forked:
    """A replica process forked by the launcher, with the Process methods the harness uses."""

    def __init__(self, launcher, pid):
        self.launcher, self.pid, self.exitcode = launcher, pid, None

    def _ask(self, op, arg):
        self.launcher[0].send((op, arg))
        return self.launcher[0].recv()

    def join(self, timeout=None):
        if self.exitcode is None:
            self.exitcode = self._ask("wait", (self.pid, 3600 if timeout is None else timeout))

    def is_alive(self):
        self.join(timeout=0)
        return self.exitcode is None

    def kill(self):
        self.exitcode = self._ask("kill", self.pid)


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_replicas(address, n, tmp, extra=(), iters=4, die=(), rejoin_at=None, join_at=None, ranks=1, own=None,
                 lose=(), rejoin_when_waiting=False, slow=None, refuse=None):
    """n replicas of the parity model for `iters` iterations against the Lighthouse at `address`; returns
    {replica id (with ranks > 1: (replica id, rank)): (losses, weights, optimizer state, LR schedule, iterations
    saved, outer steps, FP8 histories)}. die: [(replica, iteration, "before" | "during")]: that replica's processes
    end in the middle of that
    iteration; rejoin_at: each is then started again (as its torchrun would restart it), and the others wait before
    that iteration until it heartbeats (files under `tmp` say so), so it heals while the others train. join_at: a
    new replica (number n) starts when the first replica is about to run that iteration, and everyone waits for it
    there. ranks: processes per replica (a gloo job of its own, as torchrun would start it). own: {replica: its
    own extra flags}. lose: replicas that die when a healing peer asks them for their state (not started again).
    rejoin_when_waiting: the dead are started again only once a survivor waits below --ft-min-replicas. slow:
    {replica: seconds it sleeps in each micro-batch's forward step}. refuse: {replica: iteration whose reduction
    fails on that replica's side only}."""
    ctx = mp.get_context("spawn")
    out, barrier = ctx.Queue(), ctx.Barrier(n * ranks)
    ours, theirs = ctx.Pipe()
    launcher = ctx.Process(target=_launcher, args=(theirs, out, barrier), daemon=True)
    launcher.start()
    link = [ours]
    argv = list(BASE) + ["--train-iters", str(iters), "--ft-lighthouse", address] + FAST + list(extra)

    def files(name, replica):
        return [os.path.join(str(tmp), f"{name}{replica}_{k}") for k in range(ranks)]
    joined = [f for i in range(n) for f in files("joined", i)]  # the first quorum waits for every replica
    rejoined = [f for r, _, _ in die for f in files("rejoined", r)]
    newcomer, reached = files("joined", n), os.path.join(str(tmp), "reached")
    later = [(join_at, newcomer)] if join_at else []
    dies = {r: (it, where) for r, it, where in die}

    def start(i, name, **kw):
        port, procs = _free_port(), []
        for k in range(ranks):
            env = {"RANK": str(k), "LOCAL_RANK": str(k), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks),
                   "MASTER_ADDR": "localhost", "MASTER_PORT": str(port)} if ranks > 1 else None
            kwargs = dict(kw, announce=files(name, i)[k], env=env, key=(i, k) if ranks > 1 else i, tmp=tmp,
                          dies_sending=i in lose and name == "joined", reach=kw.get("reach", []) if k == 0 else [],
                          barrier=kw.get("barrier", False), slow=(slow or {}).get(i, 0.0),
                          refuse_at=(refuse or {}).get(i) if name == "joined" else None)
            ours.send(("start", (argv + ["--ft-replica-id", str(i)] + (own or {}).get(i, []), kwargs)))
            procs.append(_Forked(link, ours.recv()))
        return procs
    procs = {i: start(i, "joined", die_at=dies.get(i), barrier=True,
                      reach=[(join_at, reached)] if join_at and i == 0 else [],
                      hold=[(1, joined)] + later + ([(rejoin_at, rejoined)] if rejoin_at and i not in dies else []))
             for i in range(n)}
    for r in dies:
        for p in procs[r]:
            p.join(timeout=120)
            assert p.exitcode == 17, f"replica {r} did not die as planned: {p.exitcode}"
    if rejoin_at:
        while rejoin_when_waiting and not os.path.exists(os.path.join(str(tmp), "waiting")):
            assert procs[0][0].is_alive(), "replica 0 ended without waiting for the others"
            time.sleep(0.05)
        procs.update({(r, "again"): start(r, "rejoined", hold=later) for r in dies})
    if join_at:
        while not os.path.exists(reached):
            assert procs[0][0].is_alive(), "replica 0 ended before the new replica could join"
            time.sleep(0.05)
        procs[n] = start(n, "joined")
    got = {}
    try:
        for _ in range((n + bool(join_at) - (0 if rejoin_at else len(dies)) - len(lose)) * ranks):
            item = out.get(timeout=180)
            if item[0] == "error":
                raise AssertionError(f"a replica failed:\n{item[1]}")
            got[item[0]] = item[1:]
    finally:
        for p in (p for group in procs.values() for p in group):
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        ours.send(None)
        launcher.join(timeout=30)
    for r in lose:
        assert all(p.exitcode == 17 for p in procs[r]), f"replica {r} did not die sending its state"
    return got
