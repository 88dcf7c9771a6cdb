"""tools/generate.py and megalite.models.generation: the KV cache changes nothing, TP2 samples what TP1
samples, and the CLI prints a continuation. Checkpoints come from short runs on the parity
harness's learnable data."""

import os
import subprocess
import sys

import pytest
import torch

from cli_batch import run_tool, tool
from dist_util import run_on_ranks
from megalite import parallel_state as ps
from parity import LLAMA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAVOURS = {"gpt2": [], "llama": list(LLAMA)}
PROMPT = [3, 9, 14, 1]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from test_checkpoint import _spawn
    dirs = {f: str(tmp_path_factory.mktemp(f) / "ckpt") for f in FLAVOURS}
    _spawn(1, [FLAVOURS[f] + ["--save", d] for f, d in dirs.items()])
    return dirs


def _generate(root, tp, use_cache, steps=12):
    from megalite.models.generation import generate
    model, _ = tool("generate").load_model(root, tp)
    try:
        return generate(model, torch.tensor([PROMPT, PROMPT[::-1]]), steps, model.config.vocab_size,
                        use_cache=use_cache, greedy=True).tolist()
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_kv_cache_equals_full_recompute(ckpts, flavour):
    with_cache, without = _generate(ckpts[flavour], 1, True), _generate(ckpts[flavour], 1, False)
    assert with_cache == without
    assert len(with_cache[0]) == len(PROMPT) + 12 and with_cache[0][:4] == PROMPT


def _tp2(dirs):
    return {f: _generate(d, 2, True) for f, d in dirs.items()}


def test_tp2_generation_equals_tp1(ckpts):
    tp2 = run_on_ranks(_tp2, 2, ckpts)
    for f in FLAVOURS:
        tp1 = _generate(ckpts[f], 1, True)
        assert tp2[0][f] == tp1 and tp2[1][f] == tp1, f


def test_cli(ckpts, tmp_path):
    rc, out, err = run_tool("generate", "--load", ckpts["llama"], "--prompt-ids", "3 9 14", "--max-new-tokens", "5",
                            "--top-k", "5", "--top-p", "0.9", "--temperature", "0.8")
    assert rc == 0, err
    assert "generate: 5 new tokens:" in out
    program = os.path.join(ROOT, "tools", "generate.py")  # as a program once: its exit status and one-line error
    r = subprocess.run([sys.executable, program, "--load", ckpts["llama"], "--prompt", "hello"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "records no tokenizer" in r.stderr and len(r.stderr.strip().splitlines()) == 1
