"""ZeRO stage 1 / 2 / 3 (megalite.optimizer.distributed_optimizer) against the ordinary optimizer.

Each topology runs once on CPU ranks (module fixtures); every rank trains the same
tiny GPT with the plain optimizer and with ZeRO and reports how they differ.

Tolerances. Without clipping, ZeRO-1 (and ZeRO-2 with one micro-batch) performs the same
fp32 operations on every element as the plain path (the reduce-scatter sums the same
addends in the same order as the all-reduce, Adam is elementwise), so it must be bit-exact;
so must ZeRO-3 with one micro-batch at DP <= 2 (stage 2's reductions; its all-gathers copy
bits). ZeRO-3's buckets are cut per layer, not every N elements, so an element sits elsewhere in
the reduce-scatter's ring chunks: with more than two addends they are summed in another order
(seen: 2e-3 lr after 10 steps at DP4), checked with the clipped runs' bound below instead.
With clipping the global norm is summed in another order (slices, then DP): the clip
coefficient differs by ~1e-7; ZeRO-2 with gradient accumulation also sums per micro-batch
first. Gradients then differ by fp32 rounding only, but Adam's first step moves an element
by lr * g / (|g| + eps): where g happens to be near eps (a near-cancelling sum, e.g. -4.8e-8
vs -4.84e-8 measured in the TP2xPP2xDP2 run) the update differs by ~4e-4 lr. So parameters
are compared in units of one step: max |difference| <= 1e-3 lr. Those runs use no linear
biases: the attention key bias has a mathematically zero gradient (softmax is shift
invariant), pure rounding noise that Adam turns into +-lr steps.
"""

import contextlib

import pytest
import torch

from dist_util import rel_err, run_on_ranks
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from megalite.config import TrainingConfig
from megalite.distributed import DistributedDataParallel, comm, finalize_model_grads
from megalite.distributed import DistributedDataParallelConfig as DDPConfig
from megalite.models import GPTModel
from megalite.optimizer import MixedPrecisionOptimizer
from megalite.optimizer.distributed_optimizer import DistributedOptimizer, reassemble_full_state
from megalite.optimizer.memory import expected_bytes_per_param, training_state_bytes
from megalite.tensor_parallel import model_parallel_manual_seed
from model_util import batch, tiny_config

STEPS = 10
EXACT = dict(clip_grad=0.0)  # bit-exact runs: with biases, no clipping
ROUND = dict(clip_grad=0.5)  # clipping engaged (norms ~1-3), no linear biases
NOBIAS = dict(add_bias_linear=False)


def _build(stage, dtype, cfg_kw, tcfg_kw, overlap=False):
    cfg = tiny_config("gpt2", params_dtype=dtype, **cfg_kw)
    tcfg = TrainingConfig(lr=LR, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, global_batch_size=2,
                          **tcfg_kw)
    m = DistributedDataParallel(GPTModel(cfg), DDPConfig(bucket_size=700, use_distributed_optimizer=stage > 0,
                                zero_stage=stage or 1, overlap_param_gather=overlap))
    return cfg, m, (DistributedOptimizer if stage else MixedPrecisionOptimizer)([m], tcfg)


def _iteration(cfg, m, opt, step, micro, before_step=None):
    """One iteration on this rank's `micro` micro-batches of the global batch `step`."""
    m.zero_grad_buffer()
    losses, r = [], ps.get_data_parallel_rank()
    for k in range(micro):
        ids, labels = batch(cfg, seed=1000 * step + r * micro + k)
        with m.no_sync() if k < micro - 1 else contextlib.nullcontext():
            loss = m(ids, labels=labels).float().mean()
            opt.scale_loss(loss / micro).backward()
        losses.append(loss.item())
    finalize_model_grads([m])
    if before_step is not None:
        before_step(opt)
    stepped, norm = opt.step()
    return losses, stepped, norm


def _train(stage, micro, dtype=torch.float32, cfg_kw=(), tcfg_kw=(), overlap=False, steps=STEPS):
    cfg, m, opt = _build(stage, dtype, dict(cfg_kw), dict(tcfg_kw), overlap)
    losses, norms = [], []
    for s in range(steps):
        lo, _, n = _iteration(cfg, m, opt, s, micro)
        losses += lo
        norms.append(n)
    with m.gathered():
        params = {n: p.detach().float().clone() for n, p in m.module.named_parameters()}
    return {"losses": losses, "norms": norms, "opt": opt, "params": params, "model": m}


LR = 1e-3


def _max_abs_diff(a, b):
    return max((a[n] - p).abs().max().item() for n, p in b.items())


def _compare(ref, run):
    loss = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"]))
    params = _max_abs_diff(run["params"], ref["params"])
    exact = all(torch.equal(run["params"][n], p) for n, p in ref["params"].items())
    return {"loss": loss, "params": params, "exact": exact and run["losses"] == ref["losses"]}


def _fp16_skip(stage):
    """Overflow injected into the last DP rank's own gradient slice only, at step 1."""
    cfg, m, opt = _build(stage, torch.float16, {}, dict(initial_loss_scale=2.0 ** 16, hysteresis=1))
    last = ps.get_data_parallel_rank() == ps.get_data_parallel_world_size() - 1

    def inject(o):
        if last:
            o.pieces[0].grad[0] = float("inf")
    out = {"stepped": [], "scale": [], "unchanged": None}
    for s in range(4):
        with m.gathered():
            before = [p.detach().clone() for p in m.module.parameters()]
        _, stepped, _ = _iteration(cfg, m, opt, s, 1, inject if s == 1 else None)
        out["stepped"].append(stepped)
        out["scale"].append(opt.loss_scale)
        with m.gathered():
            if s == 1:
                out["unchanged"] = all(torch.equal(a, p) for a, p in zip(before, m.module.parameters()))
            out["checksum"] = sum(p.double().sum().item() for p in m.module.parameters())
    return out


def _memory_and_comm(micro):
    """bf16 model: bytes per parameter at rest after a step, and wire bytes of one iteration."""
    out = {}
    for stage, kind in ((0, "plain"), (1, "zero1"), (2, "zero2"), (3, "zero3")):
        cfg, m, opt = _build(stage, torch.bfloat16, {}, {})
        _iteration(cfg, m, opt, 0, micro)
        comm.reset()
        _iteration(cfg, m, opt, 1, micro)
        m.finish_param_sync()
        numel = sum(p.numel() for p in m.module.parameters())
        wire = sum(c["wire_bytes"] for c in comm.counts().values())
        out[kind] = (training_state_bytes([m], opt) / numel, wire / numel)
        if stage == 3:  # ZeRO-3's all-gathers: what the schedule must gather, in padded bucket bytes
            units, d = m.units, ps.get_data_parallel_world_size()
            word = m.module.embedding.word_embeddings.weight
            tied = sum(b.padded for b in m.buckets if any(p is word for p in b.params))
            # every unit once in the forward and once in the backward per micro-batch, and the
            # tied word embedding once more (the output layer uses it after the embedding freed it)
            gathered = micro * (2 * sum(b.padded for b in m.buckets) + tied)
            out["zero3_gather"] = (comm.counts().get("all_gather", {}).get("wire_bytes", 0) / numel,
                                   gathered * 2 * (d - 1) / d / numel, units.stats)
    return out


def _topology(tp, micro, extras, full_state=None):
    ps.initialize_model_parallel(tp, 1)
    model_parallel_manual_seed(0)
    out = {"exact": {}, "round": {}}
    ref = _train(0, micro, tcfg_kw=EXACT)
    for name, kw in (("zero1", {}), ("zero2", {}), ("zero3", {}), ("zero1-overlap", dict(overlap=True))):
        if (name in ("zero2", "zero3") and micro > 1) or (name == "zero1-overlap" and "overlap" not in extras) \
                or (name == "zero3" and (ps.get_data_parallel_world_size() > 2 or tp > 1)):
            continue  # zero2/3 reduce per micro-batch: another summation order (checked in "round")
        stage = {"zero2": 2, "zero3": 3}.get(name, 1)
        out["exact"][name] = _compare(ref, _train(stage, micro, tcfg_kw=EXACT, **kw))
    if micro > 1:  # gradient accumulation: ZeRO-3 reduces exactly as ZeRO-2 does, per micro-batch
        out["exact"]["zero3-vs-zero2"] = _compare(_train(2, micro, tcfg_kw=EXACT), _train(3, micro, tcfg_kw=EXACT))
    ref = _train(0, micro, cfg_kw=NOBIAS, tcfg_kw=ROUND)
    out["ref_norms"], out["ref_losses"] = ref["norms"], ref["losses"]
    # (ZeRO-3 with TP: through pretrain() in tests/test_zero3.py)
    for stage in (1, 2, 3) if tp == 1 else (1, 2):
        run = _train(stage, micro, cfg_kw=NOBIAS, tcfg_kw=ROUND)
        out["round"][f"zero{stage}"] = _compare(ref, run)
        out[f"zero{stage}_norms"] = run["norms"]
        out[f"zero{stage}_state"] = run["opt"].state_dict()
        if stage == 2:
            zero2 = run
        if stage == 3:  # the same reductions as ZeRO-2 (per micro-batch reduce-scatters; other bucket
            # boundaries, so the clip norm sums its squares in another order): compare the two
            out["zero3_vs_zero2"] = _compare(zero2, run)
    if "bf16" in extras:
        ref = _train(0, 1, torch.bfloat16, tcfg_kw=EXACT, steps=4)
        for stage in (1, 2, 3):
            out["exact"][f"bf16-zero{stage}"] = _compare(ref, _train(stage, 1, torch.bfloat16, tcfg_kw=EXACT, steps=4))
    if "fp16" in extras:
        out["fp16"] = {s: _fp16_skip(s) for s in (1, 2, 3)}
    if "memory" in extras:
        out["memory"] = _memory_and_comm(micro)
    if full_state is not None:  # re-shard: another DP size's reassembled state into this one
        full, foreign_shard = full_state
        cfg, m, opt = _build(1, torch.float32, NOBIAS, ROUND)
        opt.load_full_state(full)
        out["loaded_state"] = opt.state_dict()
        out["loaded_params"] = {n: p.detach().clone() for n, p in m.module.named_parameters()}
        _, _, again = _build(1, torch.float32, NOBIAS, ROUND)
        again.load_state_dict(out["loaded_state"])  # same DP size: shard for shard
        out["same_size_reload"] = _max_abs_diff(
            {str(i): t for i, t in enumerate(again.main_params)}, {str(i): t for i, t in enumerate(opt.main_params)})
        try:
            again.load_state_dict(foreign_shard)
            out["foreign_error"] = None
        except ValueError as e:
            out["foreign_error"] = str(e)
    return out


@pytest.fixture(scope="module")
def dp4():
    return run_on_ranks(_topology, 4, 1, 1, ("memory", "overlap"))


@pytest.fixture(scope="module")
def full4(dp4):
    return reassemble_full_state([r["zero1_state"] for r in dp4])


@pytest.fixture(scope="module")
def dp2(dp4, full4):
    return run_on_ranks(_topology, 2, 1, 2, ("bf16", "fp16", "memory"),
                        (full4, dp4[0]["zero1_state"]))  # 2 micro-batches: gradient accumulation


@pytest.fixture(scope="module")
def tp2dp2():
    return run_on_ranks(_topology, 4, 2, 2, ())


@contextlib.contextmanager
def _in_process():
    """Single-process grid; one thread, as the spawned ranks (two threads on a busy
    two-core machine are many times slower for these tiny shapes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def single():
    """Single process over the same global batch (4 micro-batches of 2 sequences)."""
    with _in_process():
        return _train(0, 4, cfg_kw=NOBIAS, tcfg_kw=ROUND)


def _check_parity(results):
    for rank, r in enumerate(results):
        for name, c in r["exact"].items():
            assert c["exact"], f"rank {rank} {name}: not bit-exact vs plain optimizer: {c}"
        for name, c in r["round"].items():
            # losses of weights that differ by rounding: DESIGN's fp32 bound (sums ordered differently)
            assert c["loss"] <= 1e-5, f"rank {rank} {name}: loss rel diff {c['loss']:.2e}"
            assert c["params"] <= 1e-3 * LR, f"rank {rank} {name}: param diff {c['params']:.2e}"
        # with clipping the norm's squares are summed over other bucket boundaries: the bound above
        if "zero3_vs_zero2" in r:  # (the DP topologies: ZeRO-3 with TP runs in tests/test_zero3.py)
            c = r["zero3_vs_zero2"]
            assert c["loss"] <= 1e-5 and c["params"] <= 1e-3 * LR, f"rank {rank} zero3 vs zero2: {c}"
    losses = results[0]["ref_losses"]
    assert len(set(losses)) == len(losses), "the weights must move every step"


def test_dp2_with_grad_accumulation_matches_plain(dp2):
    _check_parity(dp2)


def test_dp4_matches_plain(dp4):
    _check_parity(dp4)


def test_tp2_dp2_matches_plain(tp2dp2):
    _check_parity(tp2dp2)


@pytest.mark.parametrize("topology", ["dp2", "dp4", "tp2dp2"])
def test_clip_norm_equals_single_process_norm(topology, single, request):
    results = request.getfixturevalue(topology)
    assert max(single["norms"]) > 0.5, "clipping must engage for this test to mean anything"
    for rank, r in enumerate(results):
        for stage in (1, 2, 3) if "zero3_norms" in r else (1, 2):
            for a, b in zip(r[f"zero{stage}_norms"], single["norms"]):
                assert abs(a - b) / b <= 1e-5, f"rank {rank} zero{stage}: norm {a} vs single process {b}"


def test_fp16_overflow_on_one_rank_skips_everywhere_and_recovers(dp2):
    for stage in (1, 2, 3):
        runs = [r["fp16"][stage] for r in dp2]
        for rank, f in enumerate(runs):
            assert f["stepped"] == [True, False, True, True], f"rank {rank} zero{stage}: {f['stepped']}"
            assert f["scale"] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 15]
            assert f["unchanged"], f"rank {rank} zero{stage}: a skipped step changed weights"
        assert len({f["checksum"] for f in runs}) == 1, "DP replicas diverged"


@pytest.mark.parametrize("d", [1, 2, 4])
def test_memory_matches_formula(d, dp2, dp4):
    if d == 1:
        with _in_process():
            measured = [_memory_and_comm(1)]
    else:
        measured = [r["memory"] for r in (dp2 if d == 2 else dp4)]
    micro = 2 if d == 2 else 1
    for rank, mem in enumerate(measured):
        for kind, (per_param, wire, *_) in mem.items():
            if kind == "zero3_gather":
                assert abs(per_param - wire) <= 1e-9 * wire, f"d={d} rank {rank}: ZeRO-3 gathered {per_param:.4f} " \
                    f"B/param, its schedule needs {wire:.4f}"
                continue
            want = expected_bytes_per_param(kind, d, 2)
            assert abs(per_param / want - 1) <= 0.02, f"d={d} rank {rank} {kind}: {per_param:.3f} vs {want:.3f} B/param"
            # wire bytes per parameter: all-reduce 2(d-1)/d x 4; reduce-scatter x 4 per reduction + all-gather x 2
            # (ZeRO-3: its all-gathers are checked above; here the reduce-scatters)
            if kind == "zero3":
                wire -= mem["zero3_gather"][0]
            theory = {"plain": 2 * 4, "zero1": 4 + 2, "zero2": 4 * micro + 2, "zero3": 4 * micro}[kind] * (d - 1) / d
            assert abs(wire - theory) <= 0.02 * max(theory, 1e-9), f"d={d} {kind}: {wire:.3f} vs {theory:.3f}"
    assert measured[0]["zero3"][0] < measured[0]["zero2"][0] < measured[0]["zero1"][0] or d == 1


def test_state_reassembled_from_dp4_equals_dp2_and_reshards(dp2, full4):
    full2 = reassemble_full_state([r["zero2_state"] for r in dp2])  # DP=2 ran stage 2, DP=4 stage 1
    assert full2["params"].keys() == full4["params"].keys()
    for n, f in full4["params"].items():
        assert f["step"] == full2["params"][n]["step"] == STEPS
        # Same global batch, reduced in another order (DP4 vs DP2 with two micro-batches):
        # weights in units of one Adam step, as every clipped run here (module docstring),
        # moments at DESIGN's fp32 bound.
        diff = (full2["params"][n]["main_param"] - f["main_param"]).abs().max().item()
        assert diff <= 1e-3 * LR, f"{n}.main_param: {diff:.2e}"
        for k in ("exp_avg", "exp_avg_sq"):
            assert rel_err(full2["params"][n][k], f[k]) <= 1e-5, f"{n}.{k}"
    loaded = reassemble_full_state([r["loaded_state"] for r in dp2])  # DP=4 state loaded into DP=2 shards
    for n, f in full4["params"].items():
        for k in ("main_param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["params"][n][k], f[k]), f"{n}.{k} changed in re-sharding"
        for r in dp2:  # and the loaded main params were all-gathered into every replica's weights
            assert torch.equal(r["loaded_params"][n], f["main_param"]), n
    for r in dp2:
        assert r["same_size_reload"] == 0.0
        assert "re-shard with reassemble_full_state() + load_full_state()" in r["foreign_error"]
    with pytest.raises(ValueError, match="each DP rank"):
        reassemble_full_state([dp2[0]["zero2_state"], dp2[0]["zero2_state"]])


# ZeRO through pretrain() with TP, PP, interleaving and SP against the single process: tests/test_parity.py.


REQUIRED = ("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 8 --micro-batch-size 1 --lr 1e-3 "
            "--train-iters 1").split()


def test_zero_flags(capsys):
    with pytest.raises(SystemExit):
        parse_args(REQUIRED + ["--mock-data", "--zero-stage", "2"], world_size=1)
    assert "--zero-stage and --overlap-param-gather need --use-distributed-optimizer" in capsys.readouterr().err
    assert parse_args(REQUIRED + ["--mock-data", "--use-distributed-optimizer"], world_size=1).zero_stage == 1
