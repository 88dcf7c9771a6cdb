"""Layers per pipeline stage for a cluster: what `--pipeline-model-parallel-layout auto` measures at run time
(megalite/pipeline/auto_layout.py), predicted instead. Each stage's per-layer and fixed seconds come from the
cost model on that stage's slowest GPU, its per-layer and fixed bytes from the model built on meta at an even
split, its budget from its smallest GPU; auto_layout's own min-max cut (balanced_counts) then chooses the
counts, so a stage of RTX 3090s takes fewer layers than one of A100s, and the embedding's and the loss's
stages fewer than the middle ones."""

from megalite import parallel_state as ps
from megalite.pipeline.auto_layout import Stage, balanced_counts
from megalite.planner import activations, memory

GiB = 1 << 30


def stage_gpus(layout, cluster, i):
    per = layout.world // layout.pp
    return [cluster.gpus[r] for r in range(i * per, (i + 1) * per)]


def balance(cfg, mcfg, layout, cluster, stage_seconds, in_flight, reserved, fragmentation):
    """Layers per stage (ConfigError where no cut fits). stage_seconds(i, gpu, layers, last) -> seconds of
    one micro-batch's forward and backward; in_flight(i) -> micro-batches stage i holds."""
    e = 2 if (cfg.bf16 or cfg.fp16) else 4
    stages = []
    for i in range(layout.pp):
        gpus = stage_gpus(layout, cluster, i)
        slow, small = min(gpus, key=lambda g: g.peak_tflops), min(gpus, key=lambda g: g.memory_gib)
        last = i == layout.pp - 1
        fixed = stage_seconds(i, slow, 0, last)
        per_layer = stage_seconds(i, slow, 1, last) - fixed
        grid = ps.Grid.of(layout.tp, layout.pp, layout.dp, layout.cp, None, layout.ep,
                          layout.expert_tp if layout.ep else None, pp_rank=i)
        state = memory.training_state(cfg, mcfg, grid)
        inside, everything, layers = memory.chunk_numels(memory.build_chunks(mcfg, grid)[0])
        layers = max(1, layers)
        per_param = state.total / max(1, everything)
        every = range(1, mcfg.num_layers + 1)
        act_layer = sum(activations.layers_bytes(mcfg, grid, layout.micro, e, "triton", every)) / mcfg.num_layers \
            if mcfg.recompute_granularity != "full" else \
            layout.micro * mcfg.seq_length // layout.cp * mcfg.hidden_size * e
        act_fixed = activations.chunk_bytes(mcfg, grid, layout.micro, e, 0, i == 0, last,
                                            _padded_vocab(mcfg, layout.tp))
        stages.append(Stage(per_layer, fixed, (everything - inside) * per_param, inside / layers * per_param,
                            act_fixed, act_layer, in_flight(i),
                            (1 - fragmentation) * small.memory_gib * GiB - reserved))
    return balanced_counts(stages, mcfg.num_layers)


def _padded_vocab(c, tp):
    from megalite.tensor_parallel.layers import padded_vocab_size
    return padded_vocab_size(c.vocab_size, c.make_vocab_size_divisible_by, tp)
