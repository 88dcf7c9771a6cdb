"""Configuration as values: the model's (model.py: ModelConfig, each field's declared role and the name lists
derived from them) and the training's (training.py: TrainingConfig); `fail`, a user's error as one line."""

from megalite.config.model import (CHECKPOINT_ARGS, FLAG_FIELDS, LAYOUT_FIELDS, SHAPE_FIELDS, Field,  # noqa: F401
                                   ModelConfig, model_fields)
from megalite.config.training import TrainingConfig  # noqa: F401
from megalite.errors import ConfigError, fail  # noqa: F401
