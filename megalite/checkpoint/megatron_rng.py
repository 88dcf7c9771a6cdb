"""Megatron-LM's RNG states, restored where they map (`--load` on a Megatron-LM directory, unless --no-load-rng or
--finetune).

Megatron-LM saves, per pipeline x tensor rank, the streams of its data-parallel rank 0 (of every data-parallel rank
with --data-parallel-random-init) as one item, `rng_state/shard_<pp>.<tp>_<PP>.<TP>`: Python's `random`, numpy's
global generator, torch's CPU generator, the current CUDA device's generator and its CUDA RNG tracker's streams
('model-parallel-rng': dropout inside tensor-parallel regions). megalite seeds and uses the same streams (the
tracker's seed is Megatron's, megalite/tensor_parallel/random.py), so at the same TP x PP each rank takes its
coordinates' states: the CPU ones always, the CUDA ones when the run is on CUDA. At another TP x PP, as Megatron-LM
itself, none is restored; what is not is said in one line."""

import random

import numpy as np
import torch

from megalite.checkpoint.storage import CheckpointError


def rng_key(pp_rank, tp_rank, pp, tp):
    """The item's key (megatron-core's ShardedObject naming: offsets and shape over (PP, TP))."""
    return f"rng_state/shard_{pp_rank}.{tp_rank}_{pp}.{tp}"


def restore(ckpt, grid, on_cuda, log):
    """Set this rank's streams from `ckpt` (a MegatronCheckpoint) at its grid coordinates; log(message) the line
    saying what was not restored (the caller prints it once). Returns the names of the streams restored."""
    a = ckpt.args
    tp, pp = int(a.tensor_model_parallel_size), int(a.pipeline_model_parallel_size)
    if (grid.tp, grid.pp) != (tp, pp):
        log(f"megalite: Megatron-LM's RNG states not restored (saved at TP {tp} x PP {pp}, this run is at TP "
            f"{grid.tp} x PP {grid.pp}, as Megatron-LM would not either): random streams restart from --seed")
        return []
    key = rng_key(grid.pp_rank, grid.tp_rank, pp, tp)
    if key not in ckpt.items:
        log("megalite: the Megatron-LM checkpoint holds no RNG states (--no-save-rng): random streams restart "
            "from --seed")
        return []
    states = ckpt.object(key)
    if isinstance(states, list) and len(states) == 1 and isinstance(states[0], list):
        states = states[0]  # (megatron-core's torch_dist saves a sharded object's data inside a list)
    if not isinstance(states, list) or not states or not isinstance(states[0], dict):
        raise CheckpointError(f"{ckpt.path}: {key} is not Megatron's list of RNG state dicts")
    s = states[grid.data_rank() if len(states) > 1 else 0]  # (one per DP rank with --data-parallel-random-init)
    try:
        random.setstate(s["random_rng_state"])
        np.random.set_state(s["np_rng_state"])
        torch.set_rng_state(s["torch_rng_state"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{ckpt.path}: {key} does not hold Megatron's CPU RNG states ({e})") from None
    done = ["python", "numpy", "torch"]
    if on_cuda:
        from megalite.tensor_parallel import get_rng_tracker
        torch.cuda.set_rng_state(s["cuda_rng_state"])
        tracker = get_rng_tracker()
        mine = tracker.get_states()
        theirs = s.get("rng_tracker_states") or {}
        tracker.set_states({k: theirs.get(k, v) for k, v in mine.items()})
        done += ["cuda"] + [k for k in mine if k in theirs]
        other = sorted(set(theirs) - set(mine))
        if other:
            log(f"megalite: Megatron-LM's RNG streams {', '.join(other)} have no counterpart here (not used)")
    else:
        log("megalite: Megatron-LM's CUDA RNG states (its default CUDA stream and its tracker's, which drive dropout) "
            "do not map to a CPU run: those streams restart from --seed; Python's, numpy's and torch's CPU ones "
            "are restored")
    return done
