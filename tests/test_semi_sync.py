"""Semi-synchronous replicas (megalite/distributed/semi_sync.py): Local SGD and DiLoCo.

Proof: one replica reproduces the ordinary run bit for bit; R replicas (with TP + SP, PP, ZeRO-2 or CP
inside, equal and unequal inner step counts) match a single-process reference that runs the replicas'
inner loops one after the other and applies the outer step with torch.optim.SGD (below, the test's own):
losses, step-1 gradients, the global weights after several rounds and the outer momentum, <= 1e-5;
the outer step against its float64 formula; every replica holds the global weights after an outer step."""


import pytest
import torch

from dist_util import rel_err, run_on_ranks
from megalite import parallel_state as ps
from megalite.config import ConfigError
from megalite.config.semi_sync import SemiSyncConfig
from megalite.distributed.semi_sync import SemiSync
from parity import BASE, MOE, MOE_BIAS, STEPS, check_reference, layout, reference, run_layouts, train
from semi_sync_reference import DILOCO, EP2, LOCAL_SGD, collect, semi, semi_sync_mismatches, serial_reference


# -- one replica is the ordinary run ---------------------------------------------------------
DILOCO_LR1 = ("--semi-sync-method", "diloco", "--outer-lr", "1", "--outer-momentum", "0")
FP8_DELAYED = ("--fp8-format", "hybrid", "--fp8-amax-history-len", "2", "--fp8-amax-compute-algo", "max")


@pytest.mark.parametrize("flags, dtype, model", [
    (LOCAL_SGD + ("--semi-sync-steps", "2"), "fp32", ()),
    (DILOCO_LR1 + ("--semi-sync-steps", "4"), "fp32", ()),
    (LOCAL_SGD + ("--semi-sync-steps", "3"), "bf16", ()),
    (DILOCO_LR1 + ("--semi-sync-steps", "3"), "fp32", FP8_DELAYED + ("--fp8-recipe", "tensorwise")),
    (DILOCO_LR1 + ("--semi-sync-steps", "3"), "fp32", FP8_DELAYED)],
    ids=["local_sgd", "diloco_lr1_mu0", "local_sgd_bf16", "diloco_fp8_tensorwise", "diloco_fp8_delayed"])
def test_one_replica_is_the_ordinary_run_bit_for_bit(flags, dtype, model):
    lay = layout("one_replica", flags=flags, dtype=dtype, model=model)
    want, threads = reference(lay), torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference ran: another thread count sums in another order
    try:
        got = train(lay)
    finally:
        torch.set_num_threads(threads)
    assert got["losses"] == want["losses"], (got["losses"], want["losses"])
    for name, p in want["params"].items():
        assert torch.equal(got["params"][name], p), f"{name} differs after {STEPS} steps with one replica"


# -- the outer step against its float64 formula -----------------------------------------------
class _Opt:
    def __init__(self, params):
        self.main_params = params
        self.published = 0

    def publish_main_params(self):
        self.published += 1


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_is_sgd_with_momentum_in_float64(nesterov):
    ps.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    params = [torch.randn(37, 5), torch.randn(1000)]
    cfg = SemiSyncConfig(semi_sync_method="diloco", semi_sync_steps=[3], semi_sync_auto=False, outer_lr=0.7,
                         outer_momentum=0.9, outer_nesterov=nesterov, semi_sync_fragments=1, semi_sync_fragment_delay=0,
                         semi_sync_fragment_alpha=0.0, semi_sync_quantize=None, semi_sync_async=False,
                         semi_sync_max_staleness=0, num_layers=1, train_iters=12, global_batch_size=None)
    opt = _Opt(params)
    s = SemiSync(cfg, opt)
    glob = [p.double().clone() for p in params]
    buf = None
    for rnd in range(4):
        for p in params:  # the inner steps' effect
            p.add_(torch.randn_like(p) * 0.01)
        g = [a - b.double() for a, b in zip(glob, params)]
        buf = [x.clone() for x in g] if buf is None else [0.9 * b + x for b, x in zip(buf, g)]
        d = [x + 0.9 * b for x, b in zip(g, buf)] if nesterov else buf
        glob = [a - 0.7 * x for a, x in zip(glob, d)]
        s.after_iteration(3 * (rnd + 1), 8)
        for p, want, mine in zip(params, glob, s.glob):
            assert rel_err(p, want) <= 1e-6 and torch.equal(p, mine)
    assert opt.published == 4 and s.outer_steps == 4


STREAMING = ("--semi-sync-fragments", "2", "--semi-sync-fragment-delay", "1", "--semi-sync-fragment-alpha", "0.5")
# (layout, replicas, inner steps per replica, method, DP size over all replicas[, (fragments, delay, alpha)])
CASES = [
    (semi("dp4_r2_diloco", 2, "2", dp=4), 2, [2, 2], DILOCO, 4),
    (semi("dp4_r4_local_sgd_uneven", 4, "3,1,2,3", method=LOCAL_SGD, dp=4), 4, [3, 1, 2, 3], LOCAL_SGD, 4),
    (semi("tp2_sp_r2_diloco_test_mode", 2, "2", tp=2, sp=True, dp=2, flags=("--test-mode",)), 2, [2, 2], DILOCO, 2),
    (semi("pp2_r2_diloco_uneven", 2, "3,2", pp=2, dp=2), 2, [3, 2], DILOCO, 2),
    # a micro-batch size per DP rank inside the replicas: 2 samples each, as 1 x 2, 2 x 1, 2 x 1, 1 x 2
    (semi("dp4_r2_diloco_sizes_2_1_1_2", 2, "2", dp=4, flags=("--data-parallel-micro-batch-sizes", "2,1,1,2")), 2,
     [2, 2], DILOCO, 4),
    (semi("zero2_dp4_r2_diloco", 2, "3", zero=2, dp=4), 2, [3, 3], DILOCO, 4),
    (semi("cp2_r2_diloco", 2, "2", cp=2, dp=2), 2, [2, 2], DILOCO, 2),
    (semi("pp2_interleaved_r2_diloco", 2, "3", pp=2, vp=1, dp=2), 2, [3, 3], DILOCO, 2),
    (semi("zero3_dp4_r2_recompute_diloco", 2, "2", zero=3, dp=4, recompute="full"), 2, [2, 2], DILOCO, 4),
    # MoE with EP2 inside each replica (all-to-all dispatch, ZeRO-1, uneven rounds): the expert biases, moved by
    # token counts, are set to the replicas' sample-weighted mean at each outer step
    (semi("ep2_zero1_dp4_r2_diloco_uneven_bias", 2, "3,2", zero=1, dp=4, model=MOE + MOE_BIAS, flags=EP2), 2, [3, 2],
     DILOCO, 4),
    # Streaming DiLoCo: 2 fragments (layers 0-1 + embeddings, layers 2-3 + final norm) at iterations 2 and 4
    # of each round of 4, applied one iteration later and mixed in with alpha 0.5
    (semi("dp4_r2_streaming_k2_delay1_alpha", 2, "4", dp=4, flags=STREAMING), 2, [4, 4], DILOCO, 4, (2, 1, 0.5)),
    # 4 fragments over PP2 (each stage syncs its two at different iterations), no delay
    (semi("pp2_r2_streaming_k4", 2, "4", pp=2, dp=2, flags=("--semi-sync-fragments", "4")), 2, [4, 4], DILOCO, 2,
     (4, 0, 0.0)),
]


# fp8 pseudo-gradients (Streaming DiLoCo, 2 fragments, delay 1): not the exact update, so checked on its own
QUANTIZED = semi("dp4_r2_streaming_fp8", 2, "4", dp=4,
                 flags=("--semi-sync-fragments", "2", "--semi-sync-fragment-delay", "1", "--semi-sync-quantize", "fp8"))


@pytest.fixture(scope="module")
def world():
    return run_layouts([c[0] for c in CASES] + [QUANTIZED], 4, collect=collect)


def test_quantized_outer_steps_keep_replicas_identical_and_send_the_formula(world):
    from megalite.distributed.quantize import payload_bytes
    ranks, first = world[-1], {}
    for r in ranks:
        c = r["collected"]
        want = sum(n * payload_bytes(e, "fp8") for n, e in zip(c["syncs"], c["elements"]))  # one bucket each here
        assert c["syncs"] == [2, 2] and c["bytes"] == want, (c["syncs"], c["bytes"], want)
        for name, t in r["params"].items():
            assert torch.equal(first.setdefault((r["coords"], name), t), t), f"replicas differ in {name}"
    check_reference({"losses": ranks[0]["losses"]}, margin=0.3)


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c[0].name for c in CASES])
def test_replicas_match_the_serial_reference(world, i):
    lay, replicas, steps, method, dp, *streaming = CASES[i]
    ranks, ref = world[i], serial_reference(lay, replicas, steps, method, dp, *streaming)
    bad = semi_sync_mismatches(lay, ranks, ref, steps, method)
    assert not bad, f"{lay.name}: {len(bad)} mismatches against the serial reference:\n" + "\n".join(bad[:30])
    check_reference({"losses": ref["losses"][0]}, margin=0.3)


# -- FP8 inside the replicas (one FP8 replica is the ordinary FP8 run: above) ---------------------------
# each replica one rank, on this machine's rounding (an FP8 operand an fp32 rounding apart can land on the other FP8
# neighbour), keeping its own delayed histories (reduced over its own DP ranks)
FP8_CASE = (semi("dp2_r2_fp8_delayed_diloco", 2, "2", dp=2, model=FP8_DELAYED), 2, [2, 2], DILOCO, 2)


def collect_fp8(chunks, opt):
    from megalite.checkpoint.state import fp8_state
    return {**collect(chunks, opt), "fp8": fp8_state(chunks)}


def test_fp8_replicas_match_the_serial_reference_and_keep_their_own_histories():
    """Two one-rank FP8 replicas under DiLoCo: step 1 (losses, every gradient) is the serial reference's within
    1e-5; from step 2 on FP8 training parts from the reference as a rounding twin does (a weight an fp32 rounding
    apart moves a value across an FP8 midpoint: 2e-5 after six steps under ATen's default kernels), so the later steps
    are not compared. The replicas end on the same weights bit for bit, and each kept its own delayed histories
    (amaxes of its own samples: the two differ; reduced over all replicas they would be one)."""
    from parity import VOCAB, _cut_vocab
    lay, replicas, steps, method, dp = FP8_CASE
    ranks = run_layouts([lay], 2, collect=collect_fp8, capability=None)[0]
    ref = serial_reference(lay, replicas, steps, method, dp)
    for r in ranks:
        rep = r["collected"]["replica"]
        assert abs(r["losses"][0] - ref["losses"][rep][0]) <= 1e-5 * abs(ref["losses"][rep][0]), rep
        for name, t in r["grads"].items():
            assert rel_err(t, _cut_vocab(name, ref["grads"][rep][name], VOCAB)) <= 1e-5, (rep, name)
    a, b = ranks
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"]), "the replicas' weights differ"
    ha, hb = a["collected"]["fp8"], b["collected"]["fp8"]
    assert ha.keys() == hb.keys() and ha and all(ha[n]["x"] != hb[n]["x"] for n in ha), "one history for both"
    check_reference({"losses": ref["losses"][0]}, margin=0.3)


# -- what does not compose: one line each ---------------------------------------------------------
@pytest.mark.parametrize("flags, world, message", [
    (("--semi-sync-replicas", "2"), 2, "need --semi-sync-method"),
    (DILOCO + ("--semi-sync-replicas", "3"), 4, "--semi-sync-replicas 3 must divide the data-parallel size 4"),
    (LOCAL_SGD + ("--outer-lr", "0.5"), 2, "local_sgd averages the replicas' weights"),
    (DILOCO + ("--semi-sync-steps", "2,3,4"), 2, "one per replica (2 replicas)"),
    (DILOCO + ("--semi-sync-steps", "0"), 2, "one positive integer"),
    (DILOCO + ("--semi-sync-steps", "4", "--eval-interval", "6"), 2, "--eval-interval 6 must be a multiple of"),
    (DILOCO + ("--semi-sync-steps", "auto:1"), 2, "auto or auto:H with H >= 2"),
    (DILOCO + ("--semi-sync-steps", "4", "--save-interval", "6"), 2, "--save-interval 6 must be a multiple of"),
    (DILOCO + MOE + MOE_BIAS + ("--semi-sync-steps", "4", "--semi-sync-fragments", "2"), 2,
     "--moe-router-enable-expert-bias with streaming"),
    (DILOCO + MOE + MOE_BIAS + ("--semi-sync-async", "--semi-sync-steps", "2", "--train-iters", "6"), 2,
     "--moe-router-enable-expert-bias with streaming or --semi-sync-async"),
    (LOCAL_SGD + ("--semi-sync-quantize", "fp8"), 2, "local_sgd sends weights"),
    (DILOCO + ("--semi-sync-steps", "4", "--semi-sync-fragments", "5"), 2, "--semi-sync-fragments 5 must be between"),
    (DILOCO + ("--semi-sync-steps", "4", "--semi-sync-fragments", "2", "--semi-sync-fragment-delay", "2"), 2,
     "--semi-sync-fragment-delay 2 must be >= 0 and below"),
    (DILOCO + ("--semi-sync-steps", "4,2", "--semi-sync-fragments", "2"), 2, "needs one --semi-sync-steps H"),
    (DILOCO + ("--semi-sync-steps", "4", "--semi-sync-fragments", "2", "--eval-interval", "4"), 2,
     "hold the global weights only at the end"),
    (DILOCO + ("--outer-momentum", "1.5"), 2, "--outer-momentum 1.5 in [0, 1)"),
])
def test_bad_combinations_are_one_line(flags, world, message):
    from megalite.cli.parser import _parse
    with pytest.raises(ConfigError) as e:
        _parse(list(BASE) + list(flags), world_size=world)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


# -- checkpoints ----------------------------------------------------------------------------------
def _run(flags):
    """pretrain on this rank's grid with BASE + flags: (losses, {name: full parameter})."""
    import pretrain_gpt
    from megalite.cli.parser import parse_args
    from megalite.training import pretrain
    from model_util import gather_full
    from parity import _named, learnable_datasets
    args = parse_args(list(BASE) + ["--lr-decay-iters", str(STEPS)] + list(flags), world_size=ps.world_size())
    try:
        losses, chunks, opt = pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args,
                                       return_state=True)
        semi = getattr(opt, "semi_sync", None)
        return losses, {n: gather_full(p, p.detach().float()) for n, p in _named(chunks)}, semi and semi.chosen
    finally:
        ps.destroy_model_parallel()


def _checkpoint_runs(d):
    semi_flags = list(DILOCO) + ["--semi-sync-replicas", "2", "--semi-sync-steps", "2"]
    out = {"whole": _run(semi_flags)}
    out["first 4"] = _run(semi_flags + ["--train-iters", "4", "--save", f"{d}/semi"])
    out["resumed"] = _run(semi_flags + ["--load", f"{d}/semi"])
    out["sync from semi"] = _run(["--load", f"{d}/semi", "--train-iters", "4"])
    out["tp2 from semi"] = _run(["--tensor-model-parallel-size", "2", "--load", f"{d}/semi", "--train-iters", "4"])
    out["sync first 4"] = _run(["--train-iters", "4", "--save", f"{d}/sync"])
    out["semi from sync"] = _run(semi_flags + ["--load", f"{d}/sync", "--train-iters", "4"])
    out["semi from sync, trained"] = _run(semi_flags + ["--load", f"{d}/sync"])
    uneven = list(DILOCO) + ["--semi-sync-replicas", "2", "--semi-sync-steps", "2,1"]
    out["uneven"] = _run(uneven + ["--save", f"{d}/uneven"])  # replica 1 has 3 losses, and saves iteration 6 too
    return out


def test_checkpoints_resume_exactly_and_cross_to_synchronous_training(tmp_path):
    from megalite.checkpoint.hf_convert import export_hf
    runs = run_on_ranks(_checkpoint_runs, 2, str(tmp_path))

    def same(a, b, what):
        for name, t in b.items():
            assert torch.equal(a[name], t), f"{what}: {name} differs"
    for r in runs:
        whole, first, resumed = r["whole"], r["first 4"], r["resumed"]
        assert resumed[0] == whole[0][4:], (resumed[0], whole[0])  # the loss of every resumed step
        same(resumed[1], whole[1], "resumed at iteration 4 vs the whole run")
        same(r["sync from semi"][1], first[1], "a synchronous run loading the semi-sync checkpoint")
        same(r["tp2 from semi"][1], first[1], "TP2 loading the semi-sync checkpoint (DP2, 2 replicas)")
        same(r["semi from sync"][1], r["sync first 4"][1], "semi-sync loading a synchronous checkpoint")
        assert len(r["semi from sync, trained"][0]) == 2
    assert [len(r["uneven"][0]) for r in runs] == [6, 3]
    assert (tmp_path / "uneven" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert not (tmp_path / "uneven" / "iter_0000003").exists()
    export_hf(str(tmp_path / "semi"), str(tmp_path / "hf"), model_type="gpt")  # the global weights, to HF
    from safetensors.torch import load_file
    hf = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        hf.update(load_file(str(f)))
    emb = runs[0]["first 4"][1]["embedding.word_embeddings.weight"]
    assert torch.equal(hf["transformer.wte.weight"].float(), emb[:hf["transformer.wte.weight"].shape[0]])


def _fp8_checkpoint_runs(d):
    flags = list(DILOCO) + list(FP8_DELAYED) + ["--semi-sync-replicas", "2", "--semi-sync-steps", "2"]
    return _run(flags), _run(flags + ["--train-iters", "4", "--save", d]), _run(flags + ["--load", d])


def test_fp8_replicas_resume_their_own_histories(tmp_path):
    """Two FP8 replicas (delayed scaling) each save their own amax histories (replica 1's under its names) and a
    resumed run is the uninterrupted one bit for bit (with one set of histories for both it is not)."""
    for whole, first, resumed in run_on_ranks(_fp8_checkpoint_runs, 2, str(tmp_path)):
        assert first[0] + resumed[0] == whole[0], (first[0], resumed[0], whole[0])
        for name, t in whole[1].items():
            assert torch.equal(resumed[1][name], t), f"{name} differs after resuming"


def _auto_run():
    import time

    import pretrain_gpt
    original = pretrain_gpt.forward_step

    def slow(it, model):  # replica 1 is the slow one: 50 ms more per micro-batch
        if ps.get_replica_rank() == 1:
            time.sleep(0.05)
        return original(it, model)
    pretrain_gpt.forward_step = slow
    try:
        return _run(list(DILOCO) + ["--semi-sync-replicas", "2", "--semi-sync-steps", "auto:4", "--train-iters", "8"])
    finally:
        pretrain_gpt.forward_step = original


def test_auto_steps_give_the_slow_replica_fewer_inner_steps():
    """The first round times 4 steps of each replica; replica 1 (4 micro-batches x 50 ms slower per step than
    replica 0's few ms) then gets round(4 x its relative speed) = 1 step per round, replica 0 keeps 4."""
    runs = run_on_ranks(_auto_run, 2)
    for r, (losses, _, chosen) in enumerate(runs):
        secs, counts, at = chosen
        assert counts == [4, 1] and at == 4 and secs[1] > 4 * secs[0], chosen
        assert len(losses) == (8 if r == 0 else 5), (r, losses)  # replica 1: 4 steps, then 1 of the next 4


# -- quantized pseudo-gradients -------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_quantized_payloads_stay_within_their_bound(kind):
    from megalite.distributed import quantize
    torch.manual_seed(0)
    n = 3 * quantize.ROW + 37  # a partial last row
    x = torch.randn(n, dtype=torch.float64) * torch.logspace(-6, 1, n, dtype=torch.float64)  # magnitudes over 7 decades
    x[quantize.ROW:2 * quantize.ROW] = 0.0  # a row of zeros
    payload, scale = quantize.quantize(x, kind)
    back = quantize.dequantize(payload, scale, kind, n)
    err, bound = (back - x.float().double()).abs(), quantize.error_bound(x, kind)
    assert bool((err <= bound).all()), f"{kind}: worst excess {(err - bound).max():.3e}"
    assert bool((back[quantize.ROW:2 * quantize.ROW] == 0).all())
    assert payload.numel() + (0 if scale is None else 4 * scale.numel()) == quantize.payload_bytes(n, kind)
    assert (err > 0).any(), "a quantizer that loses nothing here is not quantizing"
