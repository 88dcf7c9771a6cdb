"""What saving and loading (checkpoint/manager.py) are built from: where, what is kept or skipped, how it is
written and checked, and what the checkpoint's metadata records of the run (its optimizer's kind and ZeRO layout,
the tokenizer that goes with the weights)."""

import dataclasses

from megalite.config.section import Section


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
    save: str
    save_interval: int  # (the Saver part's: training/parts.py)
    load: str
    async_save: bool
    finetune: bool  # the weights only, from iteration 0
    no_save_optim: bool
    no_save_rng: bool
    no_load_optim: bool
    no_load_rng: bool
    verify_integrity: bool
    no_checkpoint_fallback: bool  # (a --load checkpoint that does not verify: stop, not the newest one that does)
    exit_on_missing_checkpoint: bool  # (--load: a directory without a checkpoint ends the run)
    save_retain_interval: int
    use_distributed_optimizer: bool  # (recorded: the optimizer state's layout)
    zero_stage: int
    optimizer: str  # (recorded, and checked on load: a state is another optimizer's)
    muon_scalar_optimizer: str
    tokenizer_type: str  # (recorded beside the weights, for tools/ that read the checkpoint alone)
    tokenizer_model: str
    vocab_file: str
    merge_file: str
