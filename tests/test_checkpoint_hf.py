"""tools/convert_checkpoint.py: Hugging Face export/import against real `transformers` models,
bit-exact round trips, and offline resharding.

Models are trained first (TP2 x PP2, on the parity harness's learnable data), so their
logits carry structure a wrong mapping would break; nothing is downloaded.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from cli_batch import convert  # in process; test_converter_refuses_what_it_cannot_represent also runs the program
from dist_util import run_on_ranks
from megalite import parallel_state as ps
from megalite.checkpoint.convert import Reader, find_checkpoint
from megalite.checkpoint.manager import config_for_one_process, load_weights
from megalite.models import GPTModel
from megalite.tensor_parallel import model_parallel_manual_seed
from parity import VOCAB, BigramChainDataset

transformers = pytest.importorskip("transformers", reason="the HF conversion tests need transformers (the [test] "
                                   "extra installs it)")
from safetensors import safe_open  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAVOURS = {
    "gpt2": [],
    "llama": ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
              "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
              "--norm-epsilon", "1e-6"],
}
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def _train_flavours(dirs):
    from test_checkpoint import _train
    return [_train(TP2PP2 + FLAVOURS[f] + ["--save", d, "--train-iters", "20"]) for f, d in dirs.items()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    dirs = {f: str(base / f"megalite_{f}") for f in FLAVOURS}
    losses = run_on_ranks(_train_flavours, 4, dirs, timeout=420)[-1]
    for f, lo in zip(FLAVOURS, losses):
        assert lo[0] - lo[-1] > 0.5, f"{f}: the model did not learn ({lo})"
    return base, dirs


def _tokens():
    ds = BigramChainDataset(4, 16, seed=1234)  # the chain the models were trained on (BASE --seed)
    return torch.stack([torch.as_tensor(ds[i]["text"][:16]) for i in range(4)])


def megalite_logits(root, tokens):
    """The checkpoint's model on one process (TP=PP=1, whatever it was saved at)."""
    _, meta = find_checkpoint(root)
    config = config_for_one_process(meta["model_config"])
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    try:
        model = GPTModel(config)
        load_weights([model], root)
        model.eval()
        with torch.no_grad():
            return model(tokens)[..., :config.vocab_size]
    finally:
        ps.destroy_model_parallel()


def hf_logits(path, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model, model(tokens).logits


def tensors(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_hf_export_import_and_round_trips(trained, flavour):
    base, dirs = trained
    src, tokens = dirs[flavour], _tokens()
    hf_dir, saved, back, again = (str(base / f"{flavour}_{n}") for n in ("hf", "saved", "back", "again"))
    assert convert("--loader", "megalite", "--saver", "hf", "--load-dir", src, "--save-dir", hf_dir)[0] == 0
    model, ref = hf_logits(hf_dir, tokens)
    expect = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[flavour]
    assert type(model).__name__ == expect
    ours = megalite_logits(src, tokens)
    assert (ours - ref).abs().max().item() <= 1e-4, "export: megalite vs transformers logits"
    # the model learned the chain: its next-token loss is well below a uniform guess, ln(V)
    loss = torch.nn.functional.cross_entropy(ref[:, :-1].reshape(-1, ref.shape[-1]), tokens[:, 1:].reshape(-1))
    assert loss.item() < math.log(VOCAB) - 0.8, loss.item()

    # import what transformers itself writes, at TP2 x PP2, and compare the same way
    model.save_pretrained(saved, safe_serialization=True)
    rc, _, err = convert("--loader", "hf", "--saver", "megalite", "--load-dir", saved, "--save-dir", back,
                         "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2")
    assert rc == 0, err
    assert (megalite_logits(back, tokens) - ref).abs().max().item() <= 1e-4, "import: megalite vs transformers"
    # HF -> megalite -> HF: every tensor bit for bit
    assert convert("--loader", "megalite", "--saver", "hf", "--load-dir", back, "--save-dir", again)[0] == 0
    a, b = tensors(saved), tensors(again)
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), f"HF round trip changed {k}"
    # megalite -> HF -> megalite: every model tensor bit for bit
    orig, imported = Reader(find_checkpoint(src)[0]), Reader(find_checkpoint(back)[0])
    model_names = [n for n in orig.names() if not n.startswith("optimizer.")]
    assert sorted(model_names) == sorted(imported.names())
    for n in model_names:
        assert torch.equal(orig.get(n), imported.get(n)), f"megalite round trip changed {n}"


def test_reshard_keeps_every_tensor_and_lays_out_target_ranks(trained):
    base, dirs = trained
    src, dst = dirs["gpt2"], str(base / "gpt2_tp4")
    rc, _, err = convert("--loader", "megalite", "--saver", "megalite", "--load-dir", src, "--save-dir", dst,
                         "--target-tensor-parallel-size", "4", "--target-pipeline-parallel-size", "1")
    assert rc == 0, err
    a, b = Reader(find_checkpoint(src)[0]), Reader(find_checkpoint(dst)[0])
    assert sorted(a.names()) == sorted(b.names()) and any(n.startswith("optimizer.exp_avg.") for n in a.names())
    for n in a.names():
        assert torch.equal(a.get(n), b.get(n)), n
    qkv = b.index["decoder.layers.0.self_attention.linear_qkv.weight"]["chunks"]
    assert sorted(c["offsets"][0] for c in qkv) == [0, 24, 48, 72]  # 3 x 32 rows in 4 shards
    with open(os.path.join(find_checkpoint(dst)[0], "megalite.json")) as f:
        assert json.load(f)["parallel"]["tensor_model_parallel_size"] == 4


def test_converter_refuses_what_it_cannot_represent(trained, tmp_path):
    base, dirs = trained
    rc, _, err = convert("--loader", "megalite", "--saver", "megalite", "--load-dir", dirs["gpt2"],
                         "--save-dir", str(tmp_path / "x"), "--target-tensor-parallel-size", "3")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "does not divide the heads" in err
    rc, _, err = convert("--loader", "megalite", "--saver", "hf", "--load-dir", str(tmp_path),
                         "--save-dir", str(tmp_path / "y"))
    assert rc == 2 and "latest_checkpointed_iteration.txt" in err
    # a GPT-2-shaped checkpoint without biases has no GPT2LMHeadModel equivalent
    path, meta = find_checkpoint(dirs["gpt2"])
    meta["model_config"]["add_bias_linear"] = False
    with open(os.path.join(path, "megalite.json"), "w") as f:
        json.dump(meta, f)
    rc, _, err = convert("--loader", "megalite", "--saver", "hf", "--load-dir", dirs["gpt2"],
                         "--save-dir", str(tmp_path / "z"))
    assert rc == 2 and "add_bias_linear=False" in err and len(err.strip().splitlines()) == 1
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "--help"],
                       capture_output=True, text=True, timeout=120)  # the script as a program
    rc, out = r.returncode, r.stdout
    assert rc == 0, r.stderr
    for flag in ("--loader", "--saver", "--load-dir", "--save-dir", "--target-tensor-parallel-size",
                 "--target-pipeline-parallel-size", "--model-type"):
        assert flag in out
