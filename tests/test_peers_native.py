"""benchmarks/peers.py compares megalite with a plain PyTorch Llama (benchmarks/peers_native.py) from one
Hugging Face starting point: the comparison means something only if the three compute the same function.
One process: the native module loads a save_pretrained directory as is and gives transformers' logits;
megalite, after `tools/convert_checkpoint.py --loader hf`, gives them too.
"""

import importlib.util
import os

import pytest
import torch

from cli_batch import convert
from test_checkpoint_hf import megalite_logits

transformers = pytest.importorskip("transformers", reason="the peers benchmark starts from a transformers "
                                   "checkpoint (the [test] extra installs it)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _native():
    spec = importlib.util.spec_from_file_location("peers_native", os.path.join(ROOT, "benchmarks", "peers_native.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_native_llama_and_megalite_compute_transformers_function(tmp_path):
    native = _native()
    hf, converted = str(tmp_path / "hf"), str(tmp_path / "megalite")
    # GQA (6 heads, 3 groups), FFN not 4h, vocab 256 (a multiple of 128: megalite pads nothing), untied
    native.save_initial(hf, 48, 2, 6, 3, 100, 256, 24, seed=3)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        reference = theirs(tokens).logits
        mine = native.load_model(hf).eval()(tokens)
    assert _rel(mine, reference) <= 1e-5, f"peers_native vs transformers: {_rel(mine, reference):.2e}"

    rc, _, err = convert("--loader", "hf", "--saver", "megalite", "--load-dir", hf, "--save-dir", converted)
    assert rc == 0, err
    ours = megalite_logits(converted, tokens)
    assert _rel(ours, reference) <= 1e-5, f"megalite vs transformers: {_rel(ours, reference):.2e}"


def test_pipeline_stages_chain_to_the_whole_model(tmp_path):
    """The native PP split: stage 0's hidden states through stage 1 give the whole model's logits."""
    native = _native()
    native.save_initial(str(tmp_path), 32, 4, 4, 2, 64, 128, 16, seed=5)
    model = native.load_model(str(tmp_path)).eval()
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    first, last = native.pipeline_stage(model, 0, 2), native.pipeline_stage(model, 1, 2)
    assert len(first.model.layers) == len(last.model.layers) == 2 and first.lm_head is None
    with torch.no_grad():
        assert torch.equal(last(first(tokens)), model(tokens))
