"""DataCursor: where the training data stands (samples consumed) and the iterators that read on from there. It is
the one place the training iterators are rebuilt: a restart of the position (a resumed run, an asynchronous
replica's slot, a replica past its idle iterations) or of the plan (--data-parallel-shares auto's new counts)."""

from megalite.batching.data_iterators import data_iterators


class DataCursor:
    def __init__(self, dataset, consumed, args, chunks, plan):
        self.dataset, self.consumed, self.args, self.chunks, self.plan = dataset, consumed, args, chunks, plan
        self.iters = None
        self.rebuild()

    def rebuild(self, consumed=None, rank=None, ranks=None):
        """Iterators from `consumed` samples (default: where the cursor stands) of DP rank `rank`'s part (default
        this rank's; an asynchronous replica reads the part of the slot it trains) of `ranks` parts (default the
        grid's; fault-tolerant replicas: the live replicas' DP ranks)."""
        if consumed is not None:
            self.consumed = consumed
        self.iters = data_iterators(self.dataset, self.consumed, self.args, self.chunks, plan=self.plan, rank=rank,
                                    ranks=ranks)

    def advance(self, samples):
        """One iteration's global batch read (the iterators moved by it themselves)."""
        self.consumed += samples
