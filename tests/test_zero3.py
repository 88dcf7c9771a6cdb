"""ZeRO-3 (parameters sharded too, gathered unit by unit with prefetch) through pretrain().

One spawn of 4 CPU ranks runs every check: parity layouts against the single process
(tests/support/parity.py: losses, every gradient before clipping, parameters after 6 steps, at
DESIGN's fp32 bound 1e-5, bf16 at its own), the unit schedule's counters, faults that the
checks must catch, and a checkpoint saved at ZeRO-3 DP4 re-saved at other layouts.
ZeRO-3 against ZeRO-2 at the same DP (bit-exact where the arithmetic is): test_distributed_optimizer.py.
"""

import os

import pytest
import torch

import pretrain_gpt
from cli_batch import convert
from dist_util import start_on_ranks
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.checkpoint.convert import Reader, find_checkpoint
from megalite.distributed.param_units import ParamUnits
from megalite.distributed.sharded_bucket import ShardedBucket
from megalite.training import pretrain
from parity import BASE, EIGHT_LAYERS, LLAMA, MB2, layout, learnable_datasets, patched, reference, train
from parity_check import assert_parity, mismatches

Z3 = ("--use-distributed-optimizer", "--zero-stage", "3")


# -- faults (module level: applied inside the spawned ranks) -----------------------------------
def no_regather_before_backward():
    return patched(ParamUnits, "_pre_backward", lambda self, u, grad: None)


def reduce_scatter_without_mean():
    original = ShardedBucket.start

    def start(self):
        divisor, self.divisor = self.divisor, (1 if self.stage == 3 else self.divisor)
        try:
            original(self)
        finally:
            self.divisor = divisor
    return patched(ShardedBucket, "start", start)


def prefetch_two_ahead():
    def neighbour(self, u, step):
        if not (self.prefetch and self.order_fixed) or u not in self.order:
            return None
        i = self.order.index(u) + 2 * step
        return self.order[i] if 0 <= i < len(self.order) else None
    return patched(ParamUnits, "_neighbour", neighbour)


LAYOUTS = [
    layout("dp4_zero3", dp=4, zero=3, model=MB2),
    layout("dp4_zero3_llama_untied_eval", dp=4, zero=3, model=MB2 + LLAMA,
           flags=("--eval-interval", "3", "--eval-iters", "1")),
    layout("tp2_dp2_sp_zero3", tp=2, dp=2, sp=True, zero=3, model=MB2,
           flags=("--check-weight-hash-across-dp-replicas-interval", "1", "--log-params-norm", "--test-mode")),
    layout("pp2_dp2_interleaved_zero3", pp=2, dp=2, vp=1, zero=3, model=MB2),
    layout("tp2_dp2_zero3_recompute_full", tp=2, dp=2, zero=3, recompute="full", model=MB2),
    layout("pp2_dp2_tied_zero3_bf16", pp=2, dp=2, zero=3, dtype="bf16", model=MB2),
    layout("cp2_dp2_zero3_overlap_gather", dp=2, cp=2, zero=3, model=MB2, flags=("--overlap-param-gather",)),
    layout("dp4_megatron_fsdp_no_reshard", dp=4, model=MB2,
           flags=("--use-megatron-fsdp", "--torch-fsdp2-no-reshard-after-forward")),
    # zero-bubble pipelines: B accumulates nothing (the units freed as it passes them), W after (tests below)
    layout("pp2_dp2_zero3_zb_h1_eight_layers", pp=2, dp=2, zero=3, model=MB2 + EIGHT_LAYERS,
           flags=("--pipeline-schedule", "zb-h1")),
    layout("pp2_dp2_zero3_zbv_tied", pp=2, dp=2, zero=3, model=MB2, flags=("--pipeline-schedule", "zbv")),
]
FAULTS = [
    layout("fault_no_regather", dp=4, zero=3, fault=no_regather_before_backward, model=MB2),
    layout("fault_no_mean", dp=4, zero=3, fault=reduce_scatter_without_mean, model=MB2),
    layout("fault_prefetch_two_ahead", dp=4, zero=3, fault=prefetch_two_ahead, model=MB2),
]


def _schedule(chunks, opt):
    """Per chunk: the unit schedule's counters, its units' gathered sizes, what is gathered now."""
    out = []
    for c in chunks:
        u = getattr(c, "units", None)
        out.append({"stage": c.zero_stage} if u is None else {
            "stats": dict(u.stats), "units": [sum(b.param_bytes() for b in x.buckets) for x in u.units],
            "gathered_now": sum(b.params_allocated() for b in u.buckets), "stage": c.zero_stage})
    return out


def _pretrain(argv):
    args = parse_args(list(BASE) + list(MB2) + list(argv), world_size=max(1, ps.world_size()))
    try:
        return pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
    finally:
        ps.destroy_model_parallel()


def _startup():
    """Elements of seeded weights each rank generates while building ZeRO-3 DP4, against its
    shard (plus at most two partial rows per piece) and the model."""
    from megalite.cli.parser import model_config
    from megalite.tensor_parallel import init as init_module
    from megalite.tensor_parallel import model_parallel_manual_seed
    from megalite.training.setup import build_model
    args = parse_args(list(BASE) + list(Z3), world_size=4)
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(args.seed)
    made, original = [0], init_module._tiles  # every seeded weight block is generated here

    def counting(*a):
        out = original(*a)
        made[0] += out.numel()
        return out
    try:
        init_module._tiles = counting
        (chunk,) = build_model(model_config(args, args.vocab_size), pretrain_gpt.model_provider, args)
    finally:
        init_module._tiles = original
        ps.destroy_model_parallel()
    pieces = [pc for b in chunk.buckets for pc in b.pieces]
    return {"made": made[0], "shard": sum(pc.data.numel() for pc in pieces),
            "rows": sum(2 * pc.param.shape[-1] for pc in pieces if pc.param.dim() == 2),
            "model": sum(p.numel() for p in chunk.module.parameters())}


def _world(root, part):
    """part 0: start-up and every other layout; part 1: the rest, the faults and the checkpoints (two
    worlds side by side keep both cores busy)."""
    out = {lay.name: train(lay, _schedule) for lay in LAYOUTS[part::2]}
    if part == 0:
        out["startup"] = _startup()
        return out
    for lay in FAULTS:
        try:
            out[lay.name] = train(lay, _schedule)
        except Exception as e:  # noqa: BLE001  (a fault may stop training: that is caught too)
            out[lay.name] = f"raised: {str(e).splitlines()[0]}"
    a, b, c, e = (os.path.join(root, n) for n in "abce")
    out["first"] = _pretrain(list(Z3) + ["--save", a, "--exit-interval", "3"])
    out["resumed"] = _pretrain(list(Z3) + ["--load", a])
    stop = ["--train-iters", "3", "--use-checkpoint-opt_param-scheduler"]  # load, train nothing, save here
    _pretrain(["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--load", a, "--save", b] + stop)
    _pretrain(["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1", *Z3,
               "--load", a, "--save", c] + stop)
    _pretrain(list(Z3) + ["--load", b, "--save", e] + stop)  # and back to ZeRO-3 DP4
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("zero3"))
    parts = [start_on_ranks(_world, 4, root, part, timeout=480) for part in (0, 1)]
    ranks = [{**a, **b} for a, b in zip(*(w.result() for w in parts))]
    return root, {k: [r[k] for r in ranks] for k in ranks[0]}


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.name)
def test_zero3_matches_single_process(world, lay):
    ranks = world[1][lay.name]
    assert_parity(lay, ranks)
    for r in ranks:  # ZeRO-3 really ran (and frees everything between steps)
        for chunk in r["collected"]:
            assert chunk["stage"] == 3 and chunk["gathered_now"] == 0, chunk


def test_startup_makes_only_this_ranks_shard(world):
    for r in world[1]["startup"]:
        assert 0 < r["made"] <= r["shard"] + r["rows"] and r["shard"] < r["model"] / 3, r


def test_unit_schedule_prefetches_each_next_unit(world):
    """dp4_zero3: GPT with tied embeddings at PP=1, 7 units (embedding, 4 layers, final norm,
    output layer using the embedding's bucket); 6 iterations x 1 micro-batch (of 2 samples) per rank.
    Forward: the embedding on demand, the 6 others prefetched by their predecessor; backward:
    the output layer on demand (freed after its forward), then final norm and layers 3..0
    prefetched (5), the embedding still gathered since the output layer's backward. The first
    micro-batch's forward gathers all 7 on demand (the order is being recorded)."""
    micro = 6
    for r in world[1]["dp4_zero3"]:
        (s,) = [c["stats"] for c in r["collected"]]
        assert s["demand"] == 7 + 1 + (micro - 1) * 2, s
        assert s["prefetch"] == 5 + (micro - 1) * (6 + 5), s
        assert s["wasted"] == 0, s
        # gathered at once: a unit and the prefetched next, plus the tied embedding held from
        # the output layer's backward to the embedding's
        units = sorted(r["collected"][0]["units"])
        assert s["peak_bytes"] <= units[-1] + units[-2] + r["collected"][0]["units"][0], (s, units)
    for r in world[1]["dp4_megatron_fsdp_no_reshard"]:
        # --torch-fsdp2-no-reshard-after-forward: units stay whole from the forward to their
        # backward, so only the forward gathers (6: the output layer's bucket is the embedding's)
        (s,) = [c["stats"] for c in r["collected"]]
        assert (s["demand"], s["prefetch"], s["wasted"]) == (6 + (micro - 1), (micro - 1) * 5, 0), s
    for r in world[1]["dp4_zero3_llama_untied_eval"]:  # untied: at most (1 + prefetch) units, evaluation too
        (c,) = r["collected"]
        units = sorted(c["units"])
        assert c["stats"]["peak_bytes"] <= units[-1] + units[-2] and c["stats"]["wasted"] == 0, c


def test_a_zero_bubble_b_frees_each_unit_behind_it(world):
    """A split backward's B captures its gradients (accumulated at W, which reads no weights), so no gradient frees a
    unit: B frees each unit as it passes below it, and the peak stays 1F1B's (a unit and the prefetched next: two
    4-layer stages of 8 layers, else a whole stage at once)."""
    for r in world[1]["pp2_dp2_zero3_zb_h1_eight_layers"]:
        (c,) = r["collected"]
        units = sorted(c["units"])
        assert c["stats"]["peak_bytes"] <= units[-1] + units[-2] < sum(units) / 2, (r["coords"], c)


def test_faults_are_caught(world):
    r = world[1]["fault_no_regather"]  # freed weights read as NaN: training stops, or parity fails
    assert any(isinstance(x, str) for x in r) or mismatches(FAULTS[0], r, reference(FAULTS[0])), r
    assert mismatches(FAULTS[1], world[1]["fault_no_mean"], reference(FAULTS[1])), "1/DP missing went unseen"
    stats = [r["collected"][0]["stats"] for r in world[1]["fault_prefetch_two_ahead"]]
    want = [r["collected"][0]["stats"] for r in world[1]["dp4_zero3"]]
    assert stats != want and any(s["wasted"] or s["demand"] > w["demand"] for s, w in zip(stats, want)), stats


def test_exact_resume_at_the_same_layout(world):
    _, w = world
    # the dp4_zero3 parity layout is the uninterrupted run (the same flags)
    straight, first, resumed = w["dp4_zero3"][-1]["losses"], w["first"][-1], w["resumed"][-1]
    assert first == straight[:3] and resumed == straight[3:], (straight, first, resumed)


def _tensors(root):
    rd = Reader(find_checkpoint(root)[0])
    return {n: rd.get(n) for n in rd.names()}


def test_checkpoint_moves_between_zero3_and_other_layouts_bit_exactly(world, tmp_path):
    """Saved at ZeRO-3 DP4 (a); loaded and saved again at TP2 ZeRO-1 (b), PP2 interleaved
    ZeRO-3 (c), one process (d), and from b back at ZeRO-3 DP4 (e): every weight and Adam
    state, bit for bit. Then exported to Hugging Face and imported back, bit for bit."""
    root, _ = world
    d = str(tmp_path / "d")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _pretrain(["--load", os.path.join(root, "a"), "--save", d, "--train-iters", "3",
                   "--use-checkpoint-opt_param-scheduler"])
    finally:
        torch.set_num_threads(threads)
    ref = _tensors(os.path.join(root, "a"))
    assert any(n.startswith("optimizer.exp_avg_sq.") for n in ref) and len(ref) > 20
    for name, path in (("TP2 ZeRO-1", os.path.join(root, "b")), ("PP2 interleaved ZeRO-3", os.path.join(root, "c")),
                       ("one process", d), ("back at ZeRO-3 DP4", os.path.join(root, "e"))):
        got = _tensors(path)
        assert sorted(got) == sorted(ref), name
        for n, t in ref.items():
            assert torch.equal(got[n], t), f"{name}: {n} changed"
    hf, back = str(tmp_path / "hf"), str(tmp_path / "back")
    assert convert("--loader", "megalite", "--saver", "hf", "--load-dir", os.path.join(root, "a"),
                   "--save-dir", hf)[0] == 0
    rc, _, err = convert("--loader", "hf", "--saver", "megalite", "--load-dir", hf, "--save-dir", back)
    assert rc == 0, err
    imported = _tensors(back)
    for n, t in imported.items():
        assert torch.equal(t, ref[n]), f"HF round trip of the ZeRO-3 checkpoint changed {n}"


def test_fsdp_flags_map_onto_zero_stages(capsys):
    req = "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 8 --micro-batch-size 1 --lr 1e-3 " \
          "--train-iters 1 --mock-data".split()
    for strategy, stage in (("no_shard", None), ("optim", 1), ("optim_grads", 2), ("optim_grads_params", 3)):
        args = parse_args(req + ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy], world_size=2)
        assert (args.use_distributed_optimizer, args.zero_stage) == (stage is not None, stage), strategy
    assert parse_args(req + ["--use-megatron-fsdp"], world_size=2).zero_stage == 3  # Megatron's default strategy
    args = parse_args(req + ["--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"], world_size=2)
    assert args.zero_stage == 3 and not args.torch_fsdp2_reshard_after_forward
    assert "--use-torch-fsdp2 accepted" in capsys.readouterr().out
    for bad, msg in ((["--data-parallel-sharding-strategy", "optim"], "needs --use-megatron-fsdp"),
                     (["--use-megatron-fsdp", "--use-torch-fsdp2"], "exclusive"),
                     (["--use-megatron-fsdp", "--zero-stage", "2"], "drop --zero-stage"),
                     (["--torch-fsdp2-no-reshard-after-forward"], "needs ZeRO-3"),
                     (["--use-torch-fsdp2", "--data-parallel-shares", "3,1", "--global-batch-size", "8"],
                      "every rank must run the same count"),
                     (["--use-megatron-fsdp", "--outer-dp-sharding-strategy", "optim"], "hybrid sharding")):
        with pytest.raises(SystemExit):
            parse_args(req + bad, world_size=2)
        assert msg in capsys.readouterr().err, bad
    parse_args(req + ["--use-megatron-fsdp", "--fsdp-double-buffer", "--megatron-fsdp-version", "2",
                      "--init-model-with-meta-device", "--ckpt-format", "fsdp_dtensor"], world_size=2)
    out = capsys.readouterr().out
    assert "--fsdp-double-buffer accepted" in out and "--init-model-with-meta-device accepted" in out
