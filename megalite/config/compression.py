"""What the data-parallel gradients' compression (distributed/grad_compression.py) is built from."""

import dataclasses

from megalite.config.section import Section


@dataclasses.dataclass(frozen=True)
class GradCompressionConfig(Section):
    grad_compression: str  # none | topk | powersgd
    grad_compression_ratio: float
    grad_compression_start_iter: int
    seed: int  # (the compressor's own random projections)
