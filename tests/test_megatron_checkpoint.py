"""Megatron-LM torch_dist checkpoints in megalite (megalite/checkpoint/megatron.py), against checkpoints megatron-core
itself writes on CPU ranks (tests/support/megatron_ckpt.py) and the logits its own GPTModel computes from them."""

import os
import pickle
import shutil

import pytest
import torch

pytest.importorskip("megatron.core", reason="Megatron checkpoints are made by megatron-core (the [test] extra)")

import pretrain_gpt  # noqa: E402
from cli_batch import convert  # noqa: E402
from megalite.checkpoint.convert import Reader, find_checkpoint  # noqa: E402
from megalite.checkpoint.storage import CheckpointError  # noqa: E402
from dist_util import run_on_ranks  # noqa: E402
from megalite import parallel_state as ps  # noqa: E402
from megalite.cli.parser import parse_args  # noqa: E402
from megalite.training import pretrain  # noqa: E402
from megatron_ckpt import KINDS, loaded_all, logits_all, megatron_args, save_all, train_save_continue  # noqa: E402
from parity import BASE, learnable_datasets  # noqa: E402
from test_checkpoint import _Payload  # noqa: E402
from test_checkpoint_hf import megalite_logits  # noqa: E402

SAVED = (("llama", 2, 2), ("gpt2", 2, 2), ("llama", 1, 1), ("moe", 1, 2), ("mla", 2, 2))  # (kind, TP, PP) Megatron
# saved at (MoE: its experts over 2 expert-parallel ranks; MLA with yarn rotary and normed latents: megatron_ckpt.py)
TP2PP2 = ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """{(kind, tp, pp): Megatron --save directory}, and megatron-core's logits of the same tokens from each."""
    base = tmp_path_factory.mktemp("megatron")
    roots = {s: str(base / f"{s[0]}_tp{s[1]}pp{s[2]}") for s in SAVED}
    # and each kind at TP2 x PP2 once more, stepped by megatron-core's distributed optimizer (buckets of 3000
    # elements: each stage's parameters span several) and saved with its state in Megatron-LM's default layout
    roots.update({(k, "optim"): str(base / f"{k}_tp2pp2_dp_reshardable") for k in ("llama", "gpt2")})
    optim = [(None, k, 2, 2, {"dp_reshardable": roots[(k, "optim")]}) for k in ("llama", "gpt2")]
    # and the MoE model at PP2 with its experts over 2 EP ranks: megatron-core chains a dense and an expert optimizer
    roots[("moe", "optim")] = str(base / "moe_pp2_ep2_dp_reshardable")
    optim.append((None, "moe", 1, 2, {"dp_reshardable": roots[("moe", "optim")]}))
    run_on_ranks(save_all, 4, [(roots[s], *s) for s in SAVED] + optim, timeout=300, backend="gloo")
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (2, 16))
    ref = run_on_ranks(logits_all, 1, [(roots[s], s[0]) for s in SAVED], tokens, backend="gloo")[0]
    return base, roots, tokens, dict(zip(SAVED, ref))


@pytest.mark.parametrize("saved", SAVED, ids=lambda s: f"{s[0]}-tp{s[1]}pp{s[2]}")
def test_megatron_checkpoint_converts_to_megatrons_own_logits(megatron, saved):
    """Megatron's save at its TP x PP, converted to megalite at TP1 and TP2 x PP2: megalite's model computes the
    logits megatron-core's own GPTModel computes from the same directory (fp32; the same sums in another order)."""
    base, roots, tokens, ref = megatron
    for name, layout in (("tp1", []), ("tp2pp2", TP2PP2)):
        out = str(base / f"converted_{saved[0]}_{saved[1]}{saved[2]}_{name}")
        rc, stdout, err = convert("--loader", "megatron", "--saver", "megalite", "--load-dir", roots[saved],
                                  "--save-dir", out, *layout)
        assert rc == 0, err
        assert "iteration 5 (40 samples consumed)" in stdout, stdout
        got = megalite_logits(out, tokens)
        assert (got - ref[saved]).abs().max().item() <= 1e-5 * ref[saved].abs().max().item(), (name, saved)


def test_pretrain_loads_a_megatron_directory_and_continues(megatron, capsys):
    """pretrain_gpt.py --load on Megatron's directory resumes at its iteration and data position (the next samples
    after the 40 consumed), exactly as a run loading the converter's output does (and says, once, that Megatron's
    RNG states saved at TP2 x PP2 are not restored at TP1)."""
    base, roots, _, _ = megatron
    k = KINDS["llama"]
    model = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
             "--num-query-groups", "2", "--ffn-hidden-size", str(k["ffn_hidden_size"]), "--swiglu", "--normalization",
             "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--seq-length", "16", "--max-position-embeddings", "16",
             "--vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-3",
             "--train-iters", "7", "--eval-iters", "0", "--num-workers", "0", "--hidden-dropout", "0",
             "--attention-dropout", "0"]
    converted = str(base / "for_pretrain")
    assert convert("--loader", "megatron", "--saver", "megalite", "--load-dir", roots[("llama", 2, 2)],
                   "--save-dir", converted)[0] == 0
    runs = []
    for load in (roots[("llama", 2, 2)], converted):
        try:
            runs.append(pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                                 parse_args(model + ["--load", load], world_size=1)))
        finally:
            ps.destroy_model_parallel()
    assert len(runs[0]) == 2, f"not resumed at iteration 6: {runs[0]}"  # iterations 6 and 7
    assert runs[0] == runs[1], runs
    out = capsys.readouterr().out
    assert out.count("Megatron-LM's RNG states not restored (saved at TP 2 x PP 2, this run is at TP 1 x PP 1") == 1
    assert "checkpoint RNG states not restored" not in out  # (the converted directory's own line: not said)
    assert not any(n.startswith("megalite-from-megatron-") for n in os.listdir(__import__("tempfile").gettempdir()))


def test_use_checkpoint_args_reads_megatrons_saved_arguments(megatron, capsys):
    """--use-checkpoint-args on Megatron's directory (Megatron's own flag for continuing a run): the model flags
    come from its saved arguments, as --load maps them, so a command line without sizes builds the same model."""
    base, roots, _, _ = megatron
    run = ["--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "7"]
    given = ["--num-layers", "2", "--hidden-size", "64"]  # (replaced, and named)
    args = parse_args(given + run + ["--load", roots[("llama", 2, 2)], "--use-checkpoint-args"], world_size=1)
    k = KINDS["llama"]
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups, args.swiglu,
            args.normalization, args.position_embedding_type, args.ffn_hidden_size) == (
        4, 32, 4, 2, True, "RMSNorm", "rope", k["ffn_hidden_size"]), args
    out = capsys.readouterr().out
    assert "--use-checkpoint-args: model flags from" in out and "--num-layers 2, --hidden-size 64" in out, out


def test_megatron_rng_states_are_restored_where_they_map(megatron):
    """Megatron-LM's per-(PP, TP) RNG item: at the same TP x PP each rank takes its own coordinates' Python, numpy
    and torch CPU streams (CUDA's: on CUDA only, said in one line on a CPU run); at another TP x PP none, one
    line."""
    import random

    import numpy as np

    from megalite.checkpoint.megatron import MegatronCheckpoint
    from megalite.checkpoint.megatron_rng import restore
    from megalite.parallel.grid import Grid
    _, roots, _, _ = megatron

    def streams():
        return random.getstate(), np.random.get_state(), torch.get_rng_state()
    before = streams()
    try:
        for (kind, tp, pp), coords in ((("llama", 2, 2), [(0, 0), (1, 0), (0, 1), (1, 1)]),
                                       (("llama", 1, 1), [(0, 0)])):
            root = roots[(kind, tp, pp)]
            for t, p in coords:
                lines = []
                done = restore(MegatronCheckpoint(root), Grid.of(tp=tp, pp=pp, tp_rank=t, pp_rank=p), False,
                               lines.append)
                want = torch.load(os.path.join(root, f"rng_expected_pp{p}_tp{t}.pt"), weights_only=False)
                got = streams()
                assert done == ["python", "numpy", "torch"] and got[0] == want["python"], (tp, pp, t, p)
                assert all(np.array_equal(a, b) for a, b in zip(got[1], want["numpy"])) and torch.equal(got[2],
                                                                                                    want["torch"])
                assert len(lines) == 1 and "CUDA RNG states" in lines[0] and "do not map to a CPU run" in lines[0]
        random.setstate(before[0])
        np.random.set_state(before[1])
        torch.set_rng_state(before[2])
        lines = []
        assert restore(MegatronCheckpoint(roots[("llama", 2, 2)]), Grid.of(), False, lines.append) == []
        assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(streams()[1],
                                                                                                  before[1]))
        assert lines == ["megalite: Megatron-LM's RNG states not restored (saved at TP 2 x PP 2, this run is at TP 1 "
                         "x PP 1, as Megatron-LM would not either): random streams restart from --seed"]
    finally:
        random.setstate(before[0])
        np.random.set_state(before[1])
        torch.set_rng_state(before[2])


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    """megatron-core trains the GPT-2-style model 2 steps on the parity data with its distributed optimizer (Adam)
    and LR scheduler, saves as Megatron-LM does (its optimizer state in the fully_reshardable layout, and once more
    in Megatron-LM's default dp_reshardable), and trains 3 more steps: (roots, the flags, those 3 losses)."""
    base = tmp_path_factory.mktemp("megatron_run")
    argv = list(BASE) + ["--train-iters", "5"]
    args = parse_args(argv, world_size=1)
    train = learnable_datasets(args.draft(), (40, 0, 0))[0]
    batches = [torch.stack([torch.as_tensor(train[i]["text"]) for i in range(8 * k, 8 * k + 8)]) for k in range(5)]
    opt = dict(lr=args.lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
               adam_eps=args.adam_eps, clip_grad=args.clip_grad)
    roots = {layout: str(base / layout) for layout in ("fully_reshardable", "dp_reshardable")}
    losses = run_on_ranks(train_save_continue, 4, roots, "gpt2", batches, 2, opt, megatron_args("gpt2", 2, 1, 2, 16),
                          2, backend="gloo")[0]
    return roots, argv, losses


@pytest.mark.parametrize("layout", ["fully_reshardable", "dp_reshardable"])
def test_a_megatron_run_continues_in_megalite_as_in_megatron(megatron_run, layout):
    """megalite's --load continues Megatron's save (made at TP2 x DP2, its optimizer state in either layout: the
    flat per-bucket buffers of Megatron-LM's default too) for the 3 steps megatron-core trained after it, on the same
    batches: the same losses (fp32; the same sums in another order)."""
    roots, argv, theirs = megatron_run
    try:
        ours = pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                        parse_args(argv + ["--load", roots[layout], "--make-vocab-size-divisible-by", "128"],
                                   world_size=1))
    finally:
        ps.destroy_model_parallel()
    assert len(ours) == 3, ours
    assert max(abs(a - b) / b for a, b in zip(ours, theirs)) <= 1e-5, (ours, theirs)


def test_megatrons_default_optimizer_layout_reads_at_any_tp_and_pp(megatron, tmp_path, monkeypatch):
    """Megatron-LM's default dp_reshardable layout at TP2 x PP2 with several buckets per stage (the tied embedding
    in a bucket of its own on both stages), and an MoE model's chained dense and expert optimizers at PP2 x EP2:
    every parameter's fp32 main weights (each expert's too), assembled whole, are the weights the checkpoint holds,
    and Adam's moments are each element's own (one step from zero, no clipping: exp_avg_sq / exp_avg^2 =
    (1 - beta2) / (1 - beta1)^2 = 0.1). Read under the wrong parameter order, it is one line; with --no-load-optim
    the weights still convert; the MoE model converts with its optimizer state."""
    from megalite.checkpoint import megatron_buckets
    from megalite.checkpoint.megatron import MegatronCheckpoint
    from megalite.checkpoint.megatron_expert_buckets import read_experts
    _, roots, _, _ = megatron
    for kind in ("llama", "gpt2", "moe"):
        ckpt = MegatronCheckpoint(roots[(kind, "optim")])
        step, got = megatron_buckets.read(ckpt, ["exp_avg", "exp_avg_sq", "param"], KINDS[kind]["swiglu"])
        if kind == "moe":  # (megatron-core's second, chained optimizer: the experts')
            got.update(read_experts(ckpt, megatron_buckets.chains(ckpt)["1"], ["exp_avg", "exp_avg_sq", "param"]))
        weights = [k for k in ckpt.items if hasattr(ckpt.items[k], "chunks") and "optimizer." not in k]
        assert step == 1.0 and sorted(f"optimizer.state.param.{k}" for k in weights) == sorted(
            k for k in got if ".param." in k), (kind, sorted(got))
        for k in weights:
            assert torch.equal(got[f"optimizer.state.param.{k}"], ckpt.tensor(k)), (kind, k)
            m, v = got[f"optimizer.state.exp_avg.{k}"], got[f"optimizer.state.exp_avg_sq.{k}"]
            assert (m != 0).all() and torch.allclose(v / m ** 2, torch.full_like(m, 0.1), rtol=1e-5), (kind, k)
    rc, out, err = convert("--loader", "megatron", "--saver", "megalite", "--load-dir", roots[("moe", "optim")],
                           "--save-dir", str(tmp_path / "moe"))
    assert rc == 0 and "Adam's state" in out, (out, err)
    moe = Reader(find_checkpoint(str(tmp_path / "moe"))[0])
    theirs = got["optimizer.state.exp_avg.decoder.layers.3.mlp.experts.experts.linear_fc2.weight"]
    assert torch.equal(moe.get("optimizer.exp_avg.decoder.layers.3.mlp.experts.local_experts.2.linear_fc2.weight"),
                       theirs[2])
    monkeypatch.setattr(megatron_buckets, "ORDERS",
                        {"transformer_engine": megatron_buckets.ORDERS["transformer_engine"]})
    with pytest.raises(Exception, match="does not follow the parameter order of megatron-core's transformer_engine "
                                        "layer spec"):
        megatron_buckets.read(MegatronCheckpoint(roots[("llama", "optim")]), ["exp_avg"], True)
    rc, out, err = convert("--loader", "megatron", "--saver", "megalite", "--load-dir", roots[("gpt2", "optim")],
                           "--save-dir", str(tmp_path / "out"), "--no-load-optim")
    assert rc == 0 and "(no optimizer state)" in out, (out, err)


def test_the_way_back_megatron_reads_what_megalite_writes(megatron):
    """Megatron -> megalite -> Megatron (--saver megatron): megatron-core loads it at TP1 into the logits of its
    original save, bit for bit, and at TP2 x PP2 into the same shards as the original; megalite -> Megatron ->
    megalite is bit-exact."""
    base, roots, tokens, ref = megatron
    back, specs = {}, []
    for kind, at in (("llama", (2, 2)), ("gpt2", (2, 2)), ("moe", (1, 2)), ("mla", (2, 2))):
        ours, theirs, again = (str(base / f"way_back_{kind}_{n}") for n in ("megalite", "megatron", "megalite_again"))
        assert convert("--loader", "megatron", "--saver", "megalite", "--load-dir", roots[(kind, *at)],
                       "--save-dir", ours, *TP2PP2)[0] == 0
        rc, _, err = convert("--loader", "megalite", "--saver", "megatron", "--load-dir", ours, "--save-dir", theirs)
        assert rc == 0, err
        assert convert("--loader", "megatron", "--saver", "megalite", "--load-dir", theirs, "--save-dir", again)[0] == 0
        a, b = Reader(find_checkpoint(ours)[0]), Reader(find_checkpoint(again)[0])
        assert sorted(a.names()) == sorted(b.names())
        for n in a.names():
            assert torch.equal(a.get(n), b.get(n)), f"{kind}: megalite -> Megatron -> megalite changed {n}"
        back[kind] = theirs
        if kind != "moe":  # (megatron-core's MoE layers at TP2 x PP2: below, its logits)
            specs += [(roots[(kind, *at)], kind, 2, 2), (theirs, kind, 2, 2)]
    got = run_on_ranks(logits_all, 1, [(back[k], k) for k in back], tokens, backend="gloo")[0]
    for k, logits, at in zip(back, got, ((2, 2), (2, 2), (1, 2), (2, 2))):
        assert torch.equal(logits, ref[(k, *at)]), k
    for rank in run_on_ranks(loaded_all, 4, specs, backend="gloo"):
        for original, exported in zip(rank[::2], rank[1::2]):
            assert original.keys() == exported.keys() and original
            for n in original:
                assert torch.equal(original[n], exported[n]), n


@pytest.mark.parametrize("victim", ["common.pt", ".metadata"])
def test_a_megatron_pickle_payload_is_refused(megatron, tmp_path, victim):
    """Megatron's common.pt and DCP's .metadata are pickles: one carrying code is refused in one line, and nothing
    in it runs."""
    _, roots, _, _ = megatron
    d = str(tmp_path / "hostile")
    shutil.copytree(roots[("llama", 1, 1)], d)
    marker = str(tmp_path / "executed")
    target = os.path.join(d, "iter_0000005", victim)
    if victim == "common.pt":
        torch.save({"args": _Payload(marker), "iteration": 5}, target)
    else:
        with open(target, "wb") as f:
            pickle.dump(_Payload(marker), f)
    rc, _, err = convert("--loader", "megatron", "--saver", "megalite", "--load-dir", d, "--save-dir",
                         str(tmp_path / "out"))
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, lines
    assert victim in lines[0] and "open, which a checkpoint does not need; refused" in lines[0], lines
    assert not os.path.exists(marker)


class _Codec:
    def __reduce__(self):
        import codecs
        return codecs.encode, ("payload", "rot13")


def test_numpy_arrays_pass_the_restricted_unpickler_and_nothing_else_does(tmp_path):
    """Megatron's RNG item holds numpy's generator state: numpy arrays are admitted (their bytes through latin-1
    only); an object array's elements, another codec, a payload are refused and run nothing."""
    import numpy as np

    from megalite.checkpoint.safe_pickle import loads
    a = np.arange(7, dtype=np.uint32)
    assert np.array_equal(loads(pickle.dumps(np.random.get_state(), protocol=2), "x")[1], np.random.get_state()[1])
    assert np.array_equal(loads(pickle.dumps(a, protocol=2), "x"), a)
    marker = str(tmp_path / "executed")
    for hostile, why in ((_Codec(), "only latin-1"), (np.array([_Payload(marker)], dtype=object), "refused")):
        with pytest.raises(CheckpointError, match=why):
            loads(pickle.dumps(hostile, protocol=2), "x")
    assert not os.path.exists(marker)


def test_what_megalite_cannot_read_yet_is_one_line(megatron, tmp_path):
    _, roots, _, _ = megatron
    d = str(tmp_path / "moe")
    shutil.copytree(roots[("llama", 1, 1)], d)
    common = os.path.join(d, "iter_0000005", "common.pt")
    state = torch.load(common, weights_only=False)
    state["args"].mtp_num_layers = 1
    torch.save(state, common)
    rc, _, err = convert("--loader", "megatron", "--saver", "megalite", "--load-dir", d, "--save-dir",
                         str(tmp_path / "out"))
    assert rc == 2 and "multi-token prediction layers (--mtp-num-layers) are not read from Megatron's format yet" \
        in err, err
    rc, _, err = convert("--loader", "megatron", "--saver", "megalite", "--load-dir", str(tmp_path), "--save-dir",
                         str(tmp_path / "out"))
    assert rc == 2 and "is not a Megatron-LM torch_dist checkpoint directory" in err, err
