"""User errors fail fast: every rank prints one clear line and exits non-zero."""

import json
import os
import subprocess
import sys
import tempfile

import pytest

from cli_batch import run_case
from dist_util import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OK = "--mock-data --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 8 --micro-batch-size 1 " \
     "--train-iters 1 --lr 1e-3 --eval-iters 0 --num-workers 0"

CASES = {
    "world_not_divisible": (3, "--tensor-model-parallel-size 2", "world size 3 is not divisible"),
    "heads_vs_tp": (2, "--tensor-model-parallel-size 2 --num-attention-heads 3 --hidden-size 48",
                    "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"),
    "groups_vs_tp": (2, "--tensor-model-parallel-size 2 --group-query-attention --num-query-groups 1",
                     "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2"),
    "global_batch": (2, "--global-batch-size 5", "--global-batch-size 5 is not divisible by --micro-batch-size 1"),
    "hidden_vs_heads": (2, "--hidden-size 50", "--hidden-size 50 is not divisible by --num-attention-heads 4"),
    "not_implemented": (2, "--fp8-output-proj --no-such-flag --disable-mamba-mem-eff-path",
                        "--fp8-output-proj: this FP8 option (Transformer Engine's) is not implemented in megalite (it "
                        "has --fp8-format with the tensorwise and delayed recipes); remove it"
                        " | --no-such-flag: unrecognized: neither a megalite nor a Megatron-LM flag (see --help) | "
                        "--disable-mamba-mem-eff-path: hybrid/Mamba models are not implemented in megalite"),
    "missing_required": (2, "--lr", "expected one argument"),
    "seq_vs_cp": (2, "--context-parallel-size 2 --seq-length 6",
                  "--seq-length 6 must be a multiple of 2 x --context-parallel-size 2 = 4"),
    "world_vs_cp": (3, "--context-parallel-size 2", "world size 3 is not divisible by --tensor-model-parallel-size 1 "
                                                    "x --context-parallel-size 2 x --pipeline-model-parallel-size 1"),
    "a2a_heads_vs_cp": (4, "--context-parallel-size 4 --cp-comm-type a2a --num-attention-heads 2 --hidden-size 32",
                        "a2a splits each TP rank's heads over 4 CP ranks: 2 heads and 2 query groups / TP 1 must be "
                        "divisible by 4"),
    "cp_hierarchical_sizes": (4, "--context-parallel-size 4 --cp-comm-type a2a+p2p "
                                 "--hierarchical-context-parallel-sizes "
                                 "2 3", "--hierarchical-context-parallel-sizes 2 3: need two sizes A B with A x B = "
                                        "--context-parallel-size 4"),
    "layers_vs_pp": (2, "--pipeline-model-parallel-size 2 --num-layers 3",
                     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    "layers_vs_virtual": (2, "--pipeline-model-parallel-size 2 --num-layers 6 "
                             "--num-layers-per-virtual-pipeline-stage 2",
                          "--num-layers 6 is not divisible by --pipeline-model-parallel-size 2 x "
                          "--num-layers-per-virtual-pipeline-stage 2 = 4"),
    "micro_vs_pp_interleaved": (2, "--pipeline-model-parallel-size 2 --num-layers 4 "
                                   "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 3",
                                "number of micro-batches (3) to be a multiple of --pipeline-model-parallel-size 2"),
    # files and checkpoints ({tmp}: made by _make_files); one rank each: the check is the same on all
    # ranks (as above) and every launch costs a torch import per rank on this 2-core machine
    "save_is_file": (1, "--save {tmp}/afile", "--save {tmp}/afile is a file"),
    "save_unwritable": (1, "--save {tmp}/afile/sub", "cannot be created"),
    "load_is_file": (1, "--load {tmp}/afile", "is a file; give the checkpoint directory"),
    "load_missing_exit": (1, "--load {tmp}/empty --exit-on-missing-checkpoint", "holds no checkpoint"),
    "ckpt_other_shape": (1, "--load {tmp}/ckpt --hidden-size 64",
                         "saved with hidden_size=32 but this run has hidden_size=64"),
    "ckpt_corrupt_index": (1, "--load {tmp}/ckpt_corrupt", "iter_0000001: tensors.json is truncated (9 of its "),
    # (a checkpoint with no checksums recorded: the index's own parse names it)
    "ckpt_corrupt_index_unrecorded": (1, "--load {tmp}/ckpt_corrupt_unrecorded",
                                      "tensors.json is not the JSON tensor index"),
    "ckpt_pickle_payload": (1, "--load {tmp}/ckpt_pickle", "refusing to load it"),
    "ckpt_format": (1, "--ckpt-format zarr", "--ckpt-format zarr: megalite writes one checkpoint layout"),
    "save_interval_no_save": (1, "--save-interval 5", "--save-interval needs --save DIR"),
    "finetune_no_load": (1, "--finetune", "--finetune needs --load DIR"),
    "bf16_and_fp16": (1, "--bf16 --fp16", "--bf16 and --fp16 are exclusive"),
    "mock_and_data": (1, "--mock-data --data-path {tmp}/nothing", "--mock-data and --data-path are exclusive"),
    "negative_timeout": (1, "--distributed-timeout-minutes 0", "--distributed-timeout-minutes 0.0 must be > 0"),
    "skip_train_no_eval": (1, "--skip-train --eval-iters 0", "--skip-train evaluates only"),
    "exit_interval_zero": (1, "--exit-interval 0", "--exit-interval 0 must be >= 1"),
    # data files (--data-path replaces the --mock-data of OK)
    "data_missing": (1, "--data-path {tmp}/nothing --tokenizer-type NullTokenizer --vocab-size 100", "nothing"),
    "data_truncated_bin": (1, "--data-path {tmp}/trunc --tokenizer-type NullTokenizer --vocab-size 100", "trunc"),
    "data_corrupt_idx": (1, "--data-path {tmp}/badidx --tokenizer-type NullTokenizer --vocab-size 100", "badidx"),
    "tokenizer_wrong_file": (1, "--data-path {tmp}/good --tokenizer-type SentencePieceTokenizer --tokenizer-model "
                                "{tmp}/afile", "afile"),
}


def _base(flags):
    """OK's flags; a case that names --data-path trains on that instead of --mock-data."""
    return [f for f in OK.split() if f != "--mock-data"] if "--data-path" in flags else OK.split()


def _make_files(tmp):
    """What the file cases point at: a plain file, an empty dir, a checkpoint of this model
    (hidden 32) and broken copies of it."""
    import shutil
    open(os.path.join(tmp, "afile"), "w").write("x")
    os.makedirs(os.path.join(tmp, "empty"))
    code, err = run_case(1, OK.split() + ["--save", os.path.join(tmp, "ckpt")])  # in process: no torch import
    assert code == 0, err
    for name in ("ckpt_corrupt", "ckpt_pickle", "ckpt_corrupt_unrecorded"):
        shutil.copytree(os.path.join(tmp, "ckpt"), os.path.join(tmp, name))
    for name in ("ckpt_corrupt", "ckpt_corrupt_unrecorded"):
        with open(os.path.join(tmp, name, "iter_0000001", "tensors.json"), "w") as f:
            f.write("{not json")
    os.remove(os.path.join(tmp, "ckpt_corrupt_unrecorded", "iter_0000001", "checksums.json"))
    import numpy as np
    from megalite.data.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path
    for name in ("good", "trunc", "badidx"):
        prefix = os.path.join(tmp, name)
        b = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.int32)
        for i in range(50):
            b.add_document(list(range(i % 7, i % 7 + 40)), [40])
        b.finalize(index_file_path(prefix))
    with open(data_file_path(os.path.join(tmp, "trunc")), "r+b") as f:
        f.truncate(100)  # the index promises more tokens than the file holds
    with open(index_file_path(os.path.join(tmp, "badidx")), "wb") as f:
        f.write(b"not an index" * 10)
    with open(os.path.join(tmp, "ckpt_pickle", "iter_0000001", "__0_0.safetensors"), "wb") as f:
        f.write(b"\x80\x04\x95" + b"\x00" * 64)  # a pickle's opening bytes


# Launched as torchrun launches them (each rank a process with torchrun's environment), every
# rank checked: a world that does not divide, Megatron flags megalite cannot honour, argparse's own
# error. (Not under torchrun itself: when one rank exits first it kills the others, which may not
# have printed yet on a loaded machine.) The other cases are checks every rank makes alike before
# any collective (these three prove that path on all ranks), so they run as one rank each, all in
# one process (tests/support/cli_batch.py): every process costs a torch import.
MULTI_RANK = ("world_not_divisible", "not_implemented", "missing_required")


def _argv(name, tmp):
    flags = CASES[name][1]
    return _base(flags) + flags.replace("{tmp}", tmp).split()


def _rank_env(rank, n, port):
    return dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def runs():
    """The multi-rank cases beside one process running all the others; each case's exit code
    (the first non-zero of its ranks) and per-rank stderr."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        _make_files(tmp)
        batch = {name: (CASES[name][0], _argv(name, tmp)) for name in CASES if name not in MULTI_RANK}
        json.dump(batch, open(os.path.join(tmp, "batch.json"), "w"))
        procs = {"batch": [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "support", "cli_batch.py"),
                                             os.path.join(tmp, "batch.json"), os.path.join(tmp, "batch.out")],
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)]}
        for name in MULTI_RANK:
            n, port = CASES[name][0], free_port()
            procs[name] = [subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + _argv(name, tmp),
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                            env=_rank_env(r, n, port)) for r in range(n)]
        for name, ps in procs.items():
            try:
                printed = [p.communicate(timeout=240)[-1 if name != "batch" else 0] for p in ps]
            except subprocess.TimeoutExpired:
                for p in ps:
                    p.kill()
                out.update({k: ("timeout", []) for k in (batch if name == "batch" else [name])})
                continue
            if name == "batch":
                assert ps[0].returncode == 0, printed[0].decode()[-3000:]
                done = json.load(open(os.path.join(tmp, "batch.out")))
                out.update({k: (code, [err]) for k, (code, err) in done.items()})
            else:
                out[name] = (next((p.returncode for p in ps if p.returncode), 0), [e.decode() for e in printed])
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_bad_configuration_fails_fast_on_every_rank(runs, name):
    code, ranks = runs[name]
    n, _, expected = CASES[name]
    expected = expected.split("{tmp}")[-1]
    assert code != "timeout", f"{name}: hung instead of failing"
    assert code != 0, f"{name}: exited 0"
    assert not isinstance(code, str), f"{name}: {code}"  # cli_batch: an exception escaped, not a clean exit
    assert len(ranks) == (n if name in MULTI_RANK else 1)
    for r, err in enumerate(ranks):
        assert err is not None, f"{name}: no stderr captured for rank {r}"
        lines = [ln for ln in err.splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
        assert len(lines) == 1, f"{name} rank {r}: expected one line, got:\n{err}"
        assert expected in lines[0] and lines[0].startswith(f"megalite: error (rank {r})"), lines[0]
