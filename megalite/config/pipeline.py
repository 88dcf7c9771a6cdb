"""What the measured pipeline re-cut (pipeline/auto_layout.py, --pipeline-model-parallel-layout auto) is built
from: how many passes it times, each stage's memory budget, the layers it deals out and how it reads its batches."""

import dataclasses

from megalite.config.data import LoaderConfig
from megalite.config.section import DERIVED, Section


@dataclasses.dataclass(frozen=True)
class AutoLayoutConfig(Section):
    pipeline_model_parallel_layout: str  # "auto": measured and re-cut (else the layout is the model's)
    pipeline_layout_profile_iters: int
    device_memory_budget: list  # GiB per stage (None: the device's own, on CUDA)
    num_layers: int
    loader: LoaderConfig = dataclasses.field(metadata=DERIVED)  # the profiled passes' batches

    @classmethod
    def of(cls, args):
        return super().of(args, loader=LoaderConfig.of(args))
