"""Megatron-LM's own launch scripts run on megalite with only paths changed and the model shrunk.

Megatron's GPT examples (tests/megatron_scripts/*.sh, sources named in each file) are expanded by
bash exactly as their scripts expand them; its GPT functional-test configs come from the table of
all of them (functional_configs.json.gz, tests/test_megatron_configs.py) with their ${VARS} filled
in the same way. The data / vocab / merges / checkpoint / TensorBoard paths point here; each list
is shrunk by appended overrides (sizes, batch, 3 iterations, one eval iteration, gloo) and trained
on 4 CPU ranks under torchrun. The data is GPT-2 BPE: vocab.json + merges.txt trained here with Hugging Face
`tokenizers`, documents written by tools/preprocess_data.py, read through Megatron's default
tokenizer (the scripts name none or GPT2BPETokenizer)."""

import json
import os
import random
import subprocess
import sys
import time

import pytest

from cli_batch import run_tool
from dist_util import free_port, own_stacks
from test_megatron_configs import fill, functional_configs

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPTS = os.path.join(HERE, "megatron_scripts")
# the whole run takes about 20 s here, 45 s on the slowest machine of the kind; past this it is hung (its ranks
# then write their stacks and exit, tests/megatron_scripts/run_lists.py)
STACKS_AFTER_S = 300
# (two samples per micro-batch: half the micro-batches of one, and so half the TP / PP rounds of 4 ranks on 2 cores)
SHRINK = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
          "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --eval-iters 1 "
          "--distributed-backend gloo").split()
# name: (example script or functional-test config, extra overrides beyond SHRINK)
LISTS = {
    "gpt3_345m": ("gpt3_345m.sh", []),
    # its rampup starts at 16 samples, above the shrunk global batch
    "gpt3_175b": ("gpt3_175b.sh", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                   "--rampup-batch-size", "4", "4", "8"]),
    "tp2_pp2_ce_fusion": ("gpt/gpt3_mcore_te_tp2_pp2_cross_entropy_loss_fusion", []),
    "tp1_pp4_vp1_dist_opt": ("gpt/gpt3_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce", []),
    "tp4_dist_opt_param_gather": ("gpt/gpt3_mcore_te_tp4_pp1_dist_optimizer_overlap_grad_reduce_param_gather", []),
    "tp1_pp4_swiglu": ("gpt/gpt3_mcore_te_tp1_pp4_resume_torch_dist_swiglu", []),
    # GQA with 8 groups and a 131k NullTokenizer vocabulary, shrunk with the model
    "7b_tp1_pp4_mock": ("gpt/gpt3_7b_tp1_pp4_memory_speed", ["--num-query-groups", "2", "--vocab-size", "500"]),
    # fp16 with --apply-query-key-layer-scaling (Megatron's local transformer, no TE)
    "tp1_pp2_fp16_qk_scaling": ("gpt/gpt3_mcore_tp1_pp2_fp16", []),
    "tp2_pp2_local_fp16_qk_scaling": ("gpt/gpt3_mcore_tp2_pp2_uninstall_te", []),
    # multi-latent attention (q/kv latents, YaRN; bf16, SP, async save)
    "tp2_pp2_mla": ("gpt/gpt3_mcore_te_tp2_pp2_mla", []),
    # Mixtral 8x7B (MoE, alltoall dispatch, Llama2 sentencepiece tokenizer): PP4 x EP8 needs 32 ranks, here
    # PP2 x EP2 on 4; the experts' FFN and the query groups shrunk with the model
    "mixtral_8x7b": ("mixtral_8x7b.sh", ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                                         "--ffn-hidden-size", "128", "--num-query-groups", "2"]),
}
WORDS = ("the a cat dog runs sees big small red blue house tree river stone bird sings under over near far "
         "quick slow green old new light dark warm cold high low").split()


def _corpus(path, docs=1500):
    """Short documents of a learnable word chain (each word picks its successor from 3)."""
    rng = random.Random(0)
    nxt = {w: rng.sample(WORDS, 3) for w in WORDS}
    with open(path, "w") as f:
        for _ in range(docs):
            w, words = rng.choice(WORDS), []
            for _ in range(rng.randint(10, 40)):
                words.append(w)
                w = rng.choice(nxt[w])
            f.write(json.dumps({"text": " ".join(words).capitalize() + "."}) + "\n")


def _data(root):
    """Megatron's functional-test layout under root:
    text/common_pile/v01_filtered_data/{bpe/, my-gpt3_00_text_document}."""
    from tokenizers import ByteLevelBPETokenizer
    d = os.path.join(root, "text", "common_pile", "v01_filtered_data")
    os.makedirs(os.path.join(d, "bpe"))
    corpus = os.path.join(root, "corpus.jsonl")
    _corpus(corpus)
    texts = [json.loads(line)["text"] for line in open(corpus)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"])
    bpe.save_model(os.path.join(d, "bpe"))  # vocab.json, merges.txt: GPT-2's file formats
    vocab, merges = os.path.join(d, "bpe", "vocab.json"), os.path.join(d, "bpe", "merges.txt")
    # the tools in process (tests/data runs them as programs)
    _tool("preprocess_data", "--input", corpus, "--output-prefix", os.path.join(d, "my-gpt3_00"), "--tokenizer-type",
          "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--workers", "1")
    # a Llama-2-style sentencepiece model and the corpus in its tokens (the Mixtral example's)
    spm = os.path.join(root, "llama_spm")
    _tool("train_tokenizer", "--input", corpus, "--model-prefix", spm, "--vocab-size", "400", "--workers", "1")
    _tool("preprocess_data", "--input", corpus, "--output-prefix", os.path.join(root, "llama"), "--tokenizer-type",
          "Llama2Tokenizer", "--tokenizer-model", spm + ".model", "--append-eod", "--workers", "1")
    return os.path.join(d, "my-gpt3_00_text_document"), vocab, merges, (spm + ".model",
                                                                         os.path.join(root, "llama_text_document"))


def _tool(name, *argv):
    rc, out, err = run_tool(name, *argv)  # (a main may return its statistics; an error raises or is an exit status)
    assert not isinstance(rc, int) or rc == 0, f"tools/{name}.py exited {rc}:\n{out[-2000:]}\n{err[-2000:]}"


def _argv(script, env):
    if not script.endswith(".sh"):  # a functional-test config: its launcher fills the ${VARS}
        return fill(functional_configs()[script], env)
    out = subprocess.run(["bash", "-c", 'set -e; source "$1" >/dev/null; printf "%s\\0" "${ARGV[@]}"', "_",
                          os.path.join(SCRIPTS, script)], env=dict(os.environ, **env), capture_output=True, check=True)
    return out.stdout.decode().split("\0")[:-1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_scripts")
    prefix, vocab, merges, (spm, llama_prefix) = _data(str(root))
    jobs, dirs = [], {}
    for name, (script, extra) in LISTS.items():
        d = {k: str(root / name / k) for k in ("ckpt", "tb", "cache")}
        dirs[name] = d
        env = {  # each script's own path variables
            "DATA_PATH": prefix if script in ("gpt3_345m.sh", "gpt3_175b.sh") else llama_prefix
            if script == "mixtral_8x7b.sh" else str(root),  # examples: a prefix
            "VOCAB_FILE": vocab, "MERGE_FILE": merges, "TOKENIZER_MODEL": spm,
            "CHECKPOINT_PATH": d["ckpt"], "CHECKPOINT_SAVE_PATH": d["ckpt"], "CHECKPOINT_LOAD_PATH": d["ckpt"],
            "TENSORBOARD_LOGS_PATH": d["tb"], "TENSORBOARD_PATH": d["tb"], "DATA_CACHE_PATH": d["cache"]}
        jobs.append([name, _argv(script, env) + SHRINK + extra])
    spec = str(root / "runs.json")
    json.dump(jobs, open(spec, "w"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           os.path.join(SCRIPTS, "run_lists.py"), spec, str(STACKS_AFTER_S)]
    started = time.monotonic()
    try:  # (TMPDIR: torchrun's torchelastic_* logs)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=STACKS_AFTER_S + 180,
                           env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(root)))
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:  # the ranks ended (or dumped their stacks): torchrun itself did not
        rc, out, err = "none: torchrun still running, killed", *((b or b"").decode(errors="replace")
                                                                  for b in (e.stdout, e.stderr))
    losses = json.load(open(spec + ".losses")) if os.path.exists(spec + ".losses") else {}
    stacks = "".join(f"rank {r}: {own_stacks(f'{spec}.stacks.{r}')}\n" for r in range(4)
                     if os.path.exists(f"{spec}.stacks.{r}") and os.path.getsize(f"{spec}.stacks.{r}"))
    report = (f"exit {rc}; scripts finished: {list(losses)}\n" + (f"the ranks hung; where:\n{stacks}" if stacks
              else "") + f"stdout:\n{out[-2000:]}\nstderr:\n{err[-2000:]}")
    return report, out, losses, dirs, jobs, rc, stacks, time.monotonic() - started


@pytest.mark.parametrize("name", list(LISTS))
def test_megatron_script_trains_three_iterations(runs, name):
    report, _, losses, dirs, jobs = runs[:5]
    assert name in losses, f"{name} did not finish: {report}"
    assert len(losses[name]) == 3 and all(0 < v < 20 for v in losses[name]), losses[name]
    argv = dict(jobs)[name]
    if "--save" in argv:  # the final state is saved where the script says
        meta = json.load(open(os.path.join(dirs[name]["ckpt"], "iter_0000003", "megalite.json")))
        assert meta["iteration"] == 3
        if "--swiglu" in argv:  # Megatron's SwiGLU size for hidden 64: int(8*64/3/64)*64
            assert meta["model_config"]["ffn_hidden_size"] == 128, meta["model_config"]
    if "--tensorboard-dir" in argv:  # where the script says (its last --tensorboard-dir)
        tb = argv[len(argv) - argv[::-1].index("--tensorboard-dir")]
        assert any(f.startswith("events.out.tfevents") for f in os.listdir(tb))


def test_the_job_ends_by_itself(runs):
    """Every rank returns from its last script and exits by itself: none is ended by the stack dump, and none waits
    at its end. (A run's data loaders left to the garbage collector once kept every rank's exit waiting about
    300 s, after its scripts had finished and with nothing dumped: the job takes about 25 s here, 45 s on the
    slowest machine of the kind, so half of STACKS_AFTER_S is a hang, not a slow machine.)"""
    report, rc, stacks, seconds = runs[0], runs[5], runs[6], runs[7]
    assert rc == 0 and not stacks, f"the job did not end by itself: {report}"
    assert seconds < STACKS_AFTER_S / 2, f"the job took {seconds:.0f} s: a rank waited at its end. {report}"


def test_implementation_flags_got_notices(runs):
    out = runs[1]
    for flag in ("--transformer-impl transformer_engine accepted", "--no-gradient-accumulation-fusion accepted",
                 "--attention-backend auto accepted", "--cross-entropy-loss-fusion accepted",
                 "--use-persistent-ckpt-worker accepted"):
        assert flag in out, flag


def test_generate_reads_the_gpt2_bpe_tokenizer_from_the_checkpoint(runs):
    """The checkpoint records the vocab/merges it was trained with: a text prompt needs no flags."""
    ckpt = runs[3]["gpt3_345m"]["ckpt"]
    rc, out, err = run_tool("generate", "--load", ckpt, "--prompt", "The cat sees", "--max-new-tokens", "4", "--greedy")
    assert rc == 0, err[-2000:]
    assert out.strip().startswith("The cat sees"), out
