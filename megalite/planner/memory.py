"""Bytes one rank keeps for its training state, predicted from the model built on the meta device at that
rank's grid (parallel_state.Grid.of) and megalite's own bucket and unit plans, so that the prediction is
what `optimizer/memory.py`'s training_state_bytes measures after a step, to the byte:

  weights    the model's parameters (ZeRO-1/2: the flat parameter buffer of the padded buckets; ZeRO-3:
             each bucket's 1/d shard, plus the one-element stand-in the released parameters point at);
             parameters without gradients (the experts' routing bias) whole
  gradients  fp32: the padded buckets (plain and ZeRO-1), each bucket's 1/d shard accumulator (ZeRO-2/3;
             their full-size buffers live only while a reduction needs them)
  optimizer  the optimizer's states in fp32 for the elements this rank steps (all, or its ZeRO shard): Adam's
             m and v, SGD's / Muon's momentum, Lion's m (--optimizer muon: Muon's for the hidden matrices,
             --muon-scalar-optimizer's for the rest); fp32 main parameters for them in bf16 / fp16 models,
             and each flat group's step counter

Dense parameters shard over DP x CP, experts over expert-DP (param_facts); the word embedding tied across
pipeline stages sits alone in a bucket, as grad_buffer does it."""

import dataclasses
import operator

from megalite import parallel_state as ps
from megalite.config import ConfigError
from megalite.distributed.grad_buffer import plan_reduction, tied_weight
from megalite.distributed.param_facts import derive
from megalite.batching.iteration_plan import batch_schedule, reduces_once, training_plan
from megalite.optimizer.muon import is_muon_matrix
from megalite.optimizer.offload import host_split
from megalite.optimizer.optimizer import no_weight_decay
from megalite.optimizer.updates import STATE_KEYS
from megalite.transformer.pipeline_layers import chunk_layers

FP32 = 4


@dataclasses.dataclass
class StateBytes:
    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    stepped: dict = dataclasses.field(default_factory=dict)  # elements this rank steps, per optimizer (no bytes)
    host_elements: int = 0  # of those, stepped on the host (--optimizer-cpu-offload)
    host: int = 0  # bytes of `optimizer` in host memory (their fp32 main values and states)

    @property
    def total(self):
        return self.weights + self.gradients + self.optimizer


_BUILT = {}  # (model, layout, coordinates) -> chunks: a search prices many layouts of the same shapes
_STATES = {}  # (chunks, ZeRO, precision, data-parallel coordinates ...) -> StateBytes
_PLANS = {}  # (chunk, ZeRO, bucket size, data-parallel coordinates) -> its buckets (state and traffic both ask)


def build_chunks(mcfg, grid, model_class=None):
    """This rank's model chunks (one per virtual stage) on the meta device (cached by what sets their shapes:
    not recomputation, not the data-parallel or context-parallel sizes)."""
    from megalite.models.gpt import GPTModel
    model_class = model_class or GPTModel
    spans = tuple(chunk_layers(mcfg, grid.pp_rank, j, grid) for j in range(grid.vpp or 1))  # (layers, offset) each
    key = (_shape_key(mcfg), spans, model_class, grid.tp, grid.pp, grid.vpp, grid.experts, grid.ep, grid.etp,
           grid.tp_rank, grid.pp_rank, grid.ep_rank, grid.etp_rank, grid.pipeline_placement)
    if key not in _BUILT:
        if len(_BUILT) > 256:
            _BUILT.clear()
            _STATES.clear()  # (keyed by the built chunks' identity)
            _PLANS.clear()
            _COUNTS.clear()
            _ROUTERS.clear()
        _BUILT[key] = _build(mcfg, grid, model_class)
    return _BUILT[key]


# config class -> a getter of its fields that shape this rank's chunks: not recomputation's, and not the split of
# the layers over the stages (the key holds this rank's own spans instead: layouts that give a stage the same
# layers share its chunks)
_SHAPE_FIELDS = {}
_NOT_SHAPES = ("recompute_granularity", "recompute_method", "recompute_num_layers", "pipeline_layout",
               "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
_COUNTS = {}  # id(chunk) -> chunk_numels(chunk) (cleared with _BUILT, which keeps the chunks alive)
_ROUTERS = {}  # id(chunk) -> chunk_routers(chunk) (the same)


def _shape_key(mcfg):
    kind = type(mcfg)
    if kind not in _SHAPE_FIELDS:
        _SHAPE_FIELDS[kind] = operator.attrgetter(*(f.name for f in dataclasses.fields(mcfg)
                                                    if f.name not in _NOT_SHAPES))
    return kind, repr(_SHAPE_FIELDS[kind](mcfg))


def chunk_numels(chunk):
    """(elements in its transformer layers, elements in all, its number of layers) of a chunk from build_chunks."""
    if id(chunk) not in _COUNTS:
        inside = sum(p.numel() for n, p in chunk.named_parameters() if ".layers." in n)
        _COUNTS[id(chunk)] = inside, sum(p.numel() for p in chunk.parameters()), len(chunk.decoder.layers)
    return _COUNTS[id(chunk)]


def chunk_routers(chunk):
    """The MoE layers (routers) of a chunk from build_chunks (a search asks for every layout it prices)."""
    if id(chunk) not in _ROUTERS:
        _ROUTERS[id(chunk)] = sum(1 for name, _ in chunk.named_modules() if name.endswith(".mlp.router"))
    return _ROUTERS[id(chunk)]


def _build(mcfg, grid, model_class):
    v, chunks = grid.vpp or 1, []
    with ps.meta_init():
        for j in range(v):
            n, offset = chunk_layers(mcfg, grid.pp_rank, j, grid)
            pre, post = grid.stage_of(j) == 0, grid.stage_of(j) == grid.pp * v - 1
            chunks.append(model_class(mcfg, pre_process=pre, post_process=post, num_layers=n, layer_offset=offset,
                                      grid=grid))
    return chunks


def _tied(model, grid):
    return tied_weight(model, grid.pp)


def _buckets(model, grid, zero, bucket_size):
    """[(params, padded numel, shard group size, this rank's index in it)]: DistributedDataParallel's own plan
    (grad_buffer.plan_reduction) with the groups' sizes and this rank's place from the grid (cached: a search
    asks for the same chunk's plan many times)."""
    key = (id(model), zero, bucket_size, grid.dp, grid.cp, grid.dp_rank, grid.cp_rank, grid.edp, grid.edp_rank,
           grid.experts, grid.pp)
    if key not in _PLANS:
        if len(_PLANS) > 4096:
            _PLANS.clear()
        _PLANS[key] = _plan_buckets(model, grid, zero, bucket_size)
    return _PLANS[key]


def _plan_buckets(model, grid, zero, bucket_size):
    facts = {p: derive(p, grid) for p in model.parameters() if p.requires_grad}  # as DDP stamps them in this grid
    plan = plan_reduction(model, list(facts), bucket_size, zero, lambda p: facts[p].data_parallel,
                          lambda p: facts[p].expert, None, _tied(model, grid) if zero else None)
    return [(b, n, d, r) for b, n, (_, d, r) in plan]


def zero_as_run(cfg):
    """The ZeRO stage the run's gradient reduction behaves as (0: plain DP): ZeRO-2 as ZeRO-1 where it reduces
    once per iteration, its ranks running different micro-batch counts (iteration_plan.reduces_once): the full
    fp32 gradients accumulated over the iteration, one reduce-scatter."""
    zero = (cfg.zero_stage or 1) if cfg.use_distributed_optimizer else 0
    if zero == 2 and (cfg.data_parallel_shares or cfg.data_parallel_micro_batch_sizes):
        batching = cfg.batching
        if reduces_once(batching, training_plan(batching, batch_schedule(batching))):
            return 1
    return zero


def training_state(cfg, mcfg, grid):
    """StateBytes of the rank at `grid`'s coordinates for the run `cfg` describes (after a step: a ZeRO-2 that
    reduces once has released its full-size gradients again, cost.py counts them as a buffer), in its DP
    replica's precision (--data-parallel-precisions)."""
    cfg = cfg.at_rank(grid.dp_rank)
    zero = (cfg.zero_stage or 1) if cfg.use_distributed_optimizer else 0
    low = bool(cfg.bf16 or cfg.fp16)
    chunks = build_chunks(mcfg, grid)
    offload = _offload_fraction(cfg, grid)
    key = (id(chunks), zero, low, cfg.ddp_bucket_size, cfg.decoupled_lr is not None, grid.dp, grid.cp, grid.dp_rank,
           grid.cp_rank, grid.edp, grid.edp_rank, cfg.optimizer, cfg.muon_scalar_optimizer, offload)
    if key not in _STATES:
        if len(_STATES) > 4096:
            _STATES.clear()
        _STATES[key] = _state(cfg, chunks, grid, zero, low, offload)
    return dataclasses.replace(_STATES[key])


OFFLOAD_AUTO = ("the planner prices a given --optimizer-offload-fraction, not auto (sized at start to "
                "--device-memory-budget): give the fraction")


def _offload_fraction(cfg, grid):
    """This rank's --optimizer-offload-fraction (0 without --optimizer-cpu-offload; a list: its DP replica's)."""
    f = cfg.optimizer_offload_fraction if cfg.optimizer_cpu_offload else 0.0
    if f == "auto":
        raise ConfigError(OFFLOAD_AUTO)
    return float(f[grid.dp_rank] if isinstance(f, (list, tuple)) else f)


def _state(cfg, chunks, grid, zero, low, offload=0.0):
    dtype_bytes = 2 if low else FP32
    out, kinds, groups = StateBytes(), set(), {}
    for model in chunks:
        names = {p: n for n, p in model.named_parameters()}
        out.weights += sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
        plan = _buckets(model, grid, zero, cfg.ddp_bucket_size)
        total = sum(n for _, n, _, _ in plan)
        if not zero:
            out.weights += sum(p.numel() for b, _, _, _ in plan for p in b) * dtype_bytes
            out.gradients += total * FP32
            owned = [(p, p.numel()) for b, _, _, _ in plan for p in b]
        else:
            owned = []
            for params, n, d, r in plan:
                lo, hi, offset = r * (n // d), (r + 1) * (n // d), 0
                for p in params:
                    a, b = max(offset, lo), min(offset + p.numel(), hi)
                    if b > a:
                        owned.append((p, b - a))
                    offset += p.numel()
            out.gradients += (total if zero == 1 else sum(n // d for _, n, d, _ in plan)) * FP32
            out.weights += (total if zero < 3 else sum(n // d for _, n, d, _ in plan)) * dtype_bytes
            if zero == 3:
                out.weights += len(plan) * dtype_bytes  # each bucket's released parameters share one element
        for p, k in owned:
            kind = optimizer_of(cfg, p)
            out.stepped[kind] = out.stepped.get(kind, 0) + k
            out.optimizer += k * len(STATE_KEYS[kind]) * FP32 + (k * FP32 if low else 0)
            decay = not no_weight_decay(names[p], p, getattr(cfg, "apply_wd_to_qk_layernorm", False))
            groups.setdefault((kind, decay, _decoupled(cfg, p)), []).append(k)
    for key, sizes in groups.items():  # offload: whole parameters from the front of each group
        kind = key[0]
        host = sum(sizes[i] for i in host_split(range(len(sizes)), sizes, offload)[0]) if offload else 0
        kinds |= {(key, part) for part, n in (("device", sum(sizes) - host), ("host", host)) if n}
        out.host_elements += host
        out.host += host * (len(STATE_KEYS[kind]) + 1) * FP32  # the states and the fp32 main values
        out.optimizer += 0 if low else host * FP32  # an fp32 model's host part steps copies of its weights
    out.optimizer += len(kinds) * FP32  # one step counter per flat group
    return out


def optimizer_of(cfg, p):
    """Which optimizer steps p (optimizer.py's groups)."""
    if cfg.optimizer != "muon":
        return cfg.optimizer
    return "muon" if is_muon_matrix(p) else cfg.muon_scalar_optimizer


def _decoupled(cfg, p):
    return cfg.decoupled_lr is not None and bool(getattr(p, "is_embedding_or_output_parameter", False))
