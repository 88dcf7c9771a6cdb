"""What the metrics logger (megalite/logger.py) is built from: where the log line's values go (TensorBoard, W&B,
JSON lines), which optional values it adds, and what the line says of the run."""

import dataclasses

from megalite.config.section import DERIVED, Section


@dataclasses.dataclass(frozen=True)
class LoggingConfig(Section):
    tensorboard_dir: str
    log_json: str
    log_validation_ppl_to_tensorboard: bool
    log_memory_to_tensorboard: bool
    log_timers_to_tensorboard: bool
    wandb_project: str
    wandb_exp_name: str
    wandb_entity: str
    wandb_save_dir: str
    save: str  # (W&B's directory without --wandb-save-dir: under --save)
    train_iters: int  # the log line's "iteration i/N"
    global_batch_size: int  # its batch size when an iteration does not say
    flags: dict = dataclasses.field(default_factory=dict, metadata=DERIVED)  # every flag: W&B's run config

    @classmethod
    def of(cls, args):
        return super().of(args, flags=dict(vars(args)))
