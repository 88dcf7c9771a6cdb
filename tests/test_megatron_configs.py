"""Every GPT and BERT functional-test config of Megatron-LM (their MODEL_ARGS, extracted by
tests/megatron_scripts/extract_functional_configs.py into functional_configs.json.gz) against
megalite's command line, with only paths changed (and gloo for nccl: these are CPU ranks):

- a dense fp32/bf16/fp16/fp8 pretraining config is accepted, unless it uses a Megatron feature
  megalite does not have yet (KNOWN_GAPS, each named), and then the refusal names exactly those;
- fp4, MoE and non-pretraining workloads (inference, RL, distillation) are refused in one line
  that names the cause (context parallelism runs: --context-parallel-size, --cp-comm-type).
Parsing and validation only, in this process; tests/test_megatron_scripts.py trains a sample of
them for 3 iterations."""

import contextlib
import gzip
import io
import json
import os

import pytest

from megalite.cli.parser import parse_args

HERE = os.path.dirname(os.path.abspath(__file__))
PATHS = {"DATA_PATH": "/data", "TENSORBOARD_PATH": "/tb", "CHECKPOINT_SAVE_PATH": "/ckpt",
         "CHECKPOINT_LOAD_PATH": "/ckpt", "DATA_CACHE_PATH": "/cache", "REPEAT": "1"}

# Megatron features used by dense configs that megalite refuses today (flag: what it is).
# What megalite lacks that some config asks for: Transformer Engine's TP communication overlap.
KNOWN_GAPS = {"--tp-comm-overlap-cfg"}
KNOWN_GAP_VALUES = {}
# Refused for what their values ask, not for a flag.
KNOWN_GAP_CONFIGS = {}


def functional_configs():
    """{"gpt/NAME" or "bert/NAME": argv with ${VARS}} of every Megatron GPT/BERT functional test."""
    with gzip.open(os.path.join(HERE, "megatron_scripts", "functional_configs.json.gz"), "rt") as f:
        return json.load(f)["configs"]


def fill(argv, values):
    """The launcher's ${VAR}s replaced by values[VAR]."""
    for var, value in values.items():
        argv = [a.replace("${%s}" % var, value) for a in argv]
    return argv


def _value(argv, flag, default):
    return argv[argv.index(flag) + 1] if flag in argv else default


def out_of_scope(argv):
    """The cause a refusal must name, for configs megalite does not set out to run."""
    if _value(argv, "--tokenizer-type", "") == "TikTokenizer" or "--train-iters" not in argv and \
            "--train-samples" not in argv or any(a.startswith(("--inference-", "--rl-", "--grpo-", "--export-"))
                                                 for a in argv):
        return ""  # inference / RL / distillation entry points, not pretrain_gpt: any one-line refusal
    if any(a.startswith("--fp4") for a in argv):
        return "FP4"
    return None


def is_moe(argv):
    return int(_value(argv, "--num-experts", "0")) > 0 or any(a.startswith("--moe-") for a in argv)


def _parse(name, argv):
    argv = ["gloo" if a == "nccl" else a for a in fill(argv, PATHS)]
    model_parallel = int(_value(argv, "--tensor-model-parallel-size", "1")) * \
        int(_value(argv, "--pipeline-model-parallel-size", "1"))
    # Megatron's functional tests run on a node of 8 GPUs; a global batch too small for 8 on fewer
    dp = 8 // model_parallel if 8 % model_parallel == 0 else 1
    gbs, mbs = int(_value(argv, "--global-batch-size", 0)), int(_value(argv, "--micro-batch-size", 1))
    while gbs and dp > 1 and gbs % (mbs * dp):
        dp //= 2
    world = model_parallel * dp
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parse_args(argv, world_size=world, defaults={"model_type": "bert"} if name.startswith("bert/") else None)
        except SystemExit:
            return [ln for ln in err.getvalue().splitlines() if ln.strip()]
    return None


def _refused_flags(line):
    if "cannot honour" not in line:
        return set()
    return {tok.rstrip(",:") for part in line.split("relaunch): ", 1)[1].split(" | ")
            for tok in part.split(": ", 1)[0].split() if tok.startswith("--")}


def test_every_functional_config_starts_or_names_its_cause():
    configs = functional_configs()
    assert len(configs) > 200, len(configs)
    started, problems = [], []
    for name, argv in sorted(configs.items()):
        refusal, cause = _parse(name, argv), out_of_scope(argv)
        if refusal is not None and (len(refusal) != 1 or not refusal[0].startswith("megalite: error (rank 0): ")):
            problems.append(f"{name}: not one error line: {refusal}")
            continue
        gaps = {a for a in argv if a in KNOWN_GAPS} | {f for f, v in KNOWN_GAP_VALUES if _value(argv, f, None) == v}
        if name in KNOWN_GAP_CONFIGS:
            gaps.add(KNOWN_GAP_CONFIGS[name])
        if cause is not None:
            if refusal is None:
                problems.append(f"{name}: accepted, but it needs {cause or 'another entry point'}")
            elif cause not in refusal[0]:
                problems.append(f"{name}: refusal does not name {cause}: {refusal[0]}")
        elif is_moe(argv) and refusal is not None:
            # megalite's MoE is partial (expert-parallel size 1): a refused MoE config is fine when the
            # line names what is missing (MoE options or other features)
            if not _refused_flags(refusal[0]):
                problems.append(f"{name}: an MoE config refused without naming a flag: {refusal[0]}")
        elif not gaps:
            if refusal is None:
                started.append(name)
            else:
                problems.append(f"{name}: a dense config was refused: {refusal[0]}")
        elif refusal is None:
            problems.append(f"{name}: accepted although megalite lacks {sorted(gaps)}")
        elif name not in KNOWN_GAP_CONFIGS and _refused_flags(refusal[0]) - gaps:
            problems.append(f"{name}: refused for more than its known gaps: {refusal[0]}")
        elif name in KNOWN_GAP_CONFIGS and KNOWN_GAP_CONFIGS[name] not in refusal[0]:
            problems.append(f"{name}: {refusal[0]}")
    assert not problems, "\n".join(problems)
    # the two Megatron scripts that train in tests/test_megatron_scripts.py are among them
    assert {"gpt/gpt3_mcore_tp1_pp2_fp16", "gpt/gpt3_mcore_tp2_pp2_uninstall_te"} <= set(started)
    # and Megatron's FSDP configs (ZeRO-3 and its flags) and its FIM data config
    assert "gpt/gpt3_mcore_te_tp1_pp1_dist_optimizer_fim_dataset" in started
    assert {"gpt/gpt3_mcore_tp1_pp1_fsdp2_resume_torch_dist_te", "gpt/gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor"} \
        <= set(started)
    # and its re-run state machine configs with fault injection (megalite/rerun.py)
    assert {"gpt/gpt3_mcore_reruns_persistent_1", "gpt/gpt3_mcore_reruns_persistent_1_1node",
            "gpt/gpt3_mcore_reruns_transient"} <= set(started)
    # and its W&B-logging release configs, MLA configs and muP config
    assert {"bert/bert_release", "gpt/gpt3_15b_8t_release", "gpt/gpt3_mcore_te_tp2_pp2_mla",
            "gpt/gpt3_mcore_te_tp2_pp2_mla_1node", "gpt/gpt3_mcore_te_tp1_pp1_mup"} <= set(started)
    # and its DeepSeek sparse attention config (DSA on MLA)
    assert "gpt/gpt3_mcore_te_tp2_pp2_dsa" in set(started)
    print(f"{len(started)} of {len(configs)} Megatron functional-test configs start")


@pytest.mark.parametrize("flag,line", [
    ("--dataloader-type cyclic", "--dataloader-type cyclic: only the 'single' (sequential) data loader"),
    ("--spec my.module fn", "--spec my.module fn: custom layer specs are not implemented"),
    ("--ckpt-format zarr", "--ckpt-format zarr: megalite writes one checkpoint layout")])
def test_values_megalite_does_not_have_are_named(flag, line):
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 --lr 1e-3 "
            "--train-iters 3 --mock-data " + flag).split()
    refusal = _parse("gpt/x", argv)
    assert refusal and len(refusal) == 1 and line in refusal[0], refusal
