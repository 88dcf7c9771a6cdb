"""A Megatron-LM user's command line: Megatron's defaults, its required flags, its --split
spellings, and every flag megalite cannot honour reported in one message (in process; the
launch scripts themselves run in tests/test_megatron_scripts.py)."""

import os
import subprocess

import pytest

from megalite.cli.parser import build_parser, parse_args
from megalite.cli.compat import megatron_flags
from megalite.cli.validate import normalize_split

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 --lr 1e-3 "
         "--train-iters 3 --mock-data").split()

# Where megalite's default differs from Megatron's on purpose; each keeps Megatron's maths.
DIFFERENT_ON_PURPOSE = {
    "--distributed-backend": "None picks nccl with CUDA, gloo without; Megatron's nccl cannot run on CPU ranks",
    "--overlap-grad-reduce": "overlapping the DP reduction changes no value, only speed",
    "--profile-ranks": "[0], Megatron's documented default (this parser's list is empty, which profiles no rank)",
    "--rerun-mode": "disabled (Megatron's validate_results needs a second host read and a world all-reduce per "
                    "iteration); a NaN/Inf loss or gradient still stops the run, and no value changes",
    "--rope-scaling-factor": "None, so that one given without --use-rope-scaling is refused instead of ignored; "
                             "with it, Megatron's 8.0 (cli/features/model.py's fill_rope_scaling)",
}


def _argv_of(script, **paths):
    """The argv a Megatron launch script (tests/megatron_scripts) hands pretrain_gpt.py, by bash."""
    env = dict(os.environ, **paths)
    out = subprocess.run(["bash", "-c", 'set -e; source "$1" >/dev/null; printf "%s\\0" "${ARGV[@]}"', "_",
                          os.path.join(HERE, "megatron_scripts", script)], env=env, capture_output=True, check=True)
    return out.stdout.decode().split("\0")[:-1]


def _error(argv, capsys, world_size=1):
    with pytest.raises(SystemExit) as e:
        parse_args(argv, world_size=world_size)
    assert e.value.code != 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("megalite: error (rank 0): "), err
    return err[0]


def test_shared_flags_have_megatrons_defaults():
    """Every flag megalite shares with Megatron-LM (its parser's flag list, megatron_flags.json)
    defaults to Megatron's value, except the documented ones."""
    theirs, checked, differ = megatron_flags(), 0, {}
    for act in build_parser()._actions:
        for flag in act.option_strings:
            if flag not in theirs:
                continue
            mine, meg = act.default, theirs[flag][2]
            if theirs[flag][0] == 0 and act.nargs == 0:  # switches: off by default on both sides
                # Megatron's --disable-x / --no-x store False into a positive dest that defaults to True
                negative = flag.startswith(("--disable-", "--no-")) and meg is True and act.const is True
                same = mine is False if negative else bool(mine) == bool(meg)
            elif isinstance(meg, (int, float)) and isinstance(mine, (int, float)):
                same = float(mine) == float(meg)
            else:
                same = mine == meg
            checked += 1
            if not same:
                differ[flag] = (mine, meg)
    assert checked > 100, checked
    assert set(differ) == set(DIFFERENT_ON_PURPOSE), differ


@pytest.mark.parametrize("flag,value", [("--min-lr", 0.0), ("--lr-warmup-iters", 0), ("--lr-decay-style", "linear"),
                                        ("--log-interval", 100), ("--eval-iters", 100), ("--eval-interval", None),
                                        ("--num-workers", 2), ("--weight-decay", 0.01), ("--adam-beta2", 0.999)])
def test_named_defaults(flag, value):
    args = parse_args(SMALL, world_size=1)
    assert getattr(args, flag[2:].replace("-", "_")) == value


def test_swiglu_ffn_is_megatrons():
    """int(8h/3 / 64) * 64 (rounded down), so the same flags build Megatron's (and HF Llama's) shape."""
    from megalite.cli.parser import model_config
    for h, ffn in ((64, 128), (256, 640), (2048, 5440), (4096, 10880), (5120, 13632)):
        args = parse_args(SMALL + ["--swiglu", "--hidden-size", str(h), "--num-attention-heads", "4"], world_size=1)
        assert model_config(args, 128).ffn_hidden_size == int((4 * h * 2 / 3) / 64) * 64 == ffn


def test_required_flags_listed_in_one_line(capsys):
    line = _error(["--mock-data"], capsys)
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--micro-batch-size",
                 "--lr", "--train-iters"):
        assert flag in line, line


@pytest.mark.parametrize("given,parsed", [("969,30,1", "969,30,1"), ("'99,1,0'", "99,1,0"),
                                          ('"949, 50, 1"', "949,50,1"),
                                          ("98/2/0", "98,2,0"), ("100", "100,0,0"), ("0.9,0.1", "0.9,0.1,0")])
def test_split_spellings(given, parsed):
    assert normalize_split(given) == parsed
    assert parse_args(SMALL + ["--split", given], world_size=1).split == parsed


def test_bad_values_are_one_line(capsys):
    assert "--min-lr 0.01 exceeds --lr 0.001" in _error(SMALL + ["--min-lr", "0.01"], capsys)
    assert "--split '1,2,3,4'" in _error(SMALL + ["--split", "1,2,3,4"], capsys)
    assert "--lr-warmup-fraction and --lr-warmup-iters are exclusive" in \
        _error(SMALL + ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], capsys)
    assert "invalid choice: 'WSDX'" in _error(SMALL + ["--lr-decay-style", "WSDX"], capsys)


def test_llama3_script_parses_as_shipped(capsys):
    """Megatron's Llama-3 8B script as shipped (its FP8 one): every flag honoured; the implementation-only flags pass
    with notices, its FP8 flags are megalite's own (--fp8-format hybrid, the delayed recipe's history,
    --fp8-param-gather) and --grad-reduce-in-bf16 sends the DP reduction in bf16; on CPU its nsys --profile asks
    for --use-pytorch-profiler."""
    argv = _argv_of("llama3_8b.sh", CHECKPOINT_PATH="/c", TENSORBOARD_LOGS_PATH="/t", TOKENIZER_ARG="MOCK",
                    DATA_ARG="MOCK", DATA_CACHE_PATH="/d")
    assert {"--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--grad-reduce-in-bf16"} <= set(argv)
    kept = list(argv)
    assert "--profile" in kept and "--use-pytorch-profiler" not in kept  # (its --profile is nsys' capture range)
    if not __import__("torch").cuda.is_available():
        assert "needs CUDA; add --use-pytorch-profiler" in _error(kept, capsys, world_size=8)
        kept.append("--use-pytorch-profiler")  # (its --tensorboard-dir takes the traces)
    args = parse_args(kept, world_size=8)
    assert args.fp8_param_gather and args.fp8_format == "hybrid" and args.use_distributed_optimizer
    assert args.grad_reduce_in_bf16


def test_renamed_flag_points_to_the_new_name(capsys):
    line = _error(_argv_of("sc21_1.7b.sh", MEGATRON_DATA="/d", BPE_VOCAB_FILE="/v", BPE_MERGE_FILE="/m"), capsys,
                  world_size=4)
    assert "--activations-checkpoint-method: renamed in Megatron-LM: use --recompute-granularity full " \
           "--recompute-method" in line
    assert "--DDP-impl" not in line  # an implementation choice: accepted with a notice


def test_no_position_embedding_only_with_rope(capsys):
    """Megatron's deprecated --no-position-embedding: a no-op with rope (Mixtral's example passes both)."""
    assert not parse_args(list(SMALL) + ["--no-position-embedding", "--position-embedding-type", "rope"],
                          world_size=1).add_position_embedding
    assert "use --position-embedding-type" in _error(list(SMALL) + ["--no-position-embedding"], capsys)


def test_unknown_and_not_implemented_are_told_apart(capsys):
    line = _error(SMALL + ["--num-layerz", "3", "--moe-input-jitter-eps", "0.01", "--fp4-format", "e2m1",
                           "--hybrid-override-pattern", "p", "--batch-size", "4"], capsys)
    assert "--num-layerz: unrecognized (did you mean --num-layers?)" in line
    assert "--moe-input-jitter-eps: this Mixture of Experts option is not implemented in megalite" in line
    assert "--fp4-format: FP4 training (Transformer Engine's NVFP4) is not implemented" in line
    assert "--hybrid-override-pattern: hybrid/Mamba models are not implemented" in line
    assert "--batch-size: renamed in Megatron-LM: use --micro-batch-size" in line
    # values go with their flags
    assert "'3'" not in line and "'4'" not in line and "'p'" not in line and "e2m1" not in line


def test_implementation_flags_are_accepted_with_a_notice(capsys):
    flags = ["--transformer-impl", "transformer_engine", "--attention-backend", "fused",
             "--no-gradient-accumulation-fusion",
             "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
             "--no-persist-layer-norm", "--cross-entropy-loss-fusion", "--no-create-attention-mask-in-dataloader",
             "--no-mmap-bin-files", "--empty-unused-memory-level", "1", "--timing-log-level", "2",
             "--logging-level", "20", "--moe-permute-fusion", "--moe-router-fusion", "--cuda-graph-impl",
             "transformer_engine", "--cuda-graph-warmup-steps", "3", "--te-rng-tracker"]
    parse_args(SMALL + flags, world_size=1)
    out = capsys.readouterr().out
    for flag in (f for f in flags if f.startswith("--")):
        assert f"megalite: {flag}" in out and "accepted" in out, (flag, out)


def test_implementation_only_flags_change_nothing():
    """The notices of Megatron's fusion, CUDA-graph and RNG-tracker flags (its functional tests carry them): the
    same run, loss for loss and weight for weight, on a MoE model (where the fusions would act)."""
    import torch
    from parity import MB2, MOE, layout, train
    flags = ("--moe-permute-fusion", "--moe-router-fusion", "--cuda-graph-impl", "local", "--cuda-graph-modules",
             "attn", "--cuda-graph-warmup-steps", "2", "--enable-cuda-graph", "--te-rng-tracker")
    plain, noticed = (train(layout(name, model=MB2 + MOE, flags=f)) for name, f in (("plain", ()), ("fused", flags)))
    assert noticed["losses"] == plain["losses"]
    for name, p in plain["params"].items():
        assert torch.equal(noticed["params"][name], p), name


def test_recompute_activations_is_selective():
    assert parse_args(SMALL + ["--recompute-activations"], world_size=1).recompute_granularity == "selective"


def test_default_tokenizer_with_data_path_is_gpt2_bpe():
    args = parse_args([f for f in SMALL if f != "--mock-data"] + ["--data-path", "x_text_document"], world_size=1)
    assert args.tokenizer_type == "GPT2BPETokenizer"
