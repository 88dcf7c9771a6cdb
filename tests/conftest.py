import os
import sys

import pytest
import torch

# the suite's helpers (worlds of ranks, the parity harness, ...) are imported by name from tests/support/
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

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


# The quick tier (`python -m pytest -m quick tests`, about 3 minutes on the 2-core machine): one small
# check per package and axis, for everyday work; the full suite stays what CI runs. Node-id prefixes.
QUICK = (
    "tests/test_parity.py::test_two_ranks_match_single_process",  # TP, PP, DP, SP, recompute, bf16/fp16
    "tests/test_parity.py::test_references_learn",
    "tests/test_parity.py::test_one_f_one_b_definition_is_not_gpipe",
    "tests/test_decisions.py",  # top-k decisions and the harness's replay of ties
    "tests/test_moe.py", "tests/test_dsa.py",  # MoE and DSA: formulas, decisions, DP / PP / TP+SP parity
    "tests/test_mla.py::test_one_layer_matches_the_formulas_in_float64",
    "tests/test_context_parallel.py::test_cp_attention_equals_whole_sequence_attention",
    "tests/test_distributed_optimizer.py::test_tp2_dp2_matches_plain",  # ZeRO-1 with TP
    "tests/test_optimizer.py", "tests/test_mappings.py", "tests/test_arguments.py", "tests/test_megatron_compat.py",
    "tests/test_checkpoint.py::test_use_checkpoint_args", "tests/test_checkpoint.py::test_pickle_payload_is_refused",
    "tests/test_continue_hf.py",  # HF -> megalite -> training -> HF
    "tests/test_semi_sync.py::test_one_replica", "tests/test_semi_sync.py::test_outer_step",  # semi-sync replicas
    "tests/test_semi_sync.py::test_bad_combinations", "tests/test_semi_sync.py::test_quantized_payloads",
    "tests/test_semi_sync_async.py::test_delayed", "tests/test_semi_sync_async.py::test_slots",  # asynchronous
    "tests/test_semi_sync_async.py::test_bad_combinations",
    "tests/test_mixed_memory.py::test_plan_with_sizes", "tests/test_mixed_memory.py::test_bad_flags",  # sizes, offload
    "tests/test_mixed_memory.py::test_a_budget_nothing_fits", "tests/test_mixed_precision.py",
    "tests/test_pipeline_auto_layout.py::test_the_cut", "tests/test_pipeline_auto_layout.py::test_bad_flags",
    "tests/test_data_splits.py", "tests/data/test_data_indexed_dataset.py", "tests/data/test_data_gpt_dataset.py",
    "tests/kernels/test_kernel_norms.py", "tests/kernels/test_kernel_activations.py",
    "tests/test_readme.py", "tests/test_user_mlp.py",
    "tests/test_planner_priced.py::test_published_runs_stay",  # the planner: published runs, one layer's bytes
    "tests/test_planner_activations.py::test_one_layer_saves",
    "tests/test_import_direction.py", "tests/test_launch.py", "tests/test_shm_group.py",  # the worlds' groups
)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped with a reason on CPU)")
    config.addinivalue_line("markers", "quick: the quick tier (-m quick): one small check per package and axis")


def pytest_itemcollected(item):
    if item.nodeid.startswith(QUICK):
        item.add_marker(pytest.mark.quick)


@pytest.hookimpl(trylast=True)  # after -m / -k deselected what will not run
def pytest_collection_modifyitems(config, items):
    # The sm_80/sm_90 builds (tests/kernels/test_gpu_compile.py, and the sm_90 machine-code gate
    # tests/kernels/test_sm90_report.py reading the same build) are a minute or more of CPU in
    # their own processes: start them now at the lowest priority, where they use the cores the
    # rest of the suite leaves idle (spawned ranks waiting on each other, timeouts), and run
    # their tests last, which wait for them.
    builds = ("tests/kernels/test_gpu_compile.py", "tests/kernels/test_sm90_report.py")
    gpu_compile = [item for item in items if item.nodeid.startswith(builds)]
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
