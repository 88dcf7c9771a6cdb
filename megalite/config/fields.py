"""What a configuration field is, declared once with its type (`Annotated[type, Field(...)]`): the command-line
flag it comes from and its role for checkpoints; every list of names derives from these (model.py)."""

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Field:
    """What a ModelConfig field is, declared once with its type (`Annotated[type, Field(...)]`); every list of
    names is derived from these (below): flag: the command-line dest it comes from ("": its own name; None:
    derived from other flags in config/from_flags.py); shape: it decides tensor shapes or their meaning, so a
    checkpoint must agree (SHAPE_FIELDS); layout: how this run executes, not what the model is, reset when a
    checkpoint's model is rebuilt on one process (LAYOUT_FIELDS); restored: --use-checkpoint-args takes it from
    the checkpoint (CHECKPOINT_ARGS, Megatron's load_args_from_checkpoint)."""
    flag: Optional[str] = ""
    shape: bool = False
    layout: bool = False
    restored: bool = False


PLAIN = Field()
SHAPE_RESTORED, RESTORED, LAYOUT = Field(shape=True, restored=True), Field(restored=True), Field(layout=True)
