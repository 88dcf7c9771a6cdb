"""Megatron's per-sample masks for a GPT sample that packs several documents:
--eod-mask-loss, --reset-position-ids, --reset-attention-mask (its `_get_ltor_masks_and_position_ids`).

Everything is decided on the input tokens (the sample without its last token): an end-of-
document token still belongs to its document; the token after it starts the next one.
"""

import numpy as np


def ltor_masks_and_position_ids(tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """tokens [s] -> (attention_mask [1, s, s] bool, True = masked out, or None when causal is
    enough; loss_mask [s] float32; position_ids [s] int64)."""
    tokens = np.asarray(tokens)
    s = tokens.size
    is_eod = tokens == eod
    loss_mask = np.ones(s, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    doc = np.cumsum(is_eod) - is_eod  # document of each position: the EODs strictly before it
    pos = np.arange(s, dtype=np.int64)
    position_ids = pos
    if reset_position_ids and s:
        starts = np.zeros(int(doc[-1]) + 1, dtype=np.int64)
        starts[1:] = pos[is_eod][: len(starts) - 1] + 1  # each later document starts after an EOD
        position_ids = pos - starts[doc]
    mask = None
    if reset_attention_mask:
        mask = ((pos[None, :] > pos[:, None]) | (doc[None, :] != doc[:, None]))[None]
    return mask, loss_mask, position_ids


class GPTBatchDataset:
    """A GPT dataset's samples ({"text": [s + 1]}) with the masks the flags ask for added:
    "loss_mask" and "position_ids" [s], and "attention_mask" [1, s, s] with --reset-attention-mask
    (built with the sample, as Megatron's loader does, so the model never scans for EODs)."""

    def __init__(self, dataset, eod, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False):
        self.dataset, self.eod = dataset, eod
        self.flags = (reset_position_ids, reset_attention_mask, eod_mask_loss)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        sample = dict(self.dataset[i])
        mask, loss_mask, position_ids = ltor_masks_and_position_ids(np.asarray(sample["text"])[:-1], self.eod,
                                                                    *self.flags)
        sample.update(loss_mask=loss_mask, position_ids=position_ids)
        if mask is not None:
            sample["attention_mask"] = mask
        return sample


def with_batch_masks(datasets, cfg, eod):
    """Wrap (train, valid, test) when any of the three flags is given (else unchanged); cfg: the BatchMaskConfig
    (config/data.py)."""
    flags = (cfg.reset_position_ids, cfg.reset_attention_mask, cfg.eod_mask_loss)
    if not any(flags):
        return datasets
    if eod is None:
        raise ValueError("--eod-mask-loss / --reset-position-ids / --reset-attention-mask need a tokenizer with an "
                         "end-of-document token (--tokenizer-type ...)")
    return tuple(None if d is None else GPTBatchDataset(d, eod, *flags) for d in datasets)
