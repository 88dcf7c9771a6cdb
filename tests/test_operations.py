"""Operations through the real launcher (torchrun): clean exits, a killed rank restarted and
resumed, SIGTERM saving and exiting 0, NaN stopping before the update.

Data: a Megatron-format file of bigram-chain documents (NullTokenizer ids), written here, so
losses fall and a resume that lost state would show.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import pretrain_gpt
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.data.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
         "--global-batch-size 8 --hidden-dropout 0.1 --attention-dropout 0.1 --lr 1e-2 --lr-warmup-iters 0 "
         "--log-interval 1 --eval-interval 0 --tokenizer-type NullTokenizer --vocab-size 63 --split 100,0,0 "
         "--make-vocab-size-divisible-by 8 --eval-iters 0 --num-workers 0").split()
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: (\S+)")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Documents that follow a fixed random permutation of 40 symbols from a random start."""
    prefix = str(tmp_path_factory.mktemp("ops") / "chain_text_document")
    rng = np.random.default_rng(0)
    perm = rng.permutation(40)
    b = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.int32)
    for _ in range(400):
        doc = [int(rng.integers(40))]
        for _ in range(int(rng.integers(20, 60))):
            doc.append(int(perm[doc[-1]]))
        b.add_document(doc + [63], [len(doc) + 1])  # 63: the NullTokenizer's end of document
    b.finalize(index_file_path(prefix))
    return ["--data-path", prefix, "--data-cache-path", str(tmp_path_factory.mktemp("cache"))]


def torchrun(args, cwd, nproc=2, extra=(), **kw):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *extra,
           os.path.join(ROOT, "pretrain_gpt.py"), *MODEL, *args]
    env = dict(os.environ, TMPDIR=str(cwd))  # torchrun's agent leaves its torchelastic_* log directory behind
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, **kw)


def losses(text):
    return {int(i): v for i, v in LOSS.findall(text)}


def wait_for(proc, pattern, timeout=240):
    """Read the job's output until `pattern` appears; returns what was read."""
    out, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out.append(line)
        if re.search(pattern, line):
            return "".join(out)
    raise AssertionError(f"{pattern!r} never appeared:\n{''.join(out)[-2000:]}")


def workers(proc):
    """The ranks torchrun started (children of its agent)."""
    r = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    return [int(x) for x in r.stdout.split()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data):
    """An 8-iteration job on 2 ranks run start to end: the clean exit, and the losses a
    restarted job must reproduce."""
    p = torchrun(data + ["--train-iters", "8"], tmp_path_factory.mktemp("uninterrupted"))
    return p.communicate(timeout=240)[0], p


def test_finished_jobs_exit_zero(uninterrupted):
    # (each torchrun test below checks its exit code too; benchmarks/clean_exit.py runs 20)
    out, p = uninterrupted
    assert p.returncode == 0 and "megalite: done 8 iterations" in out, f"exit {p.returncode}\n{out[-2000:]}"


def test_killed_rank_restarts_and_resumes_exactly(tmp_path, data, uninterrupted):
    job = data + ["--train-iters", "8", "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    p = torchrun(job, tmp_path, extra=["--max-restarts", "1"])
    before = wait_for(p, r"iteration\s+5/")
    victim = workers(p)[-1]
    os.kill(victim, signal.SIGKILL)  # a rank dies mid-training
    out = before + p.communicate(timeout=300)[0]
    assert p.returncode == 0, out[-3000:]
    assert "loaded checkpoint" in out  # the restarted workers found --save by themselves
    ref_out, ref = uninterrupted
    assert ref.returncode == 0, ref_out[-2000:]
    expect = losses(ref_out)
    resumed = losses(out[out.index("loaded checkpoint"):])
    assert sorted(resumed) == [5, 6, 7, 8] or sorted(resumed) == [7, 8], resumed
    for it, v in resumed.items():
        assert v == expect[it], f"iteration {it}: {v} after the restart, {expect[it]} uninterrupted"
    assert float(expect[8]) < float(expect[1]) - 0.5  # the data is learnable


def test_sigterm_saves_and_exits_zero(tmp_path, data):
    d = tmp_path / "ckpt"
    p = torchrun(data + ["--train-iters", "50", "--save", str(d), "--exit-signal-handler"], tmp_path)
    before = wait_for(p, r"iteration\s+3/")
    for pid in workers(p):  # as a scheduler does before preemption
        os.kill(pid, signal.SIGTERM)
    out = before + p.communicate(timeout=240)[0]
    assert p.returncode == 0, out[-3000:]
    m = re.search(r"exiting at iteration (\d+) \(SIGTERM received\)", out)
    assert m, out[-2000:]
    assert (d / "latest_checkpointed_iteration.txt").read_text().strip() == m.group(1)


def test_nan_gradient_stops_before_the_update(tmp_path, data, capsys, monkeypatch):
    import megalite.training as training
    import megalite.training.step as step
    real, calls = step.finalize_model_grads, []

    def poisoned(chunks):
        real(chunks)
        calls.append(1)
        if len(calls) == 3:
            p = dict(chunks[0].module.named_parameters())["decoder.layers.1.mlp.linear_fc2.weight"]
            p.main_grad[0, 0] = float("nan")
            poisoned.weights = {n: q.detach().clone() for n, q in chunks[0].module.named_parameters()}
            poisoned.chunks = chunks

    monkeypatch.setattr(step, "finalize_model_grads", poisoned)
    args = parse_args(MODEL + data + ["--train-iters", "5"], world_size=1)
    try:
        with pytest.raises(SystemExit) as e:
            training.pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                              args)
    finally:
        ps.destroy_model_parallel()
    assert e.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "iteration 3" in err[0] and "decoder.layers.1.mlp.linear_fc2.weight" in err[0], err
    after = dict(poisoned.chunks[0].module.named_parameters())
    for n, w in poisoned.weights.items():  # nothing was updated with the NaN
        assert (after[n].detach() == w).all(), n


HUNG = """
import os, runpy, sys, time
import megalite.training.step as t
real = t.train_step
def hung(*a, **k):
    if os.environ["RANK"] == "1":
        time.sleep(120)  # a rank that stops answering
    return real(*a, **k)
t.train_step = hung
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class _Background:
    """A job started now and waited for by a thread: its exit code, output and run time for a test that comes
    later (the hung-peer job mostly waits out its timeout; the module's other jobs use the cores meanwhile)."""

    def __init__(self, cmd, timeout):
        self.timeout, self.t0 = timeout, time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._wait, daemon=True)
        self.thread.start()

    def _wait(self):
        self.out, self.err = self.proc.communicate()
        self.elapsed = time.monotonic() - self.t0

    def result(self):
        self.thread.join(max(0.0, self.t0 + self.timeout - time.monotonic()))
        if self.thread.is_alive():
            self.stop()
            raise AssertionError(f"the job ran past {self.timeout} s")
        return self.proc.returncode, self.elapsed

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.thread.join()


@pytest.fixture(scope="module", autouse=True)
def hung_job(tmp_path_factory, data):
    """The hung-peer job, started with the module and checked by its test."""
    d = tmp_path_factory.mktemp("hung")
    script = d / "hung.py"
    script.write_text(HUNG)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--redirects", "3", "--log-dir", str(d / "logs"), str(script),
           os.path.join(ROOT, "pretrain_gpt.py"), *MODEL, *data, "--train-iters", "3",
           "--distributed-timeout-minutes", "0.05"]
    job = _Background(cmd, timeout=110)
    job.logs = d / "logs"
    yield job
    job.stop()


def test_hung_peer_fails_survivors_within_the_timeout(hung_job):
    returncode, elapsed = hung_job.result()
    # did not wait for the sleeper (the launcher's own output shown if it did)
    assert returncode != 0 and elapsed < 100, (returncode, elapsed, hung_job.err[-2000:])
    import glob
    err = open(glob.glob(str(hung_job.logs / "**" / "attempt_0" / "0" / "stderr.log"), recursive=True)[0]).read()
    ours = [ln for ln in err.splitlines() if ln.startswith("megalite: error")]
    assert len(ours) == 1 and "communication failed" in ours[0] and "--distributed-timeout-minutes 0.05" in ours[0], err
    assert "Traceback" not in err, err


def test_exit_duration_saves_and_stops(tmp_path, data, capsys):
    import megalite.training as training
    d = tmp_path / "ckpt"
    args = parse_args(MODEL + data + ["--train-iters", "50", "--save", str(d), "--exit-duration-in-mins", "1e-9"],
                      world_size=1)
    try:
        losses = training.pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                                   pretrain_gpt.forward_step, args)
    finally:
        ps.destroy_model_parallel()
    assert len(losses) == 1 and "exiting at iteration 1 (--exit-duration-in-mins reached)" in capsys.readouterr().out
    assert (d / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
