"""This rank's training state as checkpoint entries (tensors) and JSON (everything else).

Tensors: the model's parameters under their global names, and the optimizer's fp32 state
under "optimizer.<state>.<name>" (<state>: torch's names, exp_avg and exp_avg_sq for AdamW,
momentum_buffer for SGD and Muon, exp_avg for Lion; main_param), both as chunks of the global
tensors (layout.py), whether the optimizer is plain (every DP rank holds all of it, DP
rank 0 writes) or ZeRO (each DP rank writes the slices it owns). main_param is stored only
when the model computes in bf16/fp16 (an fp32 model steps its own parameters).
"""

import base64

import numpy as np
import torch

from megalite import parallel_state as ps
from megalite.checkpoint.layout import ParamLayout
from megalite.checkpoint.planner import Entry
from megalite.tensor_parallel.random import get_rng_states, set_rng_states


def _module(chunk):
    return getattr(chunk, "module", chunk)


def _layouts(chunks):
    return {p: ParamLayout(n, p) for c in chunks for n, p in _module(c).named_parameters()}


def _add(entries, name, layout, dtype, chunks):
    if chunks:
        entries.setdefault(name, Entry(layout.global_shape, dtype)).chunks.extend(chunks)


def _weight_slots(chunks):
    """[(layout, flat tensor, local start, end, sharded over DP x CP)]: ZeRO-3's own shards of
    its parameters (the whole ones exist only while gathered), every other parameter whole."""
    layouts, slots, sharded = _layouts(chunks), [], set()
    for c in chunks:
        if getattr(c, "units", None) is None:
            continue
        for b in c.buckets:
            sharded.update(b.params)
            slots += [(layouts[pc.param], pc.data, pc.start, pc.end, True) for pc in b.pieces]
    return slots + [(lay, p.detach().view(-1), 0, p.numel(), False)
                    for p, lay in layouts.items() if p not in sharded]


def model_entries(chunks, for_save):
    """Save: what this rank writes. Load: everything this rank holds."""
    # The first replica over DP x CP (experts: expert-DP) writes (CP ranks hold the same weights);
    # a ZeRO-3 shard's owner; of semi-synchronous replicas (saved at outer steps: the same global
    # weights in each) the first.
    entries, first_of_replicas = {}, ps.grid_of(chunks).replica_rank == 0
    for lay, t, start, end, sharded in _weight_slots(chunks):
        if for_save and not (lay.owner and (sharded or lay.first_replica) and first_of_replicas):
            continue
        _add(entries, lay.name, lay, t.dtype, lay.chunks(t, start, end))
    return entries


def opt_state(optimizer, main):
    """The optimizer state of a main parameter, created (zeros, step 0) if it has none yet."""
    st = optimizer.optimizer.state[main]
    if not st:
        st["step"] = torch.tensor(0.0, dtype=torch.float32)
        for k in optimizer.state_keys(main):
            st[k] = torch.zeros_like(main, memory_format=torch.contiguous_format)
    return st


def _optimizer_slots(optimizer, chunks):
    """[(layout, main param (flat view), local start, end, is_separate_main)] of this rank."""
    layouts = _layouts(chunks)
    if hasattr(optimizer, "pieces"):  # ZeRO: this rank's slices
        return [(layouts[pc.param], mp, pc.start, pc.end, mp is not pc.data)
                for pc, mp in zip(optimizer.pieces, optimizer.main_params)]
    return [(layouts[p], mp, 0, p.numel(), mp is not p) for p, mp in zip(optimizer.model_params, optimizer.main_params)]


def optimizer_entries(optimizer, chunks, for_save, prefix=""):
    """prefix: a semi-synchronous replica's ("replica<r>." for r > 0: each keeps its inner state)."""
    entries = {}
    sharded = hasattr(optimizer, "pieces")  # ZeRO: each shard's owner writes it
    for lay, mp, start, end, separate in _optimizer_slots(optimizer, chunks):
        if for_save and not (lay.owner and (sharded or lay.first_replica)):
            continue
        st = opt_state(optimizer, mp)
        tensors = {k: st[k] for k in optimizer.state_keys(mp)}
        if separate:
            tensors["main_param"] = mp
        for k, t in tensors.items():
            _add(entries, f"{prefix}optimizer.{k}.{lay.name}", lay, torch.float32,
                 lay.chunks(t.detach().view(-1), start, end))
    return entries


def outer_momentum_entries(optimizer, chunks, for_save):
    """DiLoCo's outer momentum ("semi_sync.momentum.<name>", laid out as the main params; the same in
    every replica: the first writes it). Created (zeros) to load into when there is none yet."""
    semi = getattr(optimizer, "semi_sync", None)
    if semi is None or not semi.momentum or (for_save and (semi.buf is None or ps.grid_of(chunks).replica_rank != 0)):
        return {}
    if semi.buf is None:
        semi.buf = [torch.zeros_like(g) for g in semi.glob]
    entries, sharded = {}, hasattr(optimizer, "pieces")
    for (lay, _, start, end, _), buf in zip(_optimizer_slots(optimizer, chunks), semi.buf):
        if not for_save or (lay.owner and (sharded or lay.first_replica)):
            _add(entries, f"semi_sync.momentum.{lay.name}", lay, torch.float32,
                 lay.chunks(buf.detach().view(-1), start, end))
    return entries


def main_params_from_model(optimizer):
    """After loading weights without optimizer state: fp32 main params = model weights."""
    with torch.no_grad():
        if hasattr(optimizer, "pieces"):
            for pc, mp in zip(optimizer.pieces, optimizer.main_params):
                if mp is not pc.data:
                    mp.copy_(pc.data)
        else:
            for p, mp in zip(optimizer.model_params, optimizer.main_params):
                if mp is not p:
                    mp.copy_(p)


def model_from_main_params(optimizer):
    """After loading fp32 main params: the model computes with their rounded values."""
    with torch.no_grad():
        if hasattr(optimizer, "pieces"):
            for pc, mp in zip(optimizer.pieces, optimizer.main_params):
                if mp is not pc.data:
                    pc.data.copy_(mp)
            optimizer._publish()  # every DP rank's model takes the owners' slices
        else:
            for p, mp in zip(optimizer.model_params, optimizer.main_params):
                if mp is not p:
                    p.copy_(mp)


def optimizer_step(optimizer):
    steps = {float(st["step"]) for st in optimizer.optimizer.state.values() if "step" in st}
    return max(steps) if steps else 0.0


def set_optimizer_step(optimizer, chunks, step):
    for _, mp, _, _, _ in _optimizer_slots(optimizer, chunks):
        opt_state(optimizer, mp)["step"] = torch.tensor(float(step), dtype=torch.float32)


# -- RNG: per rank, as JSON ----------------------------------------------------------------
def _b64(t):
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s):
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state():
    """get_rng_states() as JSON (a checkpoint's rng/rank_<r>.json)."""
    s = get_rng_states()
    version, internal, gauss = s["python"]
    kind, keys, pos, has_gauss, cached = s["numpy"]
    return {"python": [version, list(internal), gauss],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": _b64(s["torch"]), "cuda": [_b64(x) for x in s["cuda"]],
            "tracker": {k: _b64(v) for k, v in s["tracker"].items()}}


def set_rng_state(s):
    """The streams of a checkpoint's rng_state() JSON restored (set_rng_states)."""
    version, internal, gauss = s["python"]
    kind, keys, pos, has_gauss, cached = s["numpy"]
    set_rng_states({"python": (version, tuple(internal), gauss),
                    "numpy": (kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached),
                    "torch": _unb64(s["torch"]), "cuda": [_unb64(x) for x in s["cuda"]],
                    "tracker": {k: _unb64(v) for k, v in s["tracker"].items()}})  # CPU byte states


def fp8_sites(chunks):
    """{module name: its FP8 site} of the delayed-scaling linear layers (names carry global layer numbers)."""
    return {n: m.fp8 for c in chunks for n, m in _module(c).named_modules()
            if getattr(m, "fp8", None) is not None and m.fp8.recipe == "delayed"}


def fp8_state(chunks):
    """This rank's FP8 amax histories, by module name (JSON)."""
    return {n: s.state_dict() for n, s in fp8_sites(chunks).items()}


def set_fp8_state(chunks, saved, prefix=""):
    """The histories of `saved` ({module name: history}, every rank's merged) for the sites this rank holds (prefix:
    a semi-synchronous replica's names)."""
    for n, s in fp8_sites(chunks).items():
        if prefix + n in saved:
            s.load_state_dict(saved[prefix + n])
