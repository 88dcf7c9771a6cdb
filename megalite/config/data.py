"""What the GPT datasets' wrappers are built from: fill-in-the-middle samples (data/fim.py) and the masks a batch
carries at document boundaries (data/gpt_batch.py)."""

import dataclasses

from megalite.config.section import Section


@dataclasses.dataclass(frozen=True)
class FimConfig(Section):
    fim_data: bool
    fim_rate: float
    fim_spm_rate: float
    fim_split_sample: str
    fim_fragment_rate: float
    fim_no_prefix: str
    fim_prefix_token: str
    fim_middle_token: str
    fim_suffix_token: str
    fim_pad_token: str
    fim_eod_token: str
    seed: int  # each split's FIM stream: seed + its index


@dataclasses.dataclass(frozen=True)
class BatchMaskConfig(Section):
    reset_position_ids: bool
    reset_attention_mask: bool
    eod_mask_loss: bool


@dataclasses.dataclass(frozen=True)
class LoaderConfig(Section):
    """What the data loaders (batching/data_iterators.py) read with."""
    micro_batch_size: int  # (evaluation and the memory budget's probes pass their own)
    num_workers: int
    seed: int  # the loader's own generator
