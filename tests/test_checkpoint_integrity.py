"""Checkpoints prove themselves by default (megalite/checkpoint/integrity.py): every file's size and xxh3
checksum recorded as it is written and checked at load, a flipped byte in any file (tensors, index, metadata, RNG,
the record itself) or a truncated or missing file named in one line; --load then takes the newest earlier
checkpoint that verifies, and the run goes on exactly as one resumed from it (--no-checkpoint-fallback: it stops);
--verify-integrity's SHA-256 still catches what the checksums were rewritten to hide; a truncated safetensors
file is called truncated; a save that hits a full disk removes its partial directory and leaves the previous
checkpoint and the tracker as they were; tools/verify_checkpoint.py checks a directory offline."""

import errno
import os
import shutil
import subprocess
import sys

import pytest

from test_checkpoint import _spawn, _train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flip(path, offset=-3):
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))


def _error_line(capsys):
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    return err[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints at iterations 2 and 4 of one run (its 6 losses straight); a copy holding iteration 2 alone."""
    d = str(tmp_path_factory.mktemp("integrity") / "ckpt")
    straight, _ = _spawn(1, [[], ["--save", d, "--save-interval", "2", "--exit-interval", "4"]])
    only2 = d + "_only2"
    shutil.copytree(d, only2)
    shutil.rmtree(os.path.join(only2, "iter_0000004"))
    with open(os.path.join(only2, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2\n")
    return d, only2, straight


def _copy(saved, tmp_path):
    d = str(tmp_path / "ckpt")
    shutil.copytree(saved[0], d)
    return d


def test_every_file_is_recorded_as_written(saved):
    import json
    it4 = os.path.join(saved[0], "iter_0000004")
    doc = json.load(open(os.path.join(it4, "checksums.json")))
    on_disk = {os.path.relpath(os.path.join(r, n), it4) for r, _, ns in os.walk(it4) for n in ns}
    assert set(doc["files"]) == on_disk - {"checksums.json"}, (sorted(doc["files"]), sorted(on_disk))
    assert {"__0_0.safetensors", "tensors.json", "megalite.json", "rng/rank_00000.json"} <= set(doc["files"])
    assert all(os.path.getsize(os.path.join(it4, f)) == n for f, (n, _) in doc["files"].items())


def test_a_corrupted_checkpoint_falls_back_to_the_newest_that_verifies(saved, tmp_path, capsys):
    d = _copy(saved, tmp_path)
    _flip(os.path.join(d, "iter_0000004", "__0_0.safetensors"))  # one bit of one tensor: it still parses
    resumed = _train(["--load", d, "--train-iters", "10", "--exit-interval", "6"])
    out = capsys.readouterr().out
    assert "checkpoint iteration 4 does not verify" in out and "__0_0.safetensors changed since it was saved" in out
    assert "loading iteration 2, the newest that does" in out, out
    from_2 = _train(["--load", saved[1], "--train-iters", "10", "--exit-interval", "6"])
    assert resumed == from_2 and len(resumed) == 4, (resumed, from_2)
    assert abs(resumed[-1] - saved[2][5]) / saved[2][5] < 1e-5  # (the run went on as the straight one)
    with pytest.raises(SystemExit):
        _train(["--load", d, "--no-checkpoint-fallback"])
    line = _error_line(capsys)
    assert "iter_0000004: __0_0.safetensors changed since it was saved" in line and "earlier" not in line, line


@pytest.mark.parametrize("victim,says", [
    ("tensors.json", "tensors.json changed since it was saved"),
    ("megalite.json", "megalite.json changed since it was saved"),
    ("rng/rank_00000.json", "rng/rank_00000.json changed since it was saved"),
    ("checksums.json", "checksums.json is corrupted"),
])
def test_a_flipped_byte_in_any_file_is_named(saved, tmp_path, capsys, victim, says):
    d = str(tmp_path / "ckpt")
    shutil.copytree(saved[1], d)  # (iteration 2 alone: nothing to fall back to)
    _flip(os.path.join(d, "iter_0000002", victim), offset=5)
    with pytest.raises(SystemExit) as e:
        _train(["--load", d])
    assert e.value.code == 2
    assert says in _error_line(capsys)


def test_truncated_and_missing_files_are_called_so(saved, tmp_path, capsys):
    d = str(tmp_path / "ckpt")
    shutil.copytree(saved[1], d)
    shard = os.path.join(d, "iter_0000002", "__0_0.safetensors")
    size = os.path.getsize(shard)
    os.truncate(shard, size // 2)
    os.remove(os.path.join(d, "iter_0000002", "rng", "rank_00000.json"))
    with pytest.raises(SystemExit):
        _train(["--load", d])
    line = _error_line(capsys)
    assert f"__0_0.safetensors is truncated ({size // 2} of its {size} bytes)" in line, line
    assert "rng/rank_00000.json is missing" in line, line
    os.remove(os.path.join(d, "iter_0000002", "checksums.json"))  # (an older checkpoint: its header tells)
    with pytest.raises(SystemExit):
        _train(["--load", d])
    line = _error_line(capsys)
    assert "__0_0.safetensors is truncated: " in line and "bytes its header describes" in line, line


def test_verify_integrity_catches_what_rewritten_checksums_hide(tmp_path, capsys):
    from megalite.checkpoint.integrity import merge_checksums
    d, plain = str(tmp_path / "ckpt"), str(tmp_path / "plain")
    _spawn(1, [["--save", d, "--exit-interval", "2", "--verify-integrity"], ["--save", plain, "--exit-interval", "2"]])
    it2 = os.path.join(d, "iter_0000002")
    _flip(os.path.join(it2, "__0_0.safetensors"))
    import json
    from megalite.checkpoint.storage import checksum
    files = json.load(open(os.path.join(it2, "checksums.json")))["files"]
    data = open(os.path.join(it2, "__0_0.safetensors"), "rb").read()
    files["__0_0.safetensors"] = [len(data), checksum(data)]
    merge_checksums(it2, files)  # (a record made to match the change)
    _train(["--load", d, "--exit-interval", "3"])  # the checksums alone pass it
    capsys.readouterr()
    for argv, expect in ((["--load", d, "--verify-integrity"], "iter_0000002: __0_0.safetensors changed since it "
                                                               "was saved"),
                         (["--load", plain, "--verify-integrity"], "has no integrity.json")):
        with pytest.raises(SystemExit):
            _train(argv)
        line = _error_line(capsys)
        assert "--verify-integrity" in line and expect in line, line


def _full_disk_at(marker):
    """fsync_write failing with ENOSPC for files under a directory whose path holds `marker`."""
    from megalite.checkpoint import storage
    real = storage.fsync_write

    def writing(path, data, mode="wb"):
        if marker in str(path) and str(path).endswith(".safetensors"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, data, mode)
    return writing


def test_a_full_disk_leaves_the_previous_checkpoint(tmp_path, capsys, monkeypatch):
    from megalite.checkpoint import storage
    d = str(tmp_path / "ckpt")
    monkeypatch.setattr(storage, "fsync_write", _full_disk_at("iter_0000004"))
    with pytest.raises(SystemExit):
        _train(["--save", d, "--save-interval", "2", "--exit-interval", "6"])
    line = _error_line(capsys)
    assert "saving iter_0000004 failed: no space left on device" in line, line
    assert "removed the partial" in line and "the previous checkpoint (iteration 2)" in line, line
    assert sorted(os.listdir(d)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert open(os.path.join(d, "latest_checkpointed_iteration.txt")).read().strip() == "2"


def test_verify_checkpoint_tool(saved, tmp_path):
    d = _copy(saved, tmp_path)
    tool = [sys.executable, os.path.join(ROOT, "tools", "verify_checkpoint.py")]
    ok = subprocess.run(tool + [d], capture_output=True, text=True)
    assert ok.returncode == 0 and "iter_0000004: verified" in ok.stdout and "iter_0000002: verified" in ok.stdout, \
        ok.stdout + ok.stderr
    _flip(os.path.join(d, "iter_0000004", "tensors.json"), offset=5)
    bad = subprocess.run(tool + [d], capture_output=True, text=True)
    assert bad.returncode == 1 and "iter_0000004: tensors.json changed since it was saved" in bad.stdout, \
        bad.stdout + bad.stderr
    assert "iter_0000002: verified" in bad.stdout


def test_a_full_disk_at_the_metadata_leaves_the_previous_checkpoint(tmp_path, capsys, monkeypatch):
    """The small files written before the tensors (metadata, RNG) fail the same way, on every rank at once."""
    from megalite.checkpoint import integrity
    d = str(tmp_path / "ckpt")
    real = integrity.fsync_write

    def writing(path, data, mode="wb"):
        if "iter_0000004" in str(path) and str(path).endswith("megalite.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, data, mode)
    monkeypatch.setattr(integrity, "fsync_write", writing)
    with pytest.raises(SystemExit):
        _train(["--save", d, "--save-interval", "2", "--exit-interval", "6"])
    line = _error_line(capsys)
    assert "saving iter_0000004 failed: no space left on device" in line and "megalite.json" in line, line
    assert sorted(os.listdir(d)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
