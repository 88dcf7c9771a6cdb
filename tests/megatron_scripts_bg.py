"""tests/test_megatron_scripts.py's runs (the data, then every script under one torchrun job) as a background
process of the lowest CPU priority, started when the suite starts (tests/conftest.py): it trains in the cores the
rest of the suite leaves idle (single-process tests, ranks waiting on each other) and the module's fixture then
waits for it instead of training in the foreground. Run alone, the module trains in its fixture as before.

    python tests/megatron_scripts_bg.py ROOT   (writes ROOT/result.json: test_megatron_scripts.prepare's dict)
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
STARVED = 1500  # the torchrun job's limit here: at the lowest priority it may wait long for idle cores


def start():
    """(process, root) of the background run."""
    root = tempfile.mkdtemp(prefix="megalite_megatron_scripts_")
    with open(os.path.join(root, "log.txt"), "w") as log:  # a file, not a pipe nobody reads until the end
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), root], cwd=HERE, stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(19),
                                start_new_session=True)  # its own group: killed with its torchrun and ranks
    return proc, root


def result(started, timeout):
    """The background run's prepare() dict; AssertionError with its log where it failed or outlasted timeout."""
    proc, root = started
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
    path = os.path.join(root, "result.json")
    if proc.returncode != 0 or not os.path.exists(path):
        with open(os.path.join(root, "log.txt")) as f:
            raise AssertionError(f"the background Megatron-script runs failed (exit {proc.returncode}):\n"
                                 f"{f.read()[-4000:]}")
    with open(path) as f:
        return json.load(f)


def stop(started):
    """At the suite's end: no process left behind, its directory removed."""
    proc, root = started
    if proc.poll() is None:
        _kill(proc)
    shutil.rmtree(root, ignore_errors=True)


def _kill(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    from test_megatron_scripts import prepare
    out = prepare(sys.argv[1], timeout=STARVED)
    with open(os.path.join(sys.argv[1], "result.json"), "w") as f:
        json.dump(out, f)
