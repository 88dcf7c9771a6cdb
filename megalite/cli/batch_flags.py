"""The batch flags' derived values, set once by validation: the batch schedule checked (batching/iteration_plan.py
builds it from the BatchingConfig section), --global-batch-size as a --step-batch-size-schedule's last batch and
--train-iters from --train-samples."""

from megalite.batching.iteration_plan import batch_schedule
from megalite.config import ConfigError
from megalite.config.batching import BatchingConfig


def derive_train_iters(args):
    """Check the batch schedule; --global-batch-size becomes a --step-batch-size-schedule's last batch (what
    iteration-based LR steps are counted in), and --train-iters follows from --train-samples."""
    schedule = batch_schedule(BatchingConfig.of(args))
    args.global_batch_size = schedule.final
    if args.train_samples is not None:
        args.train_iters = schedule.iterations_for(args.train_samples)
        if args.train_iters < 1:
            raise ConfigError(f"--train-samples {args.train_samples} is less than one global batch "
                              f"({schedule.final}); raise it or lower --global-batch-size")
    return schedule
