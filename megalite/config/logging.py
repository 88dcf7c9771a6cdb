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
    log_interval: int  # (the Logging part's: training/parts.py)
    log_max_attention_logit: bool
    log_params_norm: bool  # (grad_stats, training/step.py: one all-reduce each)
    log_num_zeros_in_grad: bool
    zero_stage: int  # (ZeRO-3's parameters norm is over the shards)
    flags: dict = dataclasses.field(default_factory=dict, metadata=DERIVED)  # every flag: W&B's run config

    @classmethod
    def of(cls, args):
        return super().of(args, flags=dict(vars(args)))
