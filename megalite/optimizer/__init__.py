from megalite.optimizer.distributed_optimizer import DistributedOptimizer, reassemble_full_state
from megalite.optimizer.lr_scheduler import LRScheduler
from megalite.optimizer.optimizer import MixedPrecisionOptimizer

__all__ = ["MixedPrecisionOptimizer", "DistributedOptimizer", "reassemble_full_state", "LRScheduler"]
