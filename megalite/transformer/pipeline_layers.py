"""Which global layers a pipeline stage (and virtual chunk) builds.

Even split by default. `decoder_first/last_pipeline_num_layers` (Megatron's uneven split,
for stages on unequal devices) fix the first/last stage's count and divide the rest evenly
among the middle stages. With interleaving (virtual size v) the model is cut into PP x v
equal chunks and stage p holds chunks p, p + PP, p + 2PP, ...
Megatron's --pipeline-model-parallel-layout names every (virtual) stage's layers instead, so a
bigger GPU can take more: "E" embedding, "t" transformer layer, "L" loss, stages split by "|",
"m" a multi-token prediction layer (all of them with the loss, in the last stage: megalite has no standalone
MTP stage), "x*n" and "(...)*n" repeat, commas are cosmetic; PP x v stages in model order, stage s = vrank x PP +
pp rank (the loop), or as --pipeline-schedule zbv's V places them (megalite/parallel/pipeline_stages.py).
"""

import re

from megalite import parallel_state as ps
from megalite.config import ConfigError


def parse_pipeline_layout(text, pp, num_layers, mtp_num_layers=None):
    """Layers per stage of a --pipeline-model-parallel-layout string, in stage order (PP x v of
    them), validated: one line naming what is wrong."""
    flag = f"--pipeline-model-parallel-layout {text!r}"
    s = text.replace(",", "").replace(" ", "")
    s = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    s = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    stages = s.split("|")
    bad = sorted(set(s) - set("EtmL|"))
    if bad:
        raise ConfigError(f"{flag}: unknown layer symbols {bad}; use E (embedding), t (transformer layer), "
                          "m (multi-token prediction layer), L (loss)")
    if s.count("m") != (mtp_num_layers or 0):
        raise ConfigError(f"{flag} places {s.count('m')} multi-token prediction layers (m) but --mtp-num-layers is "
                          f"{mtp_num_layers or 0}")
    if "m" in s and not stages[-1].endswith("m" * s.count("m") + "L"):
        raise ConfigError(f"{flag}: the multi-token prediction layers (m) go together just before the loss L, in "
                          "the last stage (megalite has no standalone MTP stage)")
    if len(stages) % pp:
        raise ConfigError(f"{flag} has {len(stages)} stages, not a multiple of --pipeline-model-parallel-size {pp}")
    if s.count("E") != 1 or not stages[0].startswith("E"):
        raise ConfigError(f"{flag}: the embedding E must appear once, first in the first stage")
    if s.count("L") != 1 or not stages[-1].endswith("L"):
        raise ConfigError(f"{flag}: the loss L must appear once, last in the last stage")
    counts = [st.count("t") for st in stages]
    if sum(counts) != num_layers:
        raise ConfigError(f"{flag} places {sum(counts)} transformer layers (t) but --num-layers is {num_layers}")
    return counts


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


def split_layers(num_layers, pp, v=1, first=None, last=None, embedding=False, loss=False):
    """Megatron's split as layers per stage s = vrank x PP + pp rank: --num-virtual-stages-per-pipeline-rank
    v, with --decoder-first/last-pipeline-num-layers (each pipeline rank's layers split evenly over
    its v chunks), or with --account-for-embedding/loss-in-pipeline-split (the embedding and the
    loss count as one layer each: the first chunk of the first stage and the last chunk of the last
    build one layer fewer)."""
    if first is not None or last is not None:
        if embedding or loss:
            raise ConfigError("--account-for-embedding/loss-in-pipeline-split cannot be combined with "
                              "--decoder-first/last-pipeline-num-layers (as Megatron)")
        ranks = stage_layer_counts(num_layers, pp, first, last)
        if any(c % v for c in ranks):
            raise ConfigError(f"pipeline split {ranks} of --num-layers {num_layers} does not divide into {v} virtual "
                              "stages per pipeline rank")
        return [ranks[s % pp] // v for s in range(pp * v)]
    n = num_layers + int(embedding) + int(loss)
    if n % (pp * v):
        raise ConfigError(f"--num-layers {num_layers}{' + 1 (embedding)' if embedding else ''}"
                          f"{' + 1 (loss)' if loss else ''} = {n} is not divisible by --pipeline-model-parallel-size "
                          f"{pp} x {v} virtual stages")
    counts = [n // (pp * v)] * (pp * v)
    counts[0] -= int(embedding)
    counts[-1] -= int(loss)
    if min(counts) < 0:
        raise ConfigError(f"{n // (pp * v)} layer per virtual stage leaves no room for the embedding and the loss in "
                          "one stage; use fewer stages")
    return counts


def chunk_layers(config, pp_rank=None, vrank=None, grid=None):
    """(num_layers, layer_offset) of this rank's model chunk (of `grid`, default the global one)."""
    grid = ps.current_grid(grid)
    pp, v = grid.pp, grid.vpp
    pp_rank = grid.pp_rank if pp_rank is None else pp_rank
    vrank = grid.virtual_rank if vrank is None else vrank
    if config.pipeline_layout is not None:
        s = grid.stage_of(0 if v is None else vrank, pp_rank)
        return config.pipeline_layout[s], sum(config.pipeline_layout[:s])
    if v is None:
        counts = stage_layer_counts(config.num_layers, pp, config.decoder_first_pipeline_num_layers,
                                    config.decoder_last_pipeline_num_layers)
        return counts[pp_rank], sum(counts[:pp_rank])
    if config.num_layers % (pp * v):
        raise ConfigError(f"--num-layers {config.num_layers} is not divisible by pipeline size {pp} x virtual "
                          f"stages {v} = {pp * v}")
    per = config.num_layers // (pp * v)
    return per, grid.stage_of(vrank, pp_rank) * per
