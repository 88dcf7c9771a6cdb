"""What the training loop (training/trainer.py) and its small parts (training/parts.py) are built from: how long it
runs, what it checks between iterations, when it collects garbage and when it stops early."""

import dataclasses

from megalite.config.section import Section


@dataclasses.dataclass(frozen=True)
class LoopConfig(Section):
    train_iters: int
    skip_train: bool
    global_batch_size: int  # (an asynchronous replica's last samples)
    deterministic_mode: bool
    check_for_nan_in_loss_and_grad: bool  # a NaN/Inf lm loss stops the run
    manual_gc: bool
    manual_gc_interval: int
    test_mode: bool  # the replicas' weights compared every iteration, TP ranks too
    check_weight_hash_across_dp_replicas_interval: int
    data_parallel_precisions: list  # (replicas of different precisions: their fp32 main weights compared)
    exit_interval: int
    exit_signal_handler: bool
    exit_duration_in_mins: float

    @property
    def hash_interval(self):
        """Iterations between the replicas' weight comparisons (None / 0: never)."""
        return 1 if self.test_mode else self.check_weight_hash_across_dp_replicas_interval
