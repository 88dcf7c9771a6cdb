"""The training loop's data: Megatron's sampler through a torch DataLoader (--num-workers worker
processes; pinned host memory on CUDA), read by the first rank of each TP x CP group and
broadcast to the others, which hold the same samples (Megatron's get_batch_on_this_tp_rank
idea: one reader per group instead of copies of the same reads); each CP rank then keeps its
part of every sequence (megalite.distributed.cp_comm.slice_for_cp_rank, in forward_step)."""

import torch

from megalite import parallel_state as ps
from megalite.distributed.collectives import broadcast_batch


def _collate(samples):
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]}


def build_data_iterator(dataset, consumed_samples, loader, every_stage=False, micro_batch_size=None, plan=None,
                        rank=None, *, grid, ranks=None):
    """Yield {key: tensor [micro, ...]} (every key of the samples, e.g. GPT's "text" [micro, seq+1])
    for this DP rank, resuming at consumed_samples; loader: the LoaderConfig (config/data.py). Only pipeline
    stages that consume tokens or labels (first and last) read data, unless every_stage. micro_batch_size: default
    --micro-batch-size (evaluation passes its own). plan: the IterationPlan; with uneven shares
    each rank reads its contiguous slice of every global batch. rank: the DP rank (across replicas) whose
    part is read (default this rank's; asynchronous replicas read the part of the slot they train). grid: the
    layout whose ranks read. ranks: how many parts each global batch is read in (default
    the grid's DP ranks over its replicas; fault-tolerant replicas: the live ones')."""
    g = grid
    if dataset is None or not (every_stage or g.first_stage() or g.last_stage()):
        return None
    from megalite.data import MegatronPretrainingSampler, SharesPretrainingSampler
    if rank is None:  # semi-synchronous replicas read their own parts
        rank = g.data_rank()
    if plan is not None and plan.uneven:
        sampler = SharesPretrainingSampler(len(dataset), consumed_samples, plan.micro_of(rank), rank, plan)
    else:
        sampler = MegatronPretrainingSampler(len(dataset), consumed_samples,
                                             micro_batch_size or loader.micro_batch_size, rank,
                                             g.data_ranks() if ranks is None else ranks)
    device = ps.get_device()
    reader = g.tp_cp_rank() == 0  # one reader per TP x CP group
    workers = loader.num_workers

    # Started here, not at the first batch: the workers prefetch while the model is built.
    # Its own generator: the loader's seed draw must not advance the global RNG on the reader
    # only (hidden dropout on CPU draws from it and must match across TP ranks).
    batches = iter(torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=workers, collate_fn=_collate,
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(loader.seed))) if reader else None

    def gen():
        layout = None
        for _ in range(len(sampler)):  # every TP rank stops together (no receiver left waiting)
            batch = None
            if reader:
                batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
            batch, layout = broadcast_batch(batch, layout, g)  # TP > 1: rank 0's batch to the others
            yield batch
    return gen()


def close_iterators(its):
    """End these iterators' DataLoader worker processes now (a generator closed drops its loader, whose workers
    exit): not whenever a garbage collection finds them, which can be in the middle of a later run in the same
    process (Megatron's scripts run back to back in one interpreter: tests/test_megatron_scripts.py hung so)."""
    for it in its or ():
        if it is not None:
            it.close()


def chunk_iterators(it, num_chunks, grid):
    """Per model chunk: the first chunk of the first stage and the last chunk of the last
    stage read the data; other chunks get None. Where one rank holds both (the V of --pipeline-schedule zbv),
    its two chunks read one iterator's micro-batches each in turn (_Shared)."""
    g, its = grid, [None] * num_chunks
    if g.first_stage():
        its[0] = it
    if g.last_stage():
        its[-1] = it
    if it is not None and num_chunks > 1 and its[0] is it and its[-1] is it:
        its[0], its[-1] = _Shared.pair(it)
    return its


class _Shared:
    """One of two readers of one iterator, each given every item (the embedding's chunk reads micro-batch i's
    tokens, the loss's chunk later its labels): an item is kept until both have taken it."""

    def __init__(self, source, queues, mine):
        self.source, self.queues, self.mine = source, queues, mine

    @classmethod
    def pair(cls, source):
        queues = ([], [])
        return cls(source, queues, 0), cls(source, queues, 1)

    def __iter__(self):
        return self

    def __next__(self):
        mine = self.queues[self.mine]
        if not mine:
            item = next(self.source)
            for q in self.queues:
                q.append(item)
        return mine.pop(0)

    def close(self):
        if hasattr(self.source, "close"):
            self.source.close()


def data_iterators(dataset, consumed_samples, loader, chunks, micro_batch_size=None, plan=None, rank=None,
                   ranks=None):
    """chunk_iterators, or, for a model whose every stage needs its inputs (BERT's padding mask,
    GPT's document masks: `input_on_every_stage`), one iterator per chunk on every stage, on the chunks' grid."""
    grid = ps.grid_of(chunks)
    if getattr(chunks[0].module, "input_on_every_stage", False):
        return [build_data_iterator(dataset, consumed_samples, loader, True, micro_batch_size, plan, rank,
                                    grid=grid, ranks=ranks)
                for _ in chunks]
    return chunk_iterators(build_data_iterator(dataset, consumed_samples, loader, False, micro_batch_size, plan, rank,
                                               grid=grid, ranks=ranks), len(chunks), grid)
