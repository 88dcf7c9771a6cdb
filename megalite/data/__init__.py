"""Data pipeline: tokenizers, Megatron mmap indexed datasets, GPT/blended datasets,
the pretraining sampler and the built-in default corpus. Deliberately free of
torch.distributed and of other megalite packages: callers pass `is_builder`/`barrier`."""

from .blended_dataset import BlendedDataset
from .builder import build_gpt_datasets, build_gpt_datasets_per_split, parse_data_path
from .gpt_dataset import GPTDataset
from .indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from .samplers import MegatronPretrainingSampler, SharesPretrainingSampler
from .tokenizer import TOKENIZER_TYPES, build_tokenizer

__all__ = ["BlendedDataset", "GPTDataset", "IndexedDataset", "IndexedDatasetBuilder",
           "MegatronPretrainingSampler", "SharesPretrainingSampler", "TOKENIZER_TYPES", "build_gpt_datasets",
           "build_gpt_datasets_per_split",
           "build_tokenizer",
           "parse_data_path"]
