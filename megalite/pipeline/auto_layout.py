"""--pipeline-model-parallel-layout auto: pipeline stages balanced by measurement.

The model is first built at a near-even split. Before training, every rank runs a few forward-
backward passes of its real schedule on the run's own first samples (nothing stepped, gradients
zeroed, the random state put back, the data read again by training) and measures, on its own
device:
  - T: seconds of compute per micro-batch (forward + backward, without the pipeline's waits), and
    f: the share of the forward spent in the transformer layers, so that a layer costs u = T f / n
    seconds here and the rest (embedding, output layer and loss where they sit) e = T (1 - f);
  - bytes: the training state on the device (weights, gradients, the optimizer's part), split
    between the layers and the rest in proportion to their parameters, and the bytes autograd saves
    for backward per micro-batch inside the layers and outside them (saved-tensor hooks), of which
    a 1F1B stage holds min(PP - stage, micro-batches) at once.
Every rank gathers every rank's row; a stage is as slow and as large as its slowest and largest
rank (TP, CP, DP), and its budget is its smallest (--device-memory-budget: one value or one per
stage; CUDA default: 0.9 x what the process may hold: the free memory and what torch has
reserved). On CUDA too the activation bytes are those saved for backward, not the allocator's peak
(which cannot be split by layer). The layers (all alike: MoE is refused) are
then cut into contiguous stages minimising the slowest stage's time e_s + n_s u_s within each
stage's budget, n_s >= 1: one layer at a time to the stage whose time grows least (optimal for a
bottleneck of increasing costs; ties to the lower stage, so every rank derives the same cut). The
model is rebuilt at that cut; initialisation does not depend on the layout and --load re-shards
any layout, so the layers arrive on their new stages as if the run had started there.
"""

import contextlib
import itertools
import time

import torch

from megalite import parallel_state as ps
from megalite.config import ConfigError
from megalite.tensor_parallel.random import get_rng_states, set_rng_states

GIB = 2 ** 30


def free_memory():
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def initial_counts(num_layers, pp):
    """The near-even split the profile runs at (earlier stages take the remainder)."""
    return [num_layers // pp + (s < num_layers % pp) for s in range(pp)]


def layout_string(counts):
    """Megatron's --pipeline-model-parallel-layout for one chunk per stage, e.g. 'Et*3|tL'."""
    def t(n):
        return "t" * n if n <= 2 else f"t*{n}"
    inner = [t(n) for n in counts]
    inner[0] = "E" + inner[0]
    inner[-1] = inner[-1] + "L"
    return "|".join(inner)


class Stage:
    """One pipeline stage's measured costs (the slowest / largest of its ranks)."""

    def __init__(self, u, e, state_fixed, state_layer, act_fixed, act_layer, in_flight, budget):
        self.u, self.e = u, e
        self.state_fixed, self.state_layer = state_fixed, state_layer
        self.act_fixed, self.act_layer, self.in_flight = act_fixed, act_layer, in_flight
        self.budget = budget

    def seconds(self, n):
        return self.e + n * self.u

    def need(self, n):
        return self.state_fixed + n * self.state_layer + self.in_flight * (self.act_fixed + n * self.act_layer)

    def fits(self, n):
        return self.budget is None or self.need(n) <= self.budget


def balanced_counts(stages, num_layers):
    """Layers per stage minimising the slowest stage's time within every stage's budget (module
    docstring); one ConfigError line where the budgets cannot hold the model."""
    for s, st in enumerate(stages):
        if not st.fits(1):
            raise ConfigError(f"--device-memory-budget: pipeline stage {s} ({st.budget / GIB:.4g} GiB) cannot hold "
                              f"even one layer: it needs {st.need(1) / GIB:.4g} GiB with one "
                              f"({st.state_layer / GIB:.4g} GiB of state and {st.act_layer / GIB:.4g} GiB of "
                              f"activations per layer, x{st.in_flight} micro-batches in flight)")
    counts = [1] * len(stages)
    if num_layers < len(stages):
        raise ConfigError(f"--pipeline-model-parallel-layout auto: --num-layers {num_layers} leaves a stage of "
                          f"{len(stages)} without layers; use at most {num_layers} stages")
    for _ in range(num_layers - len(stages)):
        open_ = [s for s, st in enumerate(stages) if st.fits(counts[s] + 1)]
        if not open_:
            raise ConfigError(f"--device-memory-budget: the pipeline stages' budgets hold only {sum(counts)} of "
                              f"--num-layers {num_layers} layers; give more memory, stages or offload")
        s = min(open_, key=lambda s: (stages[s].seconds(counts[s] + 1), s))
        counts[s] += 1
    return counts


def stages_from_rows(rows, pp):
    """Per stage, the slowest and largest of its ranks' rows (see measure_rank), the smallest budget."""
    out = []
    for s in range(pp):
        mine = [r for r in rows if int(r[0]) == s]
        budgets = [r[8] for r in mine if r[8] > 0]
        out.append(Stage(*(max(r[i] for r in mine) for i in range(1, 8)), budget=min(budgets) if budgets else None))
    return out


def transformer_layers(chunks):
    """This rank's transformer layers (GPT's decoder, BERT's encoder)."""
    from megalite.transformer.block import TransformerBlock
    return [layer for c in chunks for b in c.modules() if isinstance(b, TransformerBlock)
            for layer in b.layers.values()]


class _Probe:
    """One profiling pass on this rank: forward / backward seconds of the schedule's ops (waits for
    other stages excluded), forward seconds inside the transformer layers, and the bytes autograd
    saves for backward inside and outside them (weights excluded: they are state; a storage saved
    twice within one micro-batch counted once)."""

    def __init__(self, chunks):
        self.seconds = {"F": 0.0, "B": 0.0, "layers": 0.0}
        self.bytes = {"layers": 0, "fixed": 0}
        self.params = [p for c in chunks for p in c.parameters()]
        self.layers = transformer_layers(chunks)
        self.seen, self.inside, self.kind = set(), None, None

    def clock(self):
        if ps.get_device().type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def op(self, kind):
        self.kind, self.seen = kind, set(self.weights)
        start = self.clock()
        yield
        self.seconds[kind] += self.clock() - start
        self.kind = None

    def pre(self, module, args):
        if self.kind == "F":  # (not a recomputation in backward)
            self.inside = self.clock()
            # weights are state, not activations (ZeRO-3's are gathered into new storage by now)
            self.seen.update(p.untyped_storage().data_ptr() for p in module.parameters())

    def post(self, module, args, output):
        if self.kind == "F":
            self.seconds["layers"] += self.clock() - self.inside
            self.inside = None

    def pack(self, t):
        s = t.untyped_storage()
        if self.kind == "F" and s.data_ptr() not in self.seen and not isinstance(t, torch.nn.Parameter):
            self.seen.add(s.data_ptr())
            self.bytes["fixed" if self.inside is None else "layers"] += s.nbytes()
        return t

    @contextlib.contextmanager
    def installed(self):
        """The layers' hooks and the saved-tensor hook, while the schedule runs with `self.op` as its timer."""
        self.weights = {p.untyped_storage().data_ptr() for p in self.params}
        handles = [h for m in self.layers for h in (m.register_forward_pre_hook(self.pre),
                                                     m.register_forward_hook(self.post))]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
                yield
        finally:
            for h in handles:
                h.remove()


@contextlib.contextmanager
def _random_state_kept():
    """Profiling draws (dropout) must not move the run's random streams (every stream of the process)."""
    state = get_rng_states()
    try:
        yield
    finally:
        set_rng_states(state)


def measure_rank(cfg, plan, mcfg, chunks, optimizer, dataset, forward_step_func):
    """This rank's row: [stage, u, e, state fixed, state per layer, act fixed, act per layer (bytes per
    micro-batch), in flight, budget (0: none)], from --pipeline-layout-profile-iters passes of one
    iteration's micro-batches (the fastest pass's times; bytes are the same in every pass). cfg: the
    AutoLayoutConfig (config/pipeline.py)."""
    from megalite.batching.data_iterators import data_iterators
    from megalite.distributed import finalize_model_grads
    from megalite.pipeline.schedules import run_forward_backward
    from megalite.optimizer.memory import state_bytes_by_place
    from megalite.pipeline.schedules import pipeline_tensor_shape
    from megalite.rerun import _reset_model_state, _save_model_state
    grid = ps.grid_of(chunks)
    dp_rank = grid.data_rank()
    micro, count = plan.micro_of(dp_rank), plan.counts_of(plan.schedule.final)[dp_rank]
    best, saved = None, _save_model_state(chunks)
    for _ in range(cfg.pipeline_layout_profile_iters):
        probe = _Probe(chunks)
        # the batches read before timing (a loader's start-up is not compute)
        its = [None if it is None else iter(list(itertools.islice(it, count)))
               for it in data_iterators(dataset, 0, cfg.loader, chunks, micro_batch_size=micro)]
        with _random_state_kept(), probe.installed():
            run_forward_backward(forward_step_func, its, chunks, count, pipeline_tensor_shape(mcfg, micro, grid),
                                 mcfg.params_dtype, loss_scale=optimizer.loss_scale, loss_divisor=count,
                                 timer=probe.op)
        finalize_model_grads(chunks)  # the reductions it started end here, as after a training step
        _reset_model_state(chunks, saved)  # --grad-compression's error feedback as before
        for c in chunks:
            c.zero_grad_buffer()
        if best is None or probe.seconds["F"] + probe.seconds["B"] < best.seconds["F"] + best.seconds["B"]:
            best = probe
    n = len(best.layers)
    per_mb = (best.seconds["F"] + best.seconds["B"]) / count
    share = min(1.0, best.seconds["layers"] / max(best.seconds["F"], 1e-12))  # of the forward, in the layers
    states = state_bytes_by_place(chunks, optimizer)[0]
    numel = [sum(p.numel() for p in m.parameters()) for m in (*best.layers, *chunks)]
    in_layers = sum(numel[:n]) / max(sum(numel[n:]), 1)
    pp, stage = grid.pp, grid.pp_rank
    budget = (cfg.device_memory_budget[stage] * GIB if cfg.device_memory_budget else  # CUDA: all it may use
              0.9 * (torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()) if ps.get_device().type == "cuda"
              else 0)
    return [stage, per_mb * share / n, per_mb * (1 - share), states * (1 - in_layers), states * in_layers / n,
            best.bytes["fixed"] / count, best.bytes["layers"] / count / n, min(pp - stage, count), budget]


def measure_and_choose(cfg, plan, mcfg, chunks, optimizer, dataset, forward_step_func):
    """(the stages as measured, the balanced layout: layers per stage), the same on every rank (collective)."""
    from megalite.distributed.collectives import gather_rows
    rows = gather_rows(measure_rank(cfg, plan, mcfg, chunks, optimizer, dataset, forward_step_func))
    stages = stages_from_rows(rows, ps.grid_of(chunks).pp)
    counts = balanced_counts(stages, cfg.num_layers)
    return stages, counts


def report(stages, counts):
    from megalite.logger import print_rank_last
    print_rank_last("megalite: pipeline layout auto: ms per layer by stage [" +
                    ", ".join(f"{st.u * 1e3:.2f}" for st in stages) + "], ms outside the layers [" +
                    ", ".join(f"{st.e * 1e3:.2f}" for st in stages) + "], GiB needed / budget [" +
                    ", ".join(f"{st.need(n) / GIB:.3g}/{'-' if st.budget is None else f'{st.budget / GIB:.3g}'}"
                              for st, n in zip(stages, counts)) +
                    f"] -> --pipeline-model-parallel-layout '{layout_string(counts)}'")
