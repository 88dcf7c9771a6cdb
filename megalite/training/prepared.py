"""A run as setup.prepare builds it before its first iteration: what the Trainer holds, every field declared."""

import dataclasses


@dataclasses.dataclass(slots=True)
class PreparedRun:
    args: object  # the run configuration (config/run.py), with the vocabulary the data decided
    batches: object  # each iteration's global batch (batching/microbatches.py: ramp-up, step schedules)
    dp_rank: int  # this rank's data-parallel rank across the replicas
    rerun: object = None  # --rerun-mode's RerunStateMachine (megalite/rerun.py), handed to each step
    checkpoints: object = None  # the checkpoint group and async writer (checkpoint/writer.py), closed at the end
    plan: object = None  # each DP rank's micro-batches: count, size, weight (batching/iteration_plan.py)
    log: object = None  # the MetricsLogger (TensorBoard, wandb, JSON lines)
    train_ds: object = None  # the splits (None: none, or nothing left to train on)
    valid_ds: object = None
    test_ds: object = None
    mcfg: object = None  # the ModelConfig (this replica's precision)
    tcfg: object = None  # the TrainingConfig
    chunks: list = None  # this rank's model chunks, each wrapped by DistributedDataParallel
    optimizer: object = None
    scheduler: object = None  # the LR (and weight-decay) schedule
    converters: list = None  # the model converters' step hooks (training/converter.py: FP8), [] without
    aux: object = None  # the chunks' AuxLossTracker (moe/aux_losses.py), read by the log line
    semi: object = None  # semi-synchronous replicas' outer steps, or None
    load: str = None  # the directory loaded from (--load, or --save's own checkpoint), or None
    start_iter: int = 0  # the iteration loaded (0: from scratch)
    consumed_train: int = 0  # samples consumed before start_iter
    consumed_valid: int = 0
    eval_g: int = None  # the evaluation's global batch and micro-batch sizes
    eval_mbs: int = None
    eval_plan: object = None  # the evaluation's micro-batches per DP rank
    shape: tuple = None  # what the schedules send between stages, in training and in evaluation
    eval_shape: tuple = None
    dtype: object = None  # the model's parameter dtype (what the stages send)
