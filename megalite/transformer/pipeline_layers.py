"""Which global layers a pipeline stage (and virtual chunk) builds.

Even split by default. `decoder_first/last_pipeline_num_layers` (Megatron's uneven split,
for stages on unequal devices) fix the first/last stage's count and divide the rest evenly
among the middle stages. With interleaving (virtual size v) the model is cut into PP x v
equal chunks and stage p holds chunks p, p + PP, p + 2PP, ...
"""

from megalite import parallel_state as ps
from megalite.config import ConfigError


def stage_layer_counts(num_layers, pp, first=None, last=None):
    """Layers per pipeline stage (non-interleaved), validated."""
    if first is None and last is None:
        if num_layers % pp:
            raise ConfigError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
                              "change one, or give --decoder-first/last-pipeline-num-layers")
        return [num_layers // pp] * pp
    counts = [None] * pp
    rest, middle = num_layers, pp
    if first is not None:
        counts[0], rest, middle = first, rest - first, middle - 1
    if last is not None:
        counts[-1], rest, middle = last, rest - last, middle - 1
    if pp == 1:
        raise ConfigError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
    if rest < 0 or (middle == 0 and rest != 0) or (middle > 0 and rest % middle):
        raise ConfigError(f"--num-layers {num_layers} with first stage {first} and last stage {last} layers leaves "
                          f"{rest} layers for {middle} middle stages: not an even split")
    counts = [c if c is not None else rest // middle for c in counts]
    if min(counts) < 1:
        raise ConfigError(f"pipeline split {counts} of --num-layers {num_layers} leaves a stage without layers; "
                          "every stage needs at least one")
    return counts


def chunk_layers(config, pp_rank=None, vrank=None):
    """(num_layers, layer_offset) of this rank's model chunk."""
    pp = ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
    v = ps.get_virtual_pipeline_model_parallel_world_size()
    if v is None:
        counts = stage_layer_counts(config.num_layers, pp, config.decoder_first_pipeline_num_layers,
                                    config.decoder_last_pipeline_num_layers)
        return counts[pp_rank], sum(counts[:pp_rank])
    vrank = ps.get_virtual_pipeline_model_parallel_rank() if vrank is None else vrank
    if config.num_layers % (pp * v):
        raise ConfigError(f"--num-layers {config.num_layers} is not divisible by pipeline size {pp} x virtual "
                          f"stages {v} = {pp * v}")
    per = config.num_layers // (pp * v)
    return per, (vrank * pp + pp_rank) * per
