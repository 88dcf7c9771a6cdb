import os

import pytest
import torch

# Triton kernels decide at decoration time whether to run in the interpreter, so the
# switch must be set before anything imports `kernels`: on a machine without CUDA the
# tests always use the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def grid():
    """A single-process grid (every parallel size 1) with the model-parallel RNG seeded 0."""
    from megalite import parallel_state as ps
    from megalite.tensor_parallel import model_parallel_manual_seed
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    yield
    ps.destroy_model_parallel()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped with a reason on CPU)")


def pytest_collection_modifyitems(config, items):
    # The sm_80/sm_90 builds (tests/kernels/test_gpu_compile.py) are a minute or more of CPU in
    # their own processes: start them now at the lowest priority, where they use the cores the
    # rest of the suite leaves idle (spawned ranks waiting on each other, timeouts), and run
    # their tests last, which wait for them.
    gpu_compile = [item for item in items if item.nodeid.startswith("tests/kernels/test_gpu_compile.py")]
    if gpu_compile and len(gpu_compile) < len(items):
        items[:] = [item for item in items if item not in gpu_compile] + gpu_compile
        from kernels_compile_bg import start
        config.megalite_gpu_compile = start()
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_unconfigure(config):
    """A run that stops early (-x, Ctrl-C) leaves no background build behind."""
    proc = (getattr(config, "megalite_gpu_compile", None) or (None,))[0]
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
