"""`--load DIR` on a Megatron-LM torch_dist --save directory: the first rank of each node converts it once into a
megalite checkpoint in the node's temporary directory (convert.import_megatron: weights, iteration, consumed
samples, Adam's state, the LR schedule), every rank then loads that at the run's own layout, and it is removed.
A conversion that fails stops every rank with the one line it raised (the others do not wait forever)."""

import hashlib
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from megalite.checkpoint.convert import import_megatron
from megalite.checkpoint.megatron import iteration_path
from megalite.checkpoint.storage import CheckpointError


def converted_dir(root):
    """Where a node keeps its conversion of the Megatron checkpoint at `root` (by its path and iteration)."""
    path, it = iteration_path(root)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{it}".encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"megalite-from-megatron-{key}")


def convert_for_load(root, model_config_of, group, device, log, load_optim=True):
    """The megalite checkpoint to load in place of the Megatron one at `root` (collective over `group`, or one
    process when group is None). log(message): the run's own printer."""
    out = converted_dir(root)
    local_first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    error = ""
    if local_first:
        try:
            shutil.rmtree(out, ignore_errors=True)
            src, optim = import_megatron(root, out, 1, 1, model_config_of, load_optim)
            log(f"megalite: --load {root}: Megatron-LM iteration {src.iteration} converted (weights, iteration, "
                f"{src.consumed()[0]} samples consumed" + (", Adam's state, LR schedule, loss scale)" if optim else
                                                           "; no optimizer state)"))
        except (CheckpointError, ValueError) as e:
            error = str(e).splitlines()[0] if str(e) else type(e).__name__
    failed = torch.tensor([1 if error else 0], device=device)
    if group is not None:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if failed.item():
        raise CheckpointError(error or f"--load {root}: converting the Megatron-LM checkpoint failed on another node")
    return out


def restore_rng(root, chunks, log):
    """This rank's random streams from the Megatron-LM directory, where they map (megatron_rng.py); log(line): the
    run's printer, called on the first rank only."""
    from megalite import parallel_state as ps
    from megalite.checkpoint.megatron import MegatronCheckpoint
    from megalite.checkpoint.megatron_rng import restore
    grid = ps.grid_of(chunks)
    lines = []
    on_cuda = any(p.is_cuda for c in chunks for p in c.parameters())
    restore(MegatronCheckpoint(root), grid, on_cuda, lines.append)
    if grid.rank == 0:
        for line in lines:
            log(line)


def remove_converted(root, group):
    """After every rank loaded: the node's conversion goes."""
    if group is not None:
        dist.barrier(group=group)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        shutil.rmtree(converted_dir(root), ignore_errors=True)
