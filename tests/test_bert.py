"""BERT: every parallel layout trains like one process (tests/support/parity.py); the dataset's masking
statistics over 10,000 samples; HF BertForPreTraining conversion both ways.

One 4-rank spawn runs TP2xDP2, PP2xDP2 interleaved (2 chunks per stage, each reading the batch
for its padding mask), TP2xPP2+SP (post-norm, 1F1B) and TP2xPP2+SP pre-norm on
learnable BERT data (bigram chains split into two segments, swapped half the time, masked as the
real dataset masks); the third layout saves its checkpoint, which the HF tests convert (nothing
is downloaded)."""

import json
import os

import numpy as np
import pytest
import torch

import kernels
from cli_batch import convert, tool
from dist_util import rel_err
from megalite import parallel_state as ps
from megalite.checkpoint.convert import Reader, find_checkpoint
from megalite.checkpoint.manager import load_weights
from megalite.config import ModelConfig
from megalite.data.bert_dataset import build_bert_datasets, mask_tokens
from megalite.models import BertModel
from megalite.tensor_parallel import model_parallel_manual_seed
from parity import ALPHABET, VOCAB, BigramChainDataset, layout, reference, run_layouts
from parity_check import assert_parity, worst
from test_checkpoint_hf import tensors

transformers = pytest.importorskip("transformers", reason="the BERT HF tests need transformers (the [test] extra "
                                   "installs it)")

CLS, SEP, MASK, PAD = VOCAB - 4, VOCAB - 3, VOCAB - 2, VOCAB - 1
SPECIALS = np.array([CLS, SEP, MASK, PAD])


class BigramBertDataset(BigramChainDataset):  # (its size, seed and bijection)
    """Sample i: a bigram chain (parity.py's rule) of 9-13 tokens cut into A and B, swapped with
    probability 0.5 (is_random), `[CLS] A [SEP] B [SEP]`, padded to seq_length, masked by the
    dataset's own mask_tokens."""

    def __getitem__(self, i):
        rng = np.random.RandomState((self.seed + i) % 2 ** 32)
        n = rng.randint(self.seq - 7, self.seq - 2)
        chain = [rng.randint(ALPHABET)]
        for _ in range(n - 1):
            chain.append(self.perm[chain[-1]])
        cut = rng.randint(1, n)
        a, b, swap = chain[:cut], chain[cut:], rng.random_sample() < 0.5
        if swap:
            a, b = b, a
        tokens = np.array([CLS, *a, SEP, *b, SEP], dtype=np.int64)
        text, labels = mask_tokens(tokens, rng, SPECIALS, MASK, np.arange(ALPHABET))
        out = {k: np.full(self.seq, v, np.int64) for k, v in (("text", PAD), ("types", 0), ("labels", -1),
                                                                ("loss_mask", 0), ("padding_mask", 0))}
        m = len(tokens)
        out["text"][:m], out["labels"][:m], out["padding_mask"][:m] = text, labels, 1
        out["types"][len(a) + 2:m], out["loss_mask"][:m] = 1, labels >= 0
        out["is_random"] = np.int64(swap)
        return out


def bigram_bert_datasets(args, num_samples):
    return BigramBertDataset(num_samples[0], args.seq_length, args.seed), None, None


# Weights at std 0.2 (not 0.02): attention then matters to the logits, so a wrong q/k/v mapping in
# the HF tests moves them by ~3e-2 (measured with query and key swapped; at 0.02 only 1.2e-5,
# under the 1e-4 bound). The reference still learns: lm loss 5.48 -> 4.35 over the 6 steps.
BERT_MODEL = ("--init-method-std", "0.2")


def bert_layout(name, model=(), **kw):
    return layout(name, entry="pretrain_bert", datasets=bigram_bert_datasets, model=BERT_MODEL + tuple(model), **kw)


@pytest.fixture(scope="module")
def bert_runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("bert") / "ckpt")
    lays = [bert_layout("bert_tp2_dp2", tp=2, dp=2), bert_layout("bert_pp2_dp2_interleaved", pp=2, dp=2, vp=1),
            bert_layout("bert_tp2_pp2_sp", tp=2, pp=2, sp=True, flags=("--save", ckpt)),
            bert_layout("bert_tp2_pp2_sp_pre_norm", tp=2, pp=2, sp=True,
                        model=("--layernorm-position", "pre", "--init-method-std", "0.02")),
            # context parallel: padded keys, non-causal ring (p2p) and all-to-all (a2a) attention
            bert_layout("bert_cp2_dp2_p2p", cp=2, dp=2),
            bert_layout("bert_cp2_tp2_sp_a2a", cp=2, tp=2, sp=True, cp_comm="a2a"),
            # unequal data-parallel shares: MLM and SOP losses over the global micro-batch count
            bert_layout("bert_tp2_dp2_shares_3_1", tp=2, dp=2, flags=("--data-parallel-shares", "3,1")),
            # ZeRO-3: the tied MLM output layer (its own bias + the embedding's bucket), pooler and SOP
            # head as units; at PP2 the last stage's tied copy
            bert_layout("bert_tp2_dp2_zero3", tp=2, dp=2, zero=3),
            bert_layout("bert_pp2_dp2_zero3", pp=2, dp=2, zero=3)]
    return lays, run_layouts(lays, 4), ckpt


@pytest.mark.parametrize("i", range(9), ids=["tp2_dp2", "pp2_dp2_interleaved", "tp2_pp2_sp", "tp2_pp2_sp_pre_norm",
                                             "cp2_dp2_p2p", "cp2_tp2_sp_a2a", "tp2_dp2_shares_3_1", "tp2_dp2_zero3",
                                             "pp2_dp2_zero3"])
def test_bert_layouts_match_single_process(bert_runs, i):
    """Losses over the steps, every step-1 gradient before clipping (MLM head, tied embedding on
    both stages, pooler and SOP head included), grad norms and parameters at rel <= 1e-5; under
    CP the MLM loss over every CP rank's masked tokens and the SOP loss from [CLS] on CP rank 0."""
    lays, results, _ = bert_runs
    print(lays[i].name, {k: f"{v:.1e}" for k, v in worst(lays[i], results[i], reference(lays[i])).items()})
    assert_parity(lays[i], results[i])


# -- the dataset ----------------------------------------------------------------------------
WORDS = ("the a cat dog runs sees big small red blue house tree river stone bird sings under over near far "
         "quick slow green old new light dark warm cold high low").split()


def _preprocess(tmp_path):
    """Sentence-split documents through tools/preprocess_data.py (--split-sentences, a WordPiece
    --vocab-file), in process."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + WORDS) + "\n")
    rng = np.random.default_rng(0)
    docs = [" ".join(" ".join(rng.choice(WORDS, rng.integers(3, 12))).capitalize() + "."
                     for _ in range(rng.integers(1, 12))) for _ in range(300)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tool("preprocess_data").main(["--input", str(src), "--output-prefix", str(tmp_path / "corpus"), "--tokenizer-type",
               "BertWordPieceLowerCase", "--vocab-file", str(vocab), "--split-sentences", "--log-interval", "0"])
    from megalite.data import build_tokenizer
    return str(tmp_path / "corpus_text_sentence"), build_tokenizer("BertWordPieceLowerCase", str(vocab))


def test_bert_masking_statistics_and_determinism(tmp_path):
    prefix, tok = _preprocess(tmp_path)
    cache = str(tmp_path / "cache")
    train = build_bert_datasets([prefix], "1,0,0", 48, 1234, (10_000, 0, 0), cache, tok)[0]
    assert len(train) >= 10_000 and any(f.endswith("samples_mapping.npy") for f in os.listdir(cache))
    s = [train[i] for i in range(10_000)]
    text, labels = np.stack([x["text"] for x in s]), np.stack([x["labels"] for x in s])
    real = np.stack([x["padding_mask"] for x in s]) == 1
    original = np.where(labels >= 0, labels, text)
    specials = np.isin(original, [tok.cls, tok.sep, tok.pad, tok.mask])
    chosen = labels >= 0
    assert not (chosen & specials).any(), "a special token was chosen for MLM"
    assert (text[real & specials] == original[real & specials]).all() and (text[~real] == tok.pad).all()
    frac = chosen.sum() / (real & ~specials).sum()
    as_mask = (text[chosen] == tok.mask).mean()
    kept = (text[chosen] == labels[chosen]).mean()
    assert abs(frac - 0.15) <= 0.005, f"{frac:.4f} of the tokens chosen"
    assert abs(as_mask - 0.8) <= 0.01 and abs(kept - 0.1) <= 0.01 and abs(1 - as_mask - kept - 0.1) <= 0.01, \
        (as_mask, kept)
    sop = np.mean([x["is_random"] for x in s])
    print(f"chosen {frac:.4f} of non-special tokens; of those [MASK] {as_mask:.4f}, kept {kept:.4f}, random "
          f"{1 - as_mask - kept:.4f}; swapped (SOP) {sop:.4f}")
    assert abs(sop - 0.5) <= 0.02, f"sentence-order labels unbalanced: {sop:.3f} swapped"
    # [CLS] A [SEP] B [SEP]: types 0 up to the first [SEP], 1 after it
    first = s[0]
    seps = np.flatnonzero(first["text"] == tok.sep)
    assert first["text"][0] == tok.cls and len(seps) == 2 and first["types"][seps[0]] == 0 \
        and first["types"][seps[0] + 1] == 1
    # deterministic per (index, seed): a second reader loads the cached mapping and agrees;
    # another seed gives other samples
    again = build_bert_datasets([prefix], "1,0,0", 48, 1234, (10_000, 0, 0), cache, tok, is_builder=False)[0]
    other = build_bert_datasets([prefix], "1,0,0", 48, 99, (10_000, 0, 0), cache, tok)[0]
    for i in (0, 17, 9_999):
        assert all(np.array_equal(s[i][k], again[i][k]) for k in s[i])
    assert not all(np.array_equal(s[i]["text"], other[i]["text"]) for i in range(20))


# -- Hugging Face ---------------------------------------------------------------------------
def _batch():
    ds = BigramBertDataset(4, 16, seed=1234)
    return {k: torch.stack([torch.as_tensor(ds[i][k]) for i in range(4)]) for k in ds[0]}


def megalite_logits(root, b):
    _, meta = find_checkpoint(root)
    cfg = dict(meta["model_config"])
    cfg["params_dtype"] = getattr(torch, cfg["params_dtype"])
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    try:
        model = BertModel(ModelConfig(**cfg))
        load_weights([model], root)
        model.eval()
        with torch.no_grad():
            lm, sop = model(b["text"], b["padding_mask"], b["types"])
        return lm[..., :cfg["vocab_size"]], sop
    finally:
        ps.destroy_model_parallel()


def hf_logits(path, b):
    model = transformers.BertForPreTraining.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=b["text"], attention_mask=b["padding_mask"], token_type_ids=b["types"])
    return model, out.prediction_logits, out.seq_relationship_logits


def _close(ours, theirs, what):
    for a, b, name in zip(ours, theirs, ("MLM", "SOP")):
        assert (a - b).abs().max().item() <= 1e-4, f"{what}: {name} logits differ by {(a - b).abs().max().item()}"


def test_bert_hf_export_import_and_round_trips(bert_runs, tmp_path):
    _, results, src = bert_runs
    b = _batch()
    hf_dir, saved, back, again = (str(tmp_path / n) for n in ("hf", "saved", "back", "again"))
    rc, _, err = convert("--model-type", "bert", "--loader", "megalite", "--saver", "hf", "--load-dir", src,
                         "--save-dir", hf_dir)
    assert rc == 0, err
    model, lm, sop = hf_logits(hf_dir, b)
    assert type(model).__name__ == "BertForPreTraining"
    _close(megalite_logits(src, b), (lm, sop), "export")
    # the exported model is the trained one: its MLM loss at the masked positions is well below
    # the loss training started from
    chosen = b["labels"] >= 0
    loss = torch.nn.functional.cross_entropy(lm[chosen], b["labels"][chosen]).item()
    start = results[2][-1]["losses"][0]
    print(f"HF MLM loss on the masked positions {loss:.3f} (step-1 training loss {start:.3f})")
    assert loss < start - 0.5, (loss, start)
    # import what transformers itself writes, at TP2 x PP2
    model.save_pretrained(saved, safe_serialization=True)
    rc, _, err = convert("--loader", "hf", "--saver", "megalite", "--load-dir", saved, "--save-dir", back,
                         "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2")
    assert rc == 0, err
    _close(megalite_logits(back, b), (lm, sop), "import")
    assert convert("--loader", "megalite", "--saver", "hf", "--load-dir", back, "--save-dir", again)[0] == 0
    x, y = tensors(saved), tensors(again)
    assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x), "HF -> megalite -> HF changed"
    orig, imported = Reader(find_checkpoint(src)[0]), Reader(find_checkpoint(back)[0])
    names = [n for n in orig.names() if not n.startswith("optimizer.")]
    assert sorted(names) == sorted(imported.names())
    for n in names:
        assert torch.equal(orig.get(n), imported.get(n)), f"megalite -> HF -> megalite changed {n}"
    # a GPT conversion of a BERT checkpoint is refused in one line
    rc, _, err = convert("--model-type", "gpt", "--loader", "megalite", "--saver", "hf", "--load-dir", src,
                         "--save-dir", str(tmp_path / "gpt"))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "BERT" in err


def test_log_line_shows_every_reported_loss(capsys):
    """The loop averages every key the loss function reports; Megatron's line shows them all."""
    from megalite.cli.parser import parse_args
    from megalite.training.step import mean_losses
    from megalite.config.logging import LoggingConfig
    from megalite.logger import MetricsLogger
    from pretrain_bert import ARGS_DEFAULTS
    ps.initialize_model_parallel(1, 1)
    try:
        reported = [{"lm loss": torch.tensor(2.0), "sop loss": torch.tensor(0.5)},
                    {"lm loss": torch.tensor(4.0), "sop loss": torch.tensor(0.7)}]
        lm, means = mean_losses(reported, grid=ps.current_grid())
        assert lm == 3.0 and {k: float(v) for k, v in means.items()} == pytest.approx({"lm loss": 3.0, "sop loss": 0.6})
        fields = {"consumed": 20, "elapsed": 0.1, "tflops": 0.0, "lr": 1e-3, "loss_scale": 1.0, "grad_norm": 1.0,
                  "skipped": 0, "timers": None, "losses": {k: float(v) for k, v in means.items()}}
        argv = ("--train-iters 10 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
                "--micro-batch-size 1 --lr 1e-3").split()
        MetricsLogger(LoggingConfig.of(parse_args(argv, 1, defaults=ARGS_DEFAULTS))).iteration(5, fields)
    finally:
        ps.destroy_model_parallel()
    assert "| lm loss: 3.000000E+00 | sop loss: 6.000000E-01 | loss scale: 1.0 |" in capsys.readouterr().out


def _bert_on_backend(backend):
    from model_util import full_grads
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(3)
    try:
        cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=VOCAB,
                          make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0, seed=7,
                          model_type="bert", layernorm_position="post", gelu="exact", num_tokentypes=2)
        model, b = BertModel(cfg), _batch()
        with kernels.use_backend(backend):
            lm, sop = model(b["text"], b["padding_mask"], b["types"], b["labels"], b["loss_mask"])
            (lm.mean() + sop.float().square().mean()).backward()
        return torch.cat([lm.detach(), sop.detach().reshape(-1)]), full_grads(model, VOCAB)
    finally:
        ps.destroy_model_parallel()


def test_triton_path_with_padding_matches_torch_path():
    """BERT's GPU path in the Triton interpreter: flash attention with the key-padding mask,
    the norm kernels and the vocab-parallel CE on the masked positions; loss and every grad."""
    ref_out, ref = _bert_on_backend("torch")
    out, grads = _bert_on_backend("triton")
    errs = {"outputs": rel_err(out, ref_out), **{k: rel_err(grads[k], ref[k]) for k in ref}}
    bad = {k: v for k, v in errs.items() if not v <= 1e-5}
    assert not bad and len(errs) > 20, bad
