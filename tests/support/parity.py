"""The parity harness: a parallel layout against the single-process run, through pretrain().

Every parity test goes through here. A layout (TP/PP/DP/SP/virtual PP/ZeRO/recompute/dtype,
plus any Megatron flags) trains on CPU ranks; the single-process reference
(TP=PP=DP=1, same seed, same global batches, same dtype) trains in the test process. Both
record, gathered to full tensors under global parameter names:
  grads   every gradient of step 1 after the DP/SP/embedding reductions and before the
          optimizer touches it (no unscaling, no clipping; fp16 grads divided by the loss
          scale here, an exact power-of-two division);
  norms   the grad norm the optimizer computed at every step (clipping uses it);
  params  every parameter after the last step;
  losses  the lm loss of every step.
On the last pipeline stage the tied word-embedding copy (`output_layer.weight` there) is
reported as "embedding.word_embeddings.weight [last-stage copy]" and compared with the
reference's embedding on its own, so each copy is checked separately.

Data a model can learn: sample i starts at a random symbol of an alphabet of ALPHABET tokens
and then follows a fixed random permutation (a bigram chain), so the loss falls fast from
ln V; `check_reference` asserts it falls by a clear margin. Warm-up 0, constant LR.

API (tests/test_parity.py and tests/test_fault_injection.py use it):
    layout(name, tp=1, pp=1, dp=1, sp=False, vp=None, zero=0, recompute=None, dtype="fp32",
           flags=(), model=(), base=BASE, fault=None, entry="pretrain_gpt", datasets=None)
        -> Layout. flags: this layout's own extra flags; model: flags the reference gets too
        (LLAMA, EIGHT_LAYERS, ...); entry: module with model_provider / forward_step
        (pretrain_bert for BERT); datasets: a module-level provider instead of the bigram data.
    run_layouts(layouts, world_size, collect=None) -> [[rank result] per layout]
        one spawn of world_size ranks runs every layout in turn (all need that world size), under
        another machine's rounding (dist_util.OTHER_CAPABILITY), taking the reference's top-k
        choices where its own are ties (tests/support/decision_replay.py);
        `collect(chunks, optimizer)` (module-level) adds anything to a rank's result (moe_collect: the
        routers' token counts and, where the record_logged fault slot is on, the logged router / MTP losses;
        logged_by_reference(layout): the single process's, for parity_check.assert_logged_as).
    start_layouts(layouts, world_size, collect=None) -> started; started.result() is run_layouts'
        return value: the world runs meanwhile (worlds side by side; the next world's references).
        A rank result: {"losses", "norms", "grads": {name: full}, "params": {name: full},
        "coords": (tp, pp, dp) rank, "record": the run's RunRecord (megalite/training/record.py), "collected"}.
    train(layout, collect=None, decided=None) -> one rank result, on the grid of the calling process
        (decided: the reference's recorded choices to replay; None: record them, as "decided").
    reference(layout) -> the single-process result for the layout's base + model + dtype
        (cached); check_reference(ref) asserts it learns.
The verdict (errors, worst, mismatches, assert_parity and the bounds) is tests/support/parity_check.py; the models,
training flags and learnable data are tests/support/parity_models.py (re-exported here).
A fault is a module-level function returning a context manager, applied in every rank
around the layout's run (monkeypatching megalite); see tests/test_fault_injection.py.
"""

import contextlib
import dataclasses
import importlib

import torch
import torch.distributed as dist

from decision_replay import HALF_PRECISION_STEPS, KEY_MATCH, MATCH, Recorder, Replayer
from dist_util import OTHER_CAPABILITY, run_on_ranks, start_on_ranks
from megalite import parallel_state as ps
from megalite.moe import decisions
from megalite.cli.parser import parse_args
from megalite.distributed.param_facts import data_parallel
from megalite.optimizer.optimizer import MixedPrecisionOptimizer
from megalite.training import pretrain
from megalite.training.record import RunRecord
from model_util import gather_full
from parity_models import (  # noqa: F401  (re-exported: the tests import them from here)
    ALPHABET, BASE, DEEPSEEK, DTYPE_FLAGS, EIGHT_LAYERS, LLAMA, MB2, MODEL, MOE, MOE_BIAS, SINKHORN, STEPS, TIED,
    TRAIN, VOCAB, BigramChainDataset, learnable_datasets)


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    flags: tuple  # the layout's own flags (parallel sizes, recompute, ...)
    dtype: str = "fp32"
    base: tuple = BASE  # model and training flags shared with the reference
    world_size: int = 1
    fault: object = None  # module-level function -> context manager, applied in each rank
    entry: str = "pretrain_gpt"  # module with model_provider and forward_step (Megatron's contract)
    datasets: object = None  # module-level datasets provider; None: learnable_datasets
    twin: int = 0  # > 0: the single process with its initial weights a rounding away (see rounding_twin)
    elsewhere: bool = False  # half precision: the layout, its reference and twins all on dist_util.OTHER_MACHINE

    def argv(self):
        return list(self.base) + list(DTYPE_FLAGS[self.dtype]) + list(self.flags)

    def reference_argv(self):
        return list(self.base) + list(DTYPE_FLAGS[self.dtype])


LOGGED = []  # the routers' and MTP's losses for the log line, per iteration (recorded where record_logged is on)


@contextlib.contextmanager
def record_logged():
    """Record what the log line shows of the routers' and the MTP depths' losses (a layout's `fault` slot:
    applied in every rank)."""
    import megalite.training.auxiliary_losses as auxiliary_losses

    def recording(original):
        def record(*a, **k):
            out = original(*a, **k)
            LOGGED.append({n: float(v) for n, v in out.items()})
            return out
        return record
    with patched(auxiliary_losses, "moe_losses", recording(auxiliary_losses.moe_losses)), \
            patched(auxiliary_losses, "mtp_losses", recording(auxiliary_losses.mtp_losses)):
        yield


def logged_by_reference(lay):
    """What the single process's log line shows of those losses, per iteration, for lay's model."""
    with record_logged():
        train(dataclasses.replace(lay, name="reference", flags=(), world_size=1, fault=None))
    want = list(LOGGED)
    LOGGED.clear()
    return want


def moe_collect(chunks, opt):
    """Each router's token counts of the last step, as its expert bias update read them; the logged losses."""
    counts = [m.last_tokens_per_expert.tolist() for c in chunks for m in c.modules()
              if getattr(m, "expert_bias", None) is not None]
    logged = list(LOGGED)
    LOGGED.clear()
    return {"counts": counts, "logged": logged}


def layout(name, tp=1, pp=1, dp=1, sp=False, vp=None, zero=0, recompute=None, dtype="fp32", flags=(),
           model=(), base=BASE, fault=None, entry="pretrain_gpt", datasets=None, cp=1, cp_comm=None, elsewhere=False):
    """vp: layers per virtual pipeline stage; zero: 0 (plain optimizer), 1 or 2; cp: context-
    parallel size, cp_comm: its --cp-comm-type (default p2p);
    recompute: None, "full" (uniform, 1 layer per checkpoint) or "selective"; flags: more
    flags of this layout only; model: flags that change the model or training (e.g.
    "--num-layers 8", "--untie-embeddings-and-output-weights"), given to the reference too."""
    f = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if sp:
        f.append("--sequence-parallel")
    if cp > 1:
        f += ["--context-parallel-size", str(cp)] + (["--cp-comm-type", cp_comm] if cp_comm else [])
    if vp is not None:
        f += ["--num-layers-per-virtual-pipeline-stage", str(vp)]
    if zero:
        f += ["--use-distributed-optimizer", "--zero-stage", str(zero)]
    if recompute == "full":
        f += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif recompute is not None:
        f += ["--recompute-granularity", recompute]
    assert not (elsewhere and dtype == "fp32"), "fp32 worlds always run elsewhere, their references here"
    return Layout(name, tuple(f) + tuple(flags), dtype, tuple(base) + tuple(model), tp * pp * dp * cp, fault, entry,
                  datasets, elsewhere=elsewhere and OTHER_CAPABILITY is not None)


# -- recording inside a run ---------------------------------------------------------------
def _full_local_grads(opt, grads):
    """{id(param): this TP rank's full local gradient} (ZeRO: pieces summed over DP)."""
    if not hasattr(opt, "pieces"):
        return {id(p): g.detach().float().clone() for p, g in zip(opt.model_params, grads)}
    out = {id(p): torch.zeros(p.numel(), dtype=torch.float32, device=p.device) for p in opt.model_params}
    for pc, g in zip(opt.pieces, grads):
        out[id(pc.param)][pc.start:pc.end] = g.float()
    for p in opt.model_params:
        group, size, _ = data_parallel(p)  # disjoint pieces over DP x CP (experts: expert-DP)
        if size > 1:
            dist.all_reduce(out[id(p)], group=group)
        out[id(p)] = out[id(p)].view(p.shape)
    return out


@contextlib.contextmanager
def recording(record, hook=None):
    """Wrap the optimizer's step: grads on entry at step 1, the norm it returns every step; a
    decisions hook (tests/support/decision_replay.py) counts the steps."""
    original = MixedPrecisionOptimizer.step

    def step(self):
        if "grads" not in record:
            scale = self.loss_scale if self.config.scaled else 1.0
            local = _full_local_grads(self, self._grads())
            record["grads"] = {k: v / scale for k, v in local.items()}
        stepped, norm = original(self)
        record["norms"].append(float(norm) if stepped and norm is not None else float("nan"))
        if hook is not None:
            hook.step += 1
        return stepped, norm
    MixedPrecisionOptimizer.step = step
    try:
        yield
    finally:
        MixedPrecisionOptimizer.step = original


def _named(chunks):
    """(global name, param) of this rank, the last stage's tied copy renamed."""
    for c in chunks:
        for name, p in c.module.named_parameters():
            if getattr(p, "shared_embedding", False):
                name = TIED + " [last-stage copy]"
            yield name, p


VOCAB_PARAMS = ("word_embeddings", "output_layer")  # parameters with padded vocabulary rows


def _cut_vocab(name, t, vocab):
    return t[:vocab] if any(v in name for v in VOCAB_PARAMS) else t


def rounding_twin(provider, twin):
    """provider, whose model's initial weights then move to a neighbouring representable value of their own dtype
    (the next value up or down in magnitude, each with probability 1/4; zeros stay), drawn from a stream of its
    own seeded by `twin`: a run that differs from the plain one only by one rounding of each weight, as a layout's
    sums differ from the single process's only in rounding."""
    def build(*args, **kwargs):
        model = provider(*args, **kwargs)
        g = torch.Generator().manual_seed(7919 * twin)
        ints = {2: torch.int16, 4: torch.int32}
        with torch.no_grad():
            for p in model.parameters():
                step = torch.randint(-2, 2, p.shape, generator=g).clamp(-1, 1)  # -1, 0, 0, +1
                bits = p.data.view(ints[p.element_size()])
                bits.add_(torch.where(p.data != 0, step, 0).to(bits.dtype))
        return model
    return build


def train(lay, collect=None, decided=None):
    """Run one layout on this process's grid (spawned rank or the test process). decided: the
    reference's recorded top-k choices (reference(lay)["decided"]), which this run takes where its
    own are ties within the rounding (tests/support/decision_replay.py); None: record them instead."""
    record = {"norms": []}
    # (FP8 runs, like half-precision ones, part from step 2 on: tests/test_fp8.py compares their step 1)
    parts = lay.dtype != "fp32" or "--fp8-format" in lay.base
    hook = Recorder() if decided is None else Replayer(decided, MATCH[lay.dtype], KEY_MATCH[lay.dtype],
                                                       HALF_PRECISION_STEPS if parts else None)
    entry = importlib.import_module(lay.entry)
    args = parse_args(lay.argv(), world_size=max(1, ps.world_size()), defaults=getattr(entry, "ARGS_DEFAULTS", None))
    fault = lay.fault() if lay.fault is not None else contextlib.nullcontext()
    try:
        with recording(record, hook), fault, decisions.hooked(hook):
            provider = rounding_twin(entry.model_provider, lay.twin) if lay.twin else entry.model_provider
            run_record = RunRecord()
            losses, chunks, opt = pretrain(lay.datasets or learnable_datasets, provider,
                                           entry.forward_step, args, return_state=True, record=run_record)
        out = {"losses": losses, "norms": record["norms"], "grads": {}, "params": {}, "record": run_record,
               "coords": (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                          ps.get_data_parallel_rank(with_context_parallel=True)),
               "capability": torch.backends.cpu.get_cpu_capability()}  # how this process's ATen rounds
        if decided is None:
            out["decided"] = hook.table()
        else:
            out["replayed"], out["decision problems"] = hook.counts, hook.problems
        with contextlib.ExitStack() as whole:  # ZeRO-3: parameters exist whole only when gathered
            for c in chunks:
                whole.enter_context(c.gathered())
            for name, p in _named(chunks):
                if p.requires_grad:  # (an MoE expert bias has none; its value is compared)
                    out["grads"][name] = _cut_vocab(name, gather_full(p, record["grads"][id(p)]), args.vocab_size)
                out["params"][name] = _cut_vocab(name, gather_full(p, p.detach().float()), args.vocab_size)
        if collect is not None:
            out["collected"] = collect(chunks, opt)
        return out
    finally:
        ps.destroy_model_parallel()


@contextlib.contextmanager
def patched(obj, name, value):
    """Set obj.name = value for the block (faults are built from this)."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _run_all(layouts, collect, decided):
    return [train(lay, collect, d) for lay, d in zip(layouts, decided)]


def run_layouts(layouts, world_size, collect=None, timeout=420, capability=OTHER_CAPABILITY, side_by_side=True,
                backend=None):
    """One spawn of world_size ranks runs every layout; returns [[rank result] per layout].
    fp32 layouts round as another machine does (dist_util.OTHER_MACHINE: its ATen capability and its oneDNN
    instruction set) than the test process, where the single-process reference runs: a bound that holds only for
    one machine's rounding fails on every machine. bf16 / fp16 layouts run on their reference's own machine (a
    second spawn where a world mixes them, side by side with the first): their step 1 is held to identical
    arithmetic, and half precision rounds at other places on another machine (ATen's half-precision kernels: bf16
    step-1 gradients 6e-3 apart between its default and AVX2 kernels; oneDNN's matrix products, by instruction
    set). A half-precision layout made with `elsewhere=True` runs on the other machine with its reference and
    twins, so the suite checks both machines' half-precision rounding too.
    capability=None: every layout here (no fork server).
    side_by_side: see start_layouts (False where a layout's check is timed). backend: the worlds' (dist_util)."""
    return start_layouts(layouts, world_size, collect, timeout, capability, side_by_side, backend).result()


class _Started:
    def __init__(self, n, worlds, half):
        self.n, self.worlds, self.half = n, worlds, half

    def result(self):
        from parity_check import twins
        for lay in self.half:  # the half-precision verdict's twins, computed here while the worlds run
            twins(lay)
        out, failed = [None] * self.n, None
        for which, world in self.worlds:  # every world waited for, the first failure raised after
            try:
                per_rank = world.result()
            except AssertionError as e:
                failed = failed or e
                continue
            for j, i in enumerate(which):
                out[i] = [r[j] for r in per_rank]
        if failed is not None:
            raise failed
        return out


def start_layouts(layouts, world_size, collect=None, timeout=420, capability=OTHER_CAPABILITY, side_by_side=True,
                  backend=None):
    """run_layouts without the wait: the references run here (the choices the world replays), then
    the world starts; `.result()` computes the half-precision layouts' twins (tests/support/parity_check.py) while it
    runs, waits for it and returns what run_layouts would. Independent
    worlds can so run side by side, and the test process can compute the next world's references
    (one thread) while this one runs. side_by_side (worlds of up to 4 ranks): the layouts of each
    machine run as two worlds at once, each started as soon as its references are there (a
    world's ranks wait on each other's collectives much of the time, leaving the cores idle: two
    worlds fill them, about 30% less wall time on the 2-core machine)."""
    for lay in layouts:
        assert lay.world_size == world_size, f"{lay.name} needs {lay.world_size} ranks, not {world_size}"
    elsewhere = [i for i, lay in enumerate(layouts) if lay.dtype == "fp32" or lay.elsewhere]
    groups = [(capability, elsewhere), (None, [i for i in range(len(layouts)) if i not in elsewhere])]
    if capability is None:
        assert not any(lay.elsewhere for lay in layouts), "a layout elsewhere needs the other machine's fork server"
        groups = [(None, list(range(len(layouts))))]
    if side_by_side and world_size <= 4:
        groups = [(cap, part) for cap, which in groups for part in (which[::2], which[1::2])]
    worlds = []
    for cap, which in groups:
        if which:
            decided = [reference(layouts[i])["decided"] for i in which]  # choices replayed where they are ties
            worlds.append((which, start_on_ranks(_run_all, world_size, [layouts[i] for i in which], collect,
                                                 decided, timeout=timeout, capability=cap, backend=backend)))
    return _Started(len(layouts), worlds, [lay for lay in layouts if lay.dtype != "fp32"])


_REFERENCES = {}


def _key(lay):
    return tuple(lay.reference_argv()), lay.entry, lay.datasets, lay.twin, lay.elsewhere


def _train_references(lays):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the spawned ranks; faster for these shapes too
    try:
        return [train(dataclasses.replace(lay, name="reference", flags=(), world_size=1, fault=None)) for lay in lays]
    finally:
        torch.set_num_threads(threads)


def references(lays):
    """The single-process runs for these layouts' base, dtype, twin and machine (cached per process): here, or
    those of layouts elsewhere in one one-rank world on the other machine."""
    todo = list({_key(lay): lay for lay in lays if _key(lay) not in _REFERENCES}.values())
    here = [lay for lay in todo if not lay.elsewhere]
    away = [lay for lay in todo if lay.elsewhere]
    got = _train_references(here)
    if away:
        got += run_on_ranks(_train_references, 1, away, timeout=300, capability=OTHER_CAPABILITY)[0]
    _REFERENCES.update(zip(map(_key, here + away), got))
    return [_REFERENCES[_key(lay)] for lay in lays]


def reference(lay):
    """The single-process run for this layout's base, dtype, twin and machine (cached per process)."""
    return references([lay])[0]


def check_reference(ref, margin=0.5):
    """The reference must learn: its loss falls by `margin` nats over the steps."""
    losses = ref["losses"]
    assert len(losses) >= STEPS and losses[0] - losses[-1] >= margin, \
        f"the reference does not learn (losses {losses}); a broken update could hide"
