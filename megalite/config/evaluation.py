"""What evaluation (training/evaluation.py, the Evaluation part) is built from: how often and how long it runs, its
batch, the sizes of the splits it asks the data for, and how its batches are read."""

import dataclasses

from megalite.config.data import LoaderConfig
from megalite.config.section import DERIVED, Section


@dataclasses.dataclass(frozen=True)
class EvaluationConfig(Section):
    eval_iters: int  # (0: no evaluation, as Megatron)
    eval_interval: int
    eval_global_batch_size: int  # (None: training's)
    eval_micro_batch_size: int
    eval_micro_batch_sizes: list  # per DP replica (set by validation from --data-parallel-micro-batch-sizes)
    global_batch_size: int
    micro_batch_size: int
    train_iters: int  # (the splits' sizes: every evaluation of the run)
    train_samples: int
    skip_train: bool
    data_path: list  # (an empty split's reason: the documents --split gives it)
    split: str
    train_data_path: list  # (per-split paths: an empty split is one without its --valid/--test-data-path)
    model_type: str  # (BERT's splits count documents)
    manual_gc: bool  # --manual-gc-eval: collections around each evaluation
    manual_gc_eval: bool
    loader: LoaderConfig = dataclasses.field(metadata=DERIVED)

    @classmethod
    def of(cls, args):
        return super().of(args, loader=LoaderConfig.of(args))

    @property
    def batch(self):
        """(global batch, micro-batch) of one evaluation iteration (Megatron's --eval-*-batch-size, else training's)."""
        return (self.eval_global_batch_size or self.global_batch_size,
                self.eval_micro_batch_size or self.micro_batch_size)
