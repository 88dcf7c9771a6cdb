"""DataCursor: where the training data stands (samples consumed) and the iterators that read on from there. It is
the one place the training iterators are rebuilt: a restart of the position (a resumed run, an asynchronous
replica's slot, a replica past its idle iterations) or of the plan (--data-parallel-shares auto's new counts, a
fault-tolerant quorum's split). It holds the plan and the DP rank whose micro-batches this rank runs: the step reads
them here, so a part that re-deals the batch (fault tolerance) hands the cursor a new plan and touches nothing else."""

from megalite.batching.data_iterators import data_iterators


class DataCursor:
    def __init__(self, dataset, consumed, loader, chunks, plan, rank):
        """loader: the LoaderConfig (config/data.py) the iterators read with."""
        self.dataset, self.consumed, self.loader, self.chunks, self.plan = dataset, consumed, loader, chunks, plan
        self.rank = rank  # this rank's DP rank across the replicas (the plan's counts and sizes are by it)
        self.ranks = None  # the parts each global batch is read in (None: the grid's; a quorum's after a replan)
        self.iters = None
        self.rebuild()

    def replan(self, plan, rank, ranks):
        """A new plan, this rank as DP rank `rank` of `ranks` (fault-tolerant replicas: of the live replicas' DP
        ranks), and the iterators on from where the cursor stands."""
        self.plan, self.rank, self.ranks = plan, rank, ranks
        self.rebuild()

    def rebuild(self, consumed=None, rank=None, ranks=None):
        """Iterators from `consumed` samples (default: where the cursor stands) of DP rank `rank`'s part (default
        this rank's; an asynchronous replica reads the part of the slot it trains) of `ranks` parts (default the
        grid's; fault-tolerant replicas: the live replicas' DP ranks)."""
        if consumed is not None:
            self.consumed = consumed
        self.iters = data_iterators(self.dataset, self.consumed, self.loader, self.chunks, plan=self.plan,
                                    rank=self.rank if rank is None else rank,
                                    ranks=self.ranks if ranks is None else ranks)

    def advance(self, samples):
        """One iteration's global batch read (the iterators moved by it themselves)."""
        self.consumed += samples
