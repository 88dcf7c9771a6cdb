from megalite.optimizer.lr_scheduler import LRScheduler
from megalite.optimizer.optimizer import MixedPrecisionOptimizer

__all__ = ["MixedPrecisionOptimizer", "LRScheduler"]
