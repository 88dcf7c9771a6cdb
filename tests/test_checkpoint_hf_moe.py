"""tools/convert_checkpoint.py for Mixture-of-Experts models against real `transformers` classes:
MixtralForCausalLM, Qwen2MoeForCausalLM (shared expert + gate, QKV bias) and Qwen3MoeForCausalLM
(q/k norms, a dense layer, pre-softmax routing = norm_topk_prob False). Each is trained first at an
expert-parallel layout (one 4-rank spawn for the three), so its router and experts carry
structure; export and import are checked by logits (<= 1e-4) and by bit-exact round trips, and
the import reads both the per-expert layout transformers writes and the fused one it holds in
memory."""

import json
import os

import pytest
import torch

from cli_batch import convert
from dist_util import run_on_ranks
from megalite.checkpoint.convert import Reader, Writer, find_checkpoint
from megalite.checkpoint.storage import CheckpointError
from test_checkpoint_hf import _tokens, hf_logits, megalite_logits, tensors
import parity

transformers = pytest.importorskip("transformers", reason="the HF conversion tests need transformers (the [test] "
                                   "extra installs it)")
from safetensors.torch import save_file  # noqa: E402

LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
         "--norm-epsilon", "1e-6", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
         "--moe-aux-loss-coeff", "0.01", "--num-layers", "2"]
FLAVOURS = {  # name: (HF class, flags: model + the layout it is trained at on 4 ranks)
    "mixtral": ("MixtralForCausalLM", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                       "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]),
    "qwen2_moe": ("Qwen2MoeForCausalLM", ["--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate",
                                          "--add-qkv-bias", "--expert-model-parallel-size", "4",
                                          "--moe-token-dispatcher-type", "alltoall"]),
    "qwen3_moe": ("Qwen3MoeForCausalLM", ["--qk-layernorm", "--moe-layer-freq", "[0,1]", "--moe-router-pre-softmax",
                                          "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]),
    "deepseek_v3": ("DeepseekV3ForCausalLM", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                              "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                              "alltoall"]),
}
DEEPSEEK = list(parity.DEEPSEEK) + ["--moe-layer-freq", "[0,1]", "--num-layers", "2"]  # the first layer dense
BASES = {"deepseek_v3": DEEPSEEK + ["--mtp-num-layers", "1"]}  # one MTP depth (MoE, as the last layer)


def _train_flavours(dirs):
    from test_checkpoint import _train
    return [_train(BASES.get(f, LLAMA) + FLAVOURS[f][1] + ["--save", d, "--train-iters", "20"])
            for f, d in dirs.items()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf_moe")
    dirs = {f: str(base / f"megalite_{f}") for f in FLAVOURS}
    losses = run_on_ranks(_train_flavours, 4, dirs, timeout=420)[-1]
    for f, lo in zip(FLAVOURS, losses):
        assert lo[0] - lo[-1] > 0.5, f"{f}: the model did not learn ({lo})"
    return base, dirs


def _fused(src, dst):
    """A save_pretrained directory rewritten in transformers 5's in-memory layout: each MoE layer's
    experts as mlp.experts.gate_up_proj [E, 2 ffn, h] and mlp.experts.down_proj [E, h, ffn], the
    Mixtral router as mlp.gate.weight."""
    t, out = tensors(src), {}
    experts = {}
    for k, v in t.items():
        parts = k.split(".")
        if ".experts." in k:  # model.layers.<i>.<block>.experts.<e>.<proj>.weight
            i, e, proj = int(parts[2]), int(parts[5]), parts[6]
            experts.setdefault(i, {}).setdefault(e, {})[proj] = v
        else:
            out[k.replace("block_sparse_moe.gate.", "mlp.gate.")] = v
    for i, per in experts.items():
        es = [per[e] for e in sorted(per)]
        gate, up, down = (("w1", "w3", "w2") if "w1" in es[0] else ("gate_proj", "up_proj", "down_proj"))
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([x[gate], x[up]]) for x in es])
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([x[down] for x in es])
    os.makedirs(dst)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_moe_hf_export_import_and_round_trips(trained, flavour):
    base, dirs = trained
    src, tokens = dirs[flavour], _tokens()
    hf_dir, saved, back, again, fused, back_fused = (str(base / f"{flavour}_{n}") for n in (
        "hf", "saved", "back", "again", "fused", "back_fused"))
    rc, _, err = convert("--loader", "megalite", "--saver", "hf", "--load-dir", src, "--save-dir", hf_dir)
    assert rc == 0, err
    model, ref = hf_logits(hf_dir, tokens)
    assert type(model).__name__ == FLAVOURS[flavour][0]
    ours = megalite_logits(src, tokens)
    assert (ours - ref).abs().max().item() <= 1e-4, "export: megalite vs transformers logits"
    # the routed experts matter: without their output the logits move by over 10x that tolerance
    with torch.no_grad():
        for layer in model.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None:
                experts.down_proj.zero_()
        off = model(tokens).logits
    assert (off - ref).abs().max().item() > 1e-3

    # import what transformers itself writes (per-expert tensors), at TP2 x PP2, and compare
    model, ref = hf_logits(hf_dir, tokens)
    model.save_pretrained(saved, safe_serialization=True)
    rc, _, err = convert("--loader", "hf", "--saver", "megalite", "--load-dir", saved, "--save-dir", back,
                         "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2")
    assert rc == 0, err
    assert (megalite_logits(back, tokens) - ref).abs().max().item() <= 1e-4, "import: megalite vs transformers"
    # the fused layout imports to the same tensors, bit for bit
    _fused(saved, fused)
    assert convert("--loader", "hf", "--saver", "megalite", "--load-dir", fused, "--save-dir", back_fused)[0] == 0
    a, b = Reader(find_checkpoint(back)[0]), Reader(find_checkpoint(back_fused)[0])
    assert sorted(a.names()) == sorted(b.names())
    for n in a.names():
        assert torch.equal(a.get(n), b.get(n)), f"fused import differs at {n}"
    if flavour == "deepseek_v3":  # our export holds the MTP depth as DeepSeek's layer 2; it comes back bit for bit
        with open(os.path.join(hf_dir, "config.json")) as f:
            assert json.load(f)["num_nextn_predict_layers"] == 1
        assert "model.layers.2.eh_proj.weight" in tensors(hf_dir)  # (transformers loaded the model without it)
        rc, out, err = convert("--loader", "hf", "--saver", "megalite", "--load-dir", hf_dir, "--save-dir",
                               str(base / "deepseek_mtp_back"))
        assert rc == 0, err
        mtp_back = Reader(find_checkpoint(str(base / "deepseek_mtp_back"))[0])
        orig = Reader(find_checkpoint(src)[0])
        names = [n for n in orig.names() if not n.startswith("optimizer.")]
        assert any(n.startswith("mtp.layers.0.transformer_layer.mlp.experts") for n in names)
        assert sorted(names) == sorted(mtp_back.names())
        for n in names:
            assert torch.equal(orig.get(n), mtp_back.get(n)), f"MTP round trip changed {n}"
        # transformers' own save holds no MTP weights (whatever num_nextn_predict_layers says): imported without
        assert "imported without MTP" in convert("--loader", "hf", "--saver", "megalite", "--load-dir", saved,
                                                 "--save-dir", str(base / "deepseek_no_mtp"))[1]
    # HF -> megalite -> HF: every tensor bit for bit
    assert convert("--loader", "megalite", "--saver", "hf", "--load-dir", back, "--save-dir", again)[0] == 0
    x, y = tensors(saved), tensors(again)
    assert sorted(x) == sorted(y)
    for k in x:
        assert torch.equal(x[k], y[k]), f"HF round trip changed {k}"
    # megalite -> HF -> megalite: every model tensor bit for bit (experts by global index)
    orig = Reader(find_checkpoint(src)[0])
    model_names = [n for n in orig.names() if not n.startswith(("optimizer.", "mtp."))]  # (MTP: above)
    assert any(".local_experts.3." in n for n in model_names)
    assert sorted(model_names) == sorted(a.names())
    for n in model_names:
        assert torch.equal(orig.get(n), a.get(n)), f"megalite round trip changed {n}"


def _edit_config(root, **changes):
    path, meta = find_checkpoint(root)
    meta["model_config"].update(changes)
    with open(os.path.join(path, "megalite.json"), "w") as f:
        json.dump(meta, f)


def _export_refuses(src, cases, tmp_path):
    """Each (config changes, message): the export stops with that one line; the config is put back. Returns it."""
    _, meta = find_checkpoint(src)
    original = dict(meta["model_config"])
    try:
        for i, (changes, message) in enumerate(cases):
            _edit_config(src, **changes)
            rc, _, err = convert("--loader", "megalite", "--saver", "hf", "--load-dir", src,
                                 "--save-dir", str(tmp_path / f"x{i}"))
            assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, (changes, err)
            _edit_config(src, **original)
    finally:
        _edit_config(src, **original)
    return original


def test_moe_converter_refuses_what_hf_cannot_represent(trained, tmp_path):
    base, dirs = trained
    src = dirs["mixtral"]
    cases = [(dict(moe_router_score_function="sigmoid"), "moe_router_score_function='sigmoid'"),
             (dict(moe_layer_freq=[0, 1]), "every layer MoE"),
             (dict(moe_router_pre_softmax=True), "moe_router_pre_softmax=True"),
             (dict(moe_router_topk_scaling_factor=2.0), "moe_router_topk_scaling_factor=2.0"),
             (dict(mtp_num_layers=1), "MixtralForCausalLM cannot hold the 1 multi-token prediction layers")]
    original = _export_refuses(src, cases, tmp_path)
    # the expert FFN size must divide over the target TP too
    cfg = dict(original, moe_ffn_hidden_size=45)
    with pytest.raises(CheckpointError, match=rf"FFN sizes \({original['ffn_hidden_size']}, 45\)"):
        Writer(str(tmp_path / "w"), "release", cfg, 2, 1)


def test_deepseek_converter_refuses_what_hf_cannot_represent(trained, tmp_path):
    base, dirs = trained
    src = dirs["deepseek_v3"]
    cases = [(dict(moe_layer_freq=[1, 0]), "first_k_dense_replace"),
             (dict(moe_shared_expert_gate=True), "moe_shared_expert_gate=True"),
             (dict(moe_router_score_function="softmax"), "moe_router_score_function='softmax'"),
             (dict(moe_shared_expert_intermediate_size=36), "not a multiple of --moe-ffn-hidden-size 24"),
             (dict(position_embedding_type="learned_absolute"), "no learned positions")]
    _export_refuses(src, cases, tmp_path)
