"""kernels/tuned.py, the launch-configuration table, and benchmarks/tune_kernels.py that rewrites it: the committed
table holds only configurations its kernels' spaces can produce; a lookup answers the table's entry for the device,
else the default (always on CPU); a stale or corrupted table falls back with one line; MEGALITE_AUTOTUNE=1 tunes a
miss once (a stand-in timer here); the tuner exits 0 without a GPU and runs its own search on CPU shapes."""
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

import kernels  # noqa: F401  (every kernel module: each registers its space)

tuned = importlib.import_module("kernels.tuned")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU = torch.device("cuda", 0)  # only a key here: nothing runs on it
DEFAULT = {"ROWS": 1, "num_warps": 16, "num_stages": 3, "PROGRAMS_PER_SM": 1}


@pytest.fixture(autouse=True)
def fresh():
    tuned.reset()
    yield
    tuned.reset()


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(tuned, "device_name", lambda device: "Fake GPU")


def _table(cfg, kernel="rms_norm.bwd", dtype="bfloat16", bucket=4096):
    return {"devices": {"Fake GPU": {"configs": {dtype: {kernel: {str(bucket): cfg}}}}}}


def test_committed_table_holds_only_configurations_of_the_spaces():
    with open(tuned.TABLE_PATH) as f:
        table = json.load(f)
    spaces = tuned.spaces()
    assert {"layer_norm.fwd", "layer_norm.bwd", "rms_norm.fwd", "rms_norm.bwd"} <= set(spaces)
    for device, entry in table["devices"].items():
        for dtype, by_kernel in entry["configs"].items():
            for kernel, by_bucket in by_kernel.items():
                assert kernel in spaces, f"{device}: {kernel} is no registered kernel"
                for bucket, cfg in by_bucket.items():
                    assert cfg in spaces[kernel].candidates(int(bucket), getattr(torch, dtype)), \
                        f"{device} {dtype} {kernel} {bucket}: {cfg} is not in the kernel's space (re-tune)"


def test_off_a_gpu_the_default_whatever_the_table(fake_gpu):
    tuned.reset(_table({"ROWS": 2}))
    for dev in ("cpu", "meta"):
        assert tuned.config("rms_norm.bwd", dev, torch.bfloat16, 4096, DEFAULT) is DEFAULT


def test_a_hit_is_merged_over_the_default_and_a_miss_is_the_default(fake_gpu):
    tuned.reset(_table({"ROWS": 2, "num_stages": 4}))
    assert tuned.config("rms_norm.bwd", GPU, torch.bfloat16, 4096, DEFAULT) == {**DEFAULT, "ROWS": 2, "num_stages": 4}
    for kernel, dtype, bucket in (("rms_norm.bwd", torch.bfloat16, 2048), ("rms_norm.bwd", torch.float16, 4096),
                                  ("layer_norm.bwd", torch.bfloat16, 4096)):
        assert tuned.config(kernel, GPU, dtype, bucket, DEFAULT) is DEFAULT


def test_a_stale_entry_falls_back_with_one_line(fake_gpu, capsys):
    tuned.reset(_table({"ROWS": 2, "BLOCK_Q": 64}))
    for _ in range(3):  # cached: said once
        assert tuned.config("rms_norm.bwd", GPU, torch.bfloat16, 4096, DEFAULT) is DEFAULT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "BLOCK_Q" in err[0], err


def test_a_corrupted_table_is_ignored_with_one_line(tmp_path, capsys):
    bad = tmp_path / "t.json"
    bad.write_text('{"devices": {"Fake GPU": ')
    assert tuned.load_table(str(bad)) == {"devices": {}}
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert tuned.load_table(str(tmp_path / "missing.json")) == {"devices": {}}


def test_forced_nests_and_restores():
    with tuned.forced("rms_norm.bwd", {"ROWS": 8}):
        with tuned.forced("rms_norm.bwd", {"ROWS": 2}):
            assert tuned.config("rms_norm.bwd", "cpu", torch.float32, 1024, DEFAULT) == {"ROWS": 2}
        assert tuned.config("rms_norm.bwd", "cpu", torch.float32, 1024, DEFAULT) == {"ROWS": 8}
        assert tuned.config("layer_norm.bwd", "cpu", torch.float32, 1024, DEFAULT) is DEFAULT
    assert tuned.config("rms_norm.bwd", "cpu", torch.float32, 1024, DEFAULT) is DEFAULT


def test_autotune_only_when_asked(fake_gpu, monkeypatch):
    """A miss with MEGALITE_AUTOTUNE=1 times each candidate (a stand-in timer: X=2 is fastest) once, then answers
    from the cache; without it, the default and no timing."""
    import triton.testing
    runs = []
    space = tuned.Space(kernel="fake", params={"X": (1, 2, 3)}, buckets=(64,), default=lambda b, d: {"X": 1},
                        make=lambda b, d, dev, small=False: runs.append)
    monkeypatch.setitem(tuned._spaces, "fake", space)
    ms = {1: 3.0, 2: 1.0, 3: 2.0}
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), ms[runs[-1]["X"]])[1])
    tuned.reset({"devices": {}})
    monkeypatch.delenv(tuned.ENV_AUTOTUNE, raising=False)
    assert tuned.config("fake", GPU, torch.bfloat16, 64, {"X": 1}) == {"X": 1} and not runs
    tuned.reset({"devices": {}})
    monkeypatch.setenv(tuned.ENV_AUTOTUNE, "1")
    assert tuned.config("fake", GPU, torch.bfloat16, 64, {"X": 1}) == {"X": 2}
    assert [r["X"] for r in runs] == [1, 2, 3]  # the default first
    assert tuned.config("fake", GPU, torch.bfloat16, 64, {"X": 1}) == {"X": 2} and len(runs) == 3


def test_candidates_start_at_the_default_and_are_valid():
    space = tuned.spaces()["rms_norm.bwd"]
    for bucket in space.buckets:
        for dtype in (torch.bfloat16, torch.float32):
            cands = space.candidates(bucket, dtype)
            assert cands[0] == space.default(bucket, dtype) and len(cands) == len({str(c) for c in cands})
            assert all(space.valid(bucket, dtype, c) for c in cands[1:])


def _tuner(*argv):
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "benchmarks/tune_kernels.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the tuner would run")
def test_the_tuner_without_a_gpu_says_so_and_exits_0():
    r = _tuner()
    assert r.returncode == 0 and r.stdout.strip().count("\n") == 0 and "needs a CUDA GPU" in r.stdout, r


def test_the_tuner_runs_its_search_on_cpu_shapes(tmp_path):
    out = tmp_path / "table.json"
    out.write_text(json.dumps({"devices": {"Other GPU": {"configs": {"bfloat16": {"rms_norm.fwd": {"4096": {}}}}}}}))
    r = _tuner("--cpu-smoke", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    table = json.loads(out.read_text())
    assert "Other GPU" in table["devices"], "another device's entries must stay"
    got = table["devices"]["cpu-smoke"]["configs"]["float32"]
    assert set(got) == set(tuned.spaces()), got  # one bucket of every registered kernel (the smoke's share)
    assert {"layer_norm.fwd", "layer_norm.bwd", "rms_norm.fwd", "rms_norm.bwd"} <= set(got), got
    n = len(tuned.spaces())
    assert [ln for ln in r.stdout.splitlines() if ln.startswith(f"SUMMARY {n} of {n} keys tuned")], r.stdout
