"""The user flow "continue training a Hugging Face model", end to end on one process:
a tiny random LlamaForCausalLM (save_pretrained) -> tools/convert_checkpoint.py --loader hf
--saver megalite -> `python pretrain_gpt.py --load <converted> --finetune --use-checkpoint-args`
with training flags only (no model sizes: they come from the checkpoint) -> --loader megalite
--saver hf -> transformers' AutoModelForCausalLM.from_pretrained.
"""

import os
import sys

import pytest
import torch

from cli_batch import convert, run_case
from megalite.checkpoint.convert import Reader, find_checkpoint
from megalite.checkpoint.hf import Llama
from test_checkpoint_hf import hf_logits, megalite_logits, tensors

transformers = pytest.importorskip("transformers", reason="the HF flow needs transformers (the [test] extra "
                                   "installs it)")

VOCAB = 100  # not a multiple of 128: megalite pads it in memory, the checkpoint and HF keep 100 rows
TRAINING = ("--micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 1e-2 --lr-decay-style constant "
            "--mock-data --eval-iters 0 --log-interval 1 --num-workers 0 --seed 7").split()


def _tiny_llama(path):
    """Random init; sizes a wrong flag would break (GQA 4 heads / 2 groups, FFN 48 != 4h, untied output)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).float()
    model.save_pretrained(path, safe_serialization=True)


def test_continue_pretraining_a_hf_llama_and_export_it_back(tmp_path, monkeypatch):
    original, converted, trained, exported = (str(tmp_path / n) for n in ("hf", "converted", "trained", "exported"))
    _tiny_llama(original)
    rc, _, err = convert("--loader", "hf", "--saver", "megalite", "--load-dir", original, "--save-dir", converted)
    assert rc == 0, err

    monkeypatch.setenv("WORLD_SIZE", "1")  # run_case sets both for `python pretrain_gpt.py ...`
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.delenv("RANK", raising=False)
    code, err = run_case(1, ["--load", converted, "--finetune", "--use-checkpoint-args", "--save", trained] + TRAINING)
    assert code == 0, err
    path, meta = find_checkpoint(trained)
    assert os.path.basename(path) == "iter_0000003" and meta["model_config"]["ffn_hidden_size"] == 48

    rc, _, err = convert("--loader", "megalite", "--saver", "hf", "--load-dir", trained, "--save-dir", exported)
    assert rc == 0, err
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    model, theirs = hf_logits(exported, tokens)
    assert type(model).__name__ == "LlamaForCausalLM"

    # the weights transformers loaded are the trained megalite weights, bit for bit
    loaded, cfg, saved = model.state_dict(), meta["model_config"], Reader(path)
    rows = Llama.table(cfg)
    assert sorted(loaded) == sorted(hf for hf, *_ in rows)
    for hf_name, name, to_hf, _ in rows:
        assert torch.equal(loaded[hf_name], to_hf(saved.get(name))), hf_name
    # ... and training moved every one of them away from the original model's
    before = tensors(original)
    assert sorted(before) == sorted(loaded)
    unchanged = [k for k in before if torch.equal(before[k], loaded[k])]
    assert not unchanged, f"training left these tensors as they were: {unchanged}"

    # transformers' model computes megalite's function
    ours = megalite_logits(trained, tokens)
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert rel <= 1e-5, f"megalite vs transformers logits: relative difference {rel:.2e}"
