"""Configuration as values: the model's architecture (model.py: ModelConfig, and the name lists derived from each
field's declared role, fields.py), how it executes (execution.py: ExecutionConfig, which ModelConfig inherits) and
the training's (training.py: TrainingConfig); `fail`, a user's error as one line."""

from megalite.config.execution import ExecutionConfig  # noqa: F401
from megalite.config.model import (CHECKPOINT_ARGS, FLAG_FIELDS, LAYOUT_FIELDS, SHAPE_FIELDS, Field,  # noqa: F401
                                   ModelConfig, model_fields)
from megalite.config.training import TrainingConfig  # noqa: F401
from megalite.errors import ConfigError, fail  # noqa: F401
