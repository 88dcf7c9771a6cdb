"""User errors fail fast through torchrun: every rank prints one clear line and exits non-zero."""

import glob
import os
import subprocess
import sys
import tempfile

import pytest

from dist_util import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OK = "--mock-data --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 8 --micro-batch-size 1 " \
     "--train-iters 1"

CASES = {
    "world_not_divisible": (3, "--tensor-model-parallel-size 2", "world size 3 is not divisible"),
    "heads_vs_tp": (2, "--tensor-model-parallel-size 2 --num-attention-heads 3 --hidden-size 48",
                    "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"),
    "groups_vs_tp": (2, "--tensor-model-parallel-size 2 --group-query-attention --num-query-groups 1",
                     "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2"),
    "global_batch": (2, "--global-batch-size 5", "--global-batch-size 5 is not divisible by --micro-batch-size 1"),
    "hidden_vs_heads": (2, "--hidden-size 50", "--hidden-size 50 is not divisible by --num-attention-heads 4"),
    "not_implemented": (2, "--qk-layernorm", "Megatron flag --qk-layernorm is not implemented in megalite yet"),
    "unknown_flag": (2, "--no-such-flag", "unrecognized argument --no-such-flag"),
    "layers_vs_pp": (2, "--pipeline-model-parallel-size 2 --num-layers 3",
                     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    "layers_vs_virtual": (2, "--pipeline-model-parallel-size 2 --num-layers 6 --num-layers-per-virtual-pipeline-stage 2",
                          "--num-layers 6 is not divisible by --pipeline-model-parallel-size 2 x "
                          "--num-layers-per-virtual-pipeline-stage 2 = 4"),
    "micro_vs_pp_interleaved": (2, "--pipeline-model-parallel-size 2 --num-layers 4 "
                                   "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 3",
                                "number of micro-batches (3) to be a multiple of --pipeline-model-parallel-size 2"),
}


@pytest.fixture(scope="module")
def runs():
    """Launch every case at once (they are independent) and collect per-rank stderr."""
    out, procs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (n, flags, _) in CASES.items():
            log_dir = os.path.join(tmp, name)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                   "--master-port", str(free_port()), "--redirects", "3", "--log-dir", log_dir,
                   os.path.join(ROOT, "pretrain_gpt.py")] + OK.split() + flags.split()
            procs[name] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            env=dict(os.environ, OMP_NUM_THREADS="1")), log_dir, n)
        for name, (p, log_dir, n) in procs.items():
            try:
                p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                out[name] = ("timeout", [])
                continue
            ranks = []
            for r in range(n):
                files = glob.glob(os.path.join(log_dir, "**", "attempt_0", str(r), "stderr.log"), recursive=True)
                ranks.append(open(files[0]).read() if files else None)
            out[name] = (p.returncode, ranks)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_bad_configuration_fails_fast_on_every_rank(runs, name):
    code, ranks = runs[name]
    n, _, expected = CASES[name]
    assert code != "timeout", f"{name}: hung instead of failing"
    assert code != 0, f"{name}: exited 0"
    assert len(ranks) == n
    for r, err in enumerate(ranks):
        assert err is not None, f"{name}: no stderr captured for rank {r}"
        lines = [ln for ln in err.splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
        assert len(lines) == 1, f"{name} rank {r}: expected one line, got:\n{err}"
        assert expected in lines[0] and lines[0].startswith(f"megalite: error (rank {r})"), lines[0]
