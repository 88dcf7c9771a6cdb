"""Checkpoints: exact resume, resume at another topology, crash safety, pickle refusal.

Runs train on the parity harness's learnable data (tests/support/parity.py: a bigram chain whose
loss falls fast), so a checkpoint that loses or scrambles state shows in the losses.
"Straight" runs train 10 iterations; split runs stop after 5 with --exit-interval (the LR
schedule still spans 10), save, and a fresh process (a new spawn) loads and trains 5 more.
"""

import json
import os
import pickle
import shutil
import signal

import pytest
import torch

import pretrain_gpt
from dist_util import run_on_ranks, start_on_ranks
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.training import pretrain
from parity import BASE, MB2, learnable_datasets

TEN = [*MB2, "--train-iters", "10", "--lr-decay-style", "cosine", "--min-lr", "1e-3"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def _train(argv):
    args = parse_args(list(BASE) + TEN + list(argv), world_size=max(1, ps.world_size()))
    try:
        return pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
    finally:
        ps.destroy_model_parallel()


def _train_all(runs):
    return [_train(argv) for argv in runs]


def _spawn(world, runs):
    """Each run in turn on one spawn of `world` ranks; [losses of the last rank per run]."""
    if world == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _train_all(runs)
        finally:
            torch.set_num_threads(threads)
    return run_on_ranks(_train_all, world, runs, timeout=420)[-1]


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


RESUME_LAYOUTS = {
    # name: (world size, layout flags); "async" names save with --async-save
    "single_dropout": (1, DROPOUT),
    "tp2_sp_dp2_dropout_async_verified": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                              "--verify-integrity"] + DROPOUT),
    "pp2_interleaved_dp2_zero1": (4, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                                      "1", "--use-distributed-optimizer"]),
    "pp2_dp2_zero2_bf16": (4, ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                               "--zero-stage", "2", "--bf16"]),
    "cp2_dp2_zero1_dropout": (4, ["--context-parallel-size", "2", "--use-distributed-optimizer"] + DROPOUT),
    "pp2_zbv_dp2_zero1": (4, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
                              "--use-distributed-optimizer"]),
}
# checkpoints of one pipeline placement continued at another (global layer numbers): name -> (flags, saved by)
CROSS = {
    "zbv_to_pp4_1f1b": (["--pipeline-model-parallel-size", "4", "--use-distributed-optimizer"], "pp2_zbv_dp2_zero1"),
    "interleaved_to_zbv": (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"],
                           "pp2_interleaved_dp2_zero1"),
    # (TP2, DP1: DualPipeV's 2p = 4 micro-batches of the global batch of 4)
    "zbv_to_tp2_dualpipev": (["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                              "--pipeline-schedule", "dualpipev", "--use-distributed-optimizer"], "pp2_zbv_dp2_zero1"),
}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Per layout: (straight losses, first half, resumed half, checkpoint dir). The 4-rank layouts run
    in two halves, each one spawn for the first halves and one for the resumes; the halves and the
    single-process layout side by side (one world alone leaves the cores idle while its ranks wait). The CROSS
    loads run with the second half's resumes: out[name] = their losses."""
    out, dirs = {}, {n: str(tmp_path_factory.mktemp(n) / "ckpt") for n in RESUME_LAYOUTS}

    def first_runs(names):
        runs = []
        for n in names:
            flags = RESUME_LAYOUTS[n][1]
            save = ["--save", dirs[n], "--save-interval", "3", "--exit-interval", "5"]
            runs += [flags, flags + save + (["--async-save"] if "async" in n else [])]
        return runs

    def second_runs(names):
        return [RESUME_LAYOUTS[n][1] + ["--load", dirs[n]] for n in names]

    def record(names, firsts, seconds):
        for i, n in enumerate(names):
            out[n] = (firsts[2 * i], firsts[2 * i + 1], seconds[i], dirs[n])
    four = [n for n, (w, _) in RESUME_LAYOUTS.items() if w == 4]
    halves = [four[0::2], four[1::2]]
    started = [start_on_ranks(_train_all, 4, first_runs(h), timeout=420) for h in halves]
    ones = [n for n, (w, _) in RESUME_LAYOUTS.items() if w == 1]
    record(ones, _spawn(1, first_runs(ones)), _spawn(1, second_runs(ones)))
    firsts = [w.result()[-1] for w in started]
    cross = [flags + ["--load", dirs[saved_by]] for flags, saved_by in CROSS.values()]
    started = [start_on_ranks(_train_all, 4, second_runs(h) + (cross if i else []), timeout=420)
               for i, h in enumerate(halves)]
    for i, (h, f, w) in enumerate(zip(halves, firsts, started)):
        losses = w.result()[-1]
        record(h, f, losses)
        if i:
            out.update(zip(CROSS, losses[len(h):]))
    return out


@pytest.mark.parametrize("name", list(RESUME_LAYOUTS))
def test_resume_is_bit_identical(name, resumed):
    straight, first, second, d = resumed[name]
    assert len(straight) == 10 and first == straight[:5]
    assert straight[0] - straight[-1] > 0.5, straight  # learnable data: a lost state cannot hide
    assert open(os.path.join(d, "latest_checkpointed_iteration.txt")).read().strip() == "5"
    assert sorted(os.listdir(d)) == ["iter_0000003", "iter_0000005", "latest_checkpointed_iteration.txt"]
    assert second == straight[5:], f"{name}: resumed {second} vs straight {straight[5:]}"
    if "verified" in name:  # --verify-integrity: every file hashed at save (and checked at the load above)
        for it in ("iter_0000003", "iter_0000005"):
            recorded = json.load(open(os.path.join(d, it, "integrity.json")))
            on_disk = {os.path.relpath(os.path.join(r, f), os.path.join(d, it))
                       for r, _, fs in os.walk(os.path.join(d, it))
                       for f in fs}
            assert set(recorded) == on_disk - {"integrity.json"} and "rng/rank_00003.json" in recorded, recorded


@pytest.mark.parametrize("name", list(CROSS))
def test_the_v_and_the_loop_continue_each_others_checkpoints(name, resumed):
    """ZB-V's two chunks per rank hold the stages of a V (chunk 0 of PP rank 0 the model's second stage of four),
    yet its checkpoint names every layer by its global number: the loop continues it, and it the loop's, as the
    saving run went on (the same sums, in the order of another DP size: rounding only)."""
    straight = resumed[CROSS[name][1]][0]
    assert _rel(resumed[name], straight[5:]) <= 1e-5, f"{name}: {resumed[name]} vs {straight[5:]}"
    assert resumed[name][0] < straight[0] - 0.5  # (fresh weights would restart near ln V)


def test_resume_at_another_topology(tmp_path):
    """Saved at TP2 x PP2 x DP2; continued at TP1 x PP1 x DP1 and at TP4 x DP2 with ZeRO."""
    d = str(tmp_path / "ckpt")
    src = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    straight, _ = _spawn(8, [src, src + ["--save", d, "--exit-interval", "5"]])
    (single,) = _spawn(1, [["--load", d]])
    (tp4,) = _spawn(8, [["--tensor-model-parallel-size", "4", "--use-distributed-optimizer", "--load", d]])
    assert _rel(single, straight[5:]) <= 1e-5, f"TP1: {single} vs {straight[5:]}"
    assert _rel(tp4, straight[5:]) <= 1e-5, f"TP4 x DP2 ZeRO: {tp4} vs {straight[5:]}"
    # a wrong load (e.g. fresh weights) would restart near ln(V): rule that out plainly
    assert straight[4] - single[0] > -0.05 and single[0] < straight[0] - 0.5


def test_context_parallel_checkpoint_continues_at_cp1_and_cp4(resumed):
    """CP shards no weights: the CP2 x DP2 checkpoint (ZeRO shards over DP x CP) goes on at
    CP1 (one process) and at CP4 with ZeRO-2, as the straight CP2 run does (dropout off here:
    CP ranks draw their own attention-dropout streams, so only the same layout repeats them)."""
    straight, _, _, d = resumed["cp2_dp2_zero1_dropout"]
    nodrop = ["--hidden-dropout", "0", "--attention-dropout", "0", "--load", d]
    (single,) = _spawn(1, [nodrop])
    cp4, cp2 = _spawn(4, [nodrop + ["--context-parallel-size", "4", "--use-distributed-optimizer", "--zero-stage", "2"],
                          nodrop + ["--context-parallel-size", "2", "--use-distributed-optimizer"]])
    assert _rel(single, cp2) <= 1e-5, f"CP1: {single} vs CP2 {cp2}"
    assert _rel(cp4, cp2) <= 1e-5, f"CP4 ZeRO-2: {cp4} vs CP2 {cp2}"
    assert straight[4] - cp2[0] > -0.3 and cp2[0] < straight[0] - 0.5  # the trained weights, not fresh ones
    # and tools/generate.py (CP 1) continues a prompt from the CP-trained checkpoint
    import contextlib
    import io

    from cli_batch import tool
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tool("generate").main(["--load", d, "--prompt-ids", "3 9 14", "--max-new-tokens", "4", "--greedy"])
    assert "generate: 4 new tokens:" in out.getvalue(), out.getvalue()


def _kill_during_second_save(d):
    """Train with --save-interval 2; die (SIGKILL) halfway through writing iteration 4."""
    from megalite.checkpoint import storage

    real = storage.SafetensorsWriter.write_data

    def dying(self, plan, planner):
        if "iter_0000004" in self.path:
            with open(os.path.join(self.path, plan.storage_data), "wb") as f:
                f.write(b"partial")
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, plan, planner)

    storage.SafetensorsWriter.write_data = dying
    torch.set_num_threads(1)  # as the straight run it is compared with: same reduction order
    _train(["--save", d, "--save-interval", "2"])


def test_crash_during_save_keeps_previous_checkpoint(tmp_path):
    import multiprocessing as mp
    d = str(tmp_path / "ckpt")
    p = mp.get_context("spawn").Process(target=_kill_during_second_save, args=(d,))
    p.start()
    p.join(300)
    assert p.exitcode == -signal.SIGKILL, f"the saving process was to be killed, exit code {p.exitcode}"
    assert open(os.path.join(d, "latest_checkpointed_iteration.txt")).read().strip() == "2"
    assert os.path.isdir(os.path.join(d, "iter_0000004.tmp")) and not os.path.exists(os.path.join(d, "iter_0000004"))
    straight, resumed = _spawn(1, [[], ["--load", d, "--save", d, "--save-interval", "4"]])
    assert resumed == straight[2:]  # lost: only the steps since the previous checkpoint
    assert not os.path.exists(os.path.join(d, "iter_0000004.tmp"))  # the next save cleaned up


class _Payload:
    """Unpickling this would create a file: proof that something ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("victim", ["__0_0.safetensors", "tensors.json", "megalite.json",
                                    "rng/rank_00000.json"])
def test_pickle_payload_is_refused(victim, tmp_path, capsys):
    d = str(tmp_path / "ckpt")
    _spawn(1, [["--save", d, "--exit-interval", "2"]])
    marker = str(tmp_path / "executed")
    with open(os.path.join(d, "iter_0000002", victim), "wb") as f:
        pickle.dump(_Payload(marker), f)
    with pytest.raises(SystemExit) as e:
        _train(["--load", d])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and victim.split("/")[-1] in err[0] and "refusing to load it" in err[0], err
    assert "pickle" in err[0]
    assert not os.path.exists(marker)


def test_a_runs_checkpoint_io_reports_its_background_error_and_ends_its_thread():
    """--async-save's writer belongs to the run (checkpoint/writer.py; no module-global survives into a second run
    or a forked rank): a failed background write is raised at the next wait, and close() ends the thread."""
    import threading

    from megalite.checkpoint.writer import CheckpointIO
    io = CheckpointIO()
    assert io.group() is None  # one process without torch.distributed: DCP runs without a group

    def failing():
        raise OSError("disk full")
    io.submit(failing)
    with pytest.raises(OSError, match="disk full"):
        io.wait()
    io.wait()  # (raised once)
    io.submit(lambda: None)
    with pytest.raises(AssertionError, match="still in flight"):
        io.submit(lambda: None)
    io.close()
    assert not any(t.name.startswith("megalite-ckpt") and t.is_alive() for t in threading.enumerate())


def test_use_checkpoint_args_takes_the_saved_model_flags(tmp_path, capsys):
    """The checkpoint (hidden 32, 4 heads, biases) overrides a command line that says hidden 64,
    8 heads, no biases, so it loads and goes on exactly; without a checkpoint the command line stands."""
    d = str(tmp_path / "ckpt")
    straight = _spawn(1, [["--save", d, "--exit-interval", "2"], []])[1]
    other = ["--hidden-size", "64", "--num-attention-heads", "8", "--disable-bias-linear"]
    resumed = _train(["--load", d, "--use-checkpoint-args", "--exit-interval", "4"] + other)
    assert resumed == straight[2:4], (resumed, straight)
    assert f"--use-checkpoint-args: model flags from {d}/iter_0000002" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # the same command line without the flag
        _train(["--load", d, "--exit-interval", "4"] + other)
    assert "hidden_size=32 but this run has hidden_size=64" in capsys.readouterr().err
    fresh = _train(["--load", str(tmp_path / "empty"), "--use-checkpoint-args", "--exit-interval", "1"] + other)
    assert len(fresh) == 1 and "no checkpoint in --load" in capsys.readouterr().out


ARGS_ONLY = ["--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1", "--mock-data"]


def _metadata_only_checkpoint(root, model_config):
    """What --use-checkpoint-args reads: the tracker and the metadata's model config."""
    (root / "release").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("release\n")
    (root / "release" / "megalite.json").write_text(json.dumps({"format": "megalite-checkpoint",
                                                                "model_config": model_config}))
    return str(root)


@pytest.mark.parametrize("flags", [
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear --group-query-attention "
    "--num-query-groups 2 --untie-embeddings-and-output-weights --norm-epsilon 1e-6 --rotary-base 5e5 "
    "--hidden-dropout 0 --attention-dropout 0 --vocab-size 300 --ffn-hidden-size 80",
    "--num-layers 4 --num-experts 4 --moe-ffn-hidden-size 32 --moe-layer-freq ([0]+[1]*3) --moe-router-topk 1 "
    "--moe-router-pre-softmax --moe-shared-expert-intermediate-size 48 --moe-shared-expert-gate --disable-bias-linear",
    "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
    "--v-head-dim 16 --position-embedding-type rope --normalization RMSNorm --qk-layernorm"],
    ids=["llama", "moe", "mla"])
def test_use_checkpoint_args_gives_back_every_model_field(tmp_path, flags):
    """A command line with no model flag at all builds the model the checkpoint recorded, field for field."""
    from megalite.cli.parser import model_config
    from megalite.checkpoint.manager import config_json
    sizes = "--num-layers 2 --hidden-size 64 --num-attention-heads 8 --seq-length 32".split()
    a = parse_args(sizes + flags.split() + ARGS_ONLY, world_size=1)
    saved = config_json(model_config(a, a.vocab_size))
    b = parse_args(["--load", _metadata_only_checkpoint(tmp_path, saved), "--use-checkpoint-args"] + ARGS_ONLY,
                   world_size=1)
    got = config_json(model_config(b, b.vocab_size))
    assert {k: (v, got[k]) for k, v in saved.items() if got[k] != v} == {}


def test_use_checkpoint_args_megatron_semantics_and_errors(tmp_path, capsys):
    """As Megatron: the checkpoint's architecture replaces the command line's, an explicit --seq-length
    stands. No checkpoint and no sizes: one line naming --load."""
    root = _metadata_only_checkpoint(tmp_path / "ckpt", dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=48,
        seq_length=64, max_position_embeddings=64, vocab_size=100, position_embedding_type="rope",
        normalization="RMSNorm", swiglu=True, add_bias_linear=False))
    args = parse_args(["--load", root, "--use-checkpoint-args", "--hidden-size", "64", "--seq-length", "16"]
                      + ARGS_ONLY, world_size=1)
    got = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size", "kv_channels", "seq_length",
                                         "max_position_embeddings", "vocab_size", "position_embedding_type",
                                         "swiglu", "disable_bias_linear", "group_query_attention", "num_query_groups")}
    assert got == dict(num_layers=2, hidden_size=32, ffn_hidden_size=48, kv_channels=8, seq_length=16,
                       max_position_embeddings=64, vocab_size=100, position_embedding_type="rope", swiglu=True,
                       disable_bias_linear=True, group_query_attention=True, num_query_groups=2), got
    assert "(replacing the command line's --hidden-size 64)" in capsys.readouterr().out
    for load, expect in ((str(tmp_path / "nowhere"), f"--load {tmp_path / 'nowhere'} does not exist"),
                         (str(tmp_path), "holds no checkpoint"), (None, "--use-checkpoint-args needs --load DIR")):
        with pytest.raises(SystemExit):
            parse_args((["--load", load] if load else []) + ["--use-checkpoint-args"] + ARGS_ONLY, world_size=1)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expect in err[0], err
        assert load is None or "--num-layers, --hidden-size, --num-attention-heads, --seq-length" in err[0], err

def test_missing_load_dir_trains_from_scratch_and_bad_paths_fail(tmp_path, capsys):
    fresh = _spawn(1, [["--load", str(tmp_path / "nothing-here"), "--exit-interval", "2"]])[0]
    assert len(fresh) == 2
    assert "no checkpoint in --load" in capsys.readouterr().out
    f = tmp_path / "afile"
    f.write_text("x")
    for argv, expect in ((["--load", str(f)], "is a file"), (["--save", str(f)], "is a file"),
                         (["--load", str(tmp_path / "nothing"), "--exit-on-missing-checkpoint"],
                          "holds no checkpoint")):
        with pytest.raises(SystemExit):
            _train(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expect in err[0], err


def test_model_shape_mismatch_is_one_line(tmp_path, capsys):
    d = str(tmp_path / "ckpt")
    _spawn(1, [["--save", d, "--exit-interval", "1"]])
    with pytest.raises(SystemExit):
        _train(["--load", d, "--hidden-size", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hidden_size=32" in err[0] and "hidden_size=64" in err[0], err
    shutil.rmtree(d)


def test_save_retain_interval_keeps_multiples_and_the_newest(tmp_path, capsys):
    """Megatron's --save-retain-interval: each save deletes the previous checkpoint unless its
    iteration is a multiple of the interval; the newest is kept and resumes."""
    d = str(tmp_path / "ckpt")
    _train(["--save", d, "--save-interval", "1", "--save-retain-interval", "2", "--exit-interval", "5"])
    assert sorted(n for n in os.listdir(d) if n.startswith("iter_")) == \
        ["iter_0000002", "iter_0000004", "iter_0000005"]
    assert open(os.path.join(d, "latest_checkpointed_iteration.txt")).read().strip() == "5"
    assert len(_train(["--load", d, "--exit-interval", "6"])) == 1  # resumes at 5
    with pytest.raises(SystemExit):
        parse_args(list(BASE) + TEN + ["--save", d, "--save-interval", "2", "--save-retain-interval", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--save-retain-interval 3 must be a positive multiple of --save-interval (2)" in err[-1]
