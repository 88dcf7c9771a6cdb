"""Tensor- and sequence-parallel building blocks (usable outside megalite's models)."""

from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.layers import (
    ColumnParallelLinear,
    DuplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    padded_vocab_size,
)
from megalite.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    linear_with_sequence_parallel_gather,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megalite.tensor_parallel.random import checkpoint, get_rng_tracker, model_parallel_manual_seed

__all__ = [
    "ColumnParallelLinear", "DuplicatedLinear", "RowParallelLinear", "VocabParallelEmbedding", "padded_vocab_size",
    "vocab_parallel_cross_entropy", "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region", "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region", "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "linear_with_sequence_parallel_gather",
    "checkpoint", "get_rng_tracker", "model_parallel_manual_seed",
]
